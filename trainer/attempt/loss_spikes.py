"""Loss-spike rollback (`loss_spike_threshold`): a step whose loss jumps is undone and its data skipped.

A step whose loss exceeds `threshold` times the median of the previous `window` losses is a spike (the
PaLM recipe). A step is judged once at least `min_history` (MIN_HISTORY, 4, or `window` if smaller) losses
are known, against the median of those it has (up to `window`): a process's first steps, and the first
steps after it starts again, are judged on a shorter history rather than trained blind. Early in training
the loss falls, so a short median is above the current loss, not below it. A step with no loss tokens (an
SFT batch of prompts only) has no loss: it is neither judged nor counted. On a spike the loop returns a
rollback outcome, the supervisor restores the newest held state (a snapshot, the local tier or a
checkpoint, all from before the spike: with this on, the loop reads a step's loss before anything saves
that step), and the next attempt skips the batches from the restored step through the spike. Those batches
are named by their fingerprints in the `loss_spike_rollback` event; every later batch with one of them is
skipped, in this process and in any restarted one (which reads them back from the run's events.jsonl), so
they never reach the model again, whatever state a restart resumes from. Steps are bitwise deterministic,
so the rolled-back run is reproducible.

`max_rollbacks` rollbacks within `rollback_window` steps mean the spikes are not a few bad batches:
the run stops (`LossSpikesPersist`, exit 3) and says so.
"""

from __future__ import annotations

import collections
import logging
import statistics
from collections.abc import Iterable

from trainer.errors import GaveUp
from trainer.observe import catalogue

log = logging.getLogger(__name__)

MIN_HISTORY = 4  # losses known before a step is judged (at most `window`); see the module docstring
FINGERPRINTS_KEPT = 100_000  # fingerprints of recent steps held to name a rollback's batches (~5 MB)


class LossSpikesPersist(GaveUp):
    """Loss spikes came back faster than rolling back could get past them."""


class LossSpikePolicy:
    """Detects spikes in the metrics records and remembers which batches to skip."""

    def __init__(
        self,
        threshold: float,
        window: int,
        max_rollbacks: int,
        rollback_window: int,
        events,
        *,
        min_history: int = MIN_HISTORY,
        skipped: Iterable[str] = (),
    ):
        self.threshold = threshold
        self.window = window
        self.min_history = max(1, min(min_history, window))
        self.max_rollbacks = max_rollbacks
        self.rollback_window = rollback_window
        self.events = events
        self.skipped: set[str] = set(skipped)
        self._losses: collections.deque[float] = collections.deque(maxlen=window)
        self._fingerprints: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._spike: dict | None = None  # the spike the next attempt rolls back from
        self._rollbacks: list[int] = []  # steps of this process's rollbacks

    @classmethod
    def off(cls, events) -> LossSpikePolicy:
        """The policy of `loss_spike_threshold=0`: no step is a spike, no batch is skipped."""
        return cls(0.0, 1, 1, 1, events)

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    def skips(self, fingerprint: str) -> bool:
        """Whether a batch was rolled back from once and must never be trained."""
        return fingerprint in self.skipped

    def check(self, record: dict) -> bool:
        """True when the step of `record` is a spike: the run must roll back to before it."""
        if not self.enabled or not record.get("finite", True):
            return False
        step, loss = record["step"], record["loss"]
        self._remember(step, record.get("batch_fingerprint"))
        if record.get("loss_tokens", 1) == 0:  # nothing was trained on: no loss to judge or to remember
            return False
        if len(self._losses) < self.min_history:
            self._losses.append(loss)
            return False
        median = statistics.median(self._losses)
        if loss <= self.threshold * median:
            self._losses.append(loss)
            return False
        recent = [s for s in self._rollbacks if s > step - self.rollback_window]
        if len(recent) >= self.max_rollbacks:
            raise LossSpikesPersist(
                f"loss spike at step {step} (loss {loss:.4g} > {self.threshold:g} x median {median:.4g}) after "
                f"{len(recent)} rollbacks within {self.rollback_window} steps (loss_spike_max_rollbacks="
                f"{self.max_rollbacks}): the spikes are not a few bad batches; lower the learning rate or check "
                "the data, then rerun the same command to resume from the newest checkpoint"
            )
        self._rollbacks.append(step)
        self._spike = {"step": step, "loss": loss, "median": median}
        log.warning(
            "loss spike at step %d: loss %.4g > %g x median %.4g: rolling back", step, loss, self.threshold, median
        )
        return True

    def attempt_started(self, start_step: int) -> None:
        """The attempt after a spike restored `start_step`: its batches from there through the spike are
        skipped from now on (and recorded, for restarted processes)."""
        spike, self._spike = self._spike, None
        if spike is None:
            return
        steps = range(start_step + 1, spike["step"] + 1)
        fingerprints = [self._fingerprints[s] for s in steps if s in self._fingerprints]
        if len(fingerprints) < len(steps):
            log.warning(
                "loss spike rollback: only %d of the %d batches since step %d are known; skipping those",
                len(fingerprints),
                len(steps),
                start_step,
            )
        self.skipped.update(fingerprints)
        self.events.emit(
            catalogue.LOSS_SPIKE_ROLLBACK,
            step=spike["step"],
            loss=spike["loss"],
            median=spike["median"],
            restored_step=start_step,
            skipped_steps=len(steps),
            fingerprints=fingerprints,
        )

    def _remember(self, step: int, fingerprint: str | None) -> None:
        if fingerprint is None:
            return
        self._fingerprints[step] = fingerprint
        self._fingerprints.move_to_end(step)
        while len(self._fingerprints) > FINGERPRINTS_KEPT:
            self._fingerprints.popitem(last=False)


def skipped_fingerprints(events: Iterable[dict]) -> set[str]:
    """Every batch an earlier process of the run rolled back from (its events.jsonl)."""
    return {
        fp for e in events if e.get("event") == catalogue.LOSS_SPIKE_ROLLBACK for fp in e.get("fingerprints", ())
    }
