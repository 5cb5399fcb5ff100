"""What a non-finite loss or gradient does to the run (`nan_policy`).

The train step never applies such an update (it keeps the previous params and optimizer state), so
this only decides what happens next, on the host, when the step's metrics are read:
  stop       raise NonFiniteError: exit 1 with a clear message; the last checkpoint is untouched
  skip_step  carry on; the step is counted in `skipped_steps` and logged as an event
  rollback   the loop returns a rollback outcome: the supervisor restores the newest snapshot or
             checkpoint and the batch is skipped (a second non-finite result at the same step stops the run)
"""

from __future__ import annotations

from trainer.observe import catalogue


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient under nan_policy=stop (or rollback did not help)."""


class NonFinitePolicy:
    """Applies nan_policy to each step's metrics record, and remembers the batches rolled back."""

    def __init__(self, policy: str, events):
        self.policy = policy
        self.events = events
        self.skipped_steps = 0
        self.rolled_back: set[int] = set()  # steps whose batch every later pass over them skips

    def skips(self, step: int) -> bool:
        """Whether the batch of `step` is discarded (its update was non-finite and rolled back)."""
        return step in self.rolled_back

    def check(self, record: dict) -> bool:
        """True when the run must roll back to before `record["step"]` (nan_policy=rollback); raises
        NonFiniteError under stop, or when rolling back the same step did not help."""
        if record.get("finite", True):
            return False
        step = record["step"]
        self.events.emit(
            catalogue.NONFINITE_STEP,
            step=step,
            policy=self.policy,
            loss=str(record["loss"]),
            grad_norm=str(record["grad_norm"]),
        )
        if self.policy == "skip_step":
            self.skipped_steps += 1
            return False
        if self.policy == "rollback" and step not in self.rolled_back:
            self.rolled_back.add(step)
            return True
        raise NonFiniteError(
            f"non-finite loss or gradients at step {step} (nan_policy={self.policy}); the update "
            f"was not applied and the newest committed checkpoint is intact. Lower the learning "
            f"rate, check the data, or use nan_policy=skip_step / rollback"
        )
