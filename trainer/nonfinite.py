"""What a non-finite loss or gradient does to the run (`nan_policy`).

The train step never applies such an update (it keeps the previous params and optimizer state), so
this only decides what happens next, on the host, when the step's metrics are read:
  stop       raise NonFiniteError: exit 1 with a clear message; the last checkpoint is untouched
  skip_step  carry on; the step is counted in `skipped_steps` and logged as an event
  rollback   raise RollbackRequested: the run restores its newest snapshot or checkpoint and skips
             the offending batch (a second non-finite result at the same step stops the run)
"""

from __future__ import annotations


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient under nan_policy=stop (or rollback did not help)."""


class RollbackRequested(Exception):
    """Restore the newest snapshot or checkpoint and skip the batch of `step`."""

    def __init__(self, step: int):
        super().__init__(f"non-finite loss/gradients at step {step}: rolling back and skipping its batch")
        self.step = step


class NonFinitePolicy:
    def __init__(self, policy: str, events, *, already_skipped: frozenset[int] = frozenset()):
        self.policy, self.events = policy, events
        self.already_skipped = already_skipped
        self.skipped_steps = 0

    def check(self, record: dict) -> None:
        if record.get("finite", True):
            return
        step = record["step"]
        self.events.emit(
            "nonfinite_step",
            step=step,
            policy=self.policy,
            loss=str(record["loss"]),
            grad_norm=str(record["grad_norm"]),
        )
        if self.policy == "skip_step":
            self.skipped_steps += 1
            return
        if self.policy == "rollback" and step not in self.already_skipped:
            raise RollbackRequested(step)
        raise NonFiniteError(
            f"non-finite loss or gradients at step {step} (nan_policy={self.policy}); the update "
            f"was not applied and the newest committed checkpoint is intact. Lower the learning "
            f"rate, check the data, or use nan_policy=skip_step / rollback"
        )
