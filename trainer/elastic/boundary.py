"""What an attempt does between two steps, besides training: the elastic bookkeeping.

One `StepBoundary` per attempt, built by the supervisor from explicit parts; the train loop calls
`before_step` and `after_step` and acts on what `after_step` returns (slices to scale up onto). In
order, after step N has been dispatched:
1. the profiler window;
2. the recovery timeline: the first step completed after a failure ends its downtime;
3. a host snapshot every `periods.snapshot` steps (taken asynchronously), and every `periods.local`
   steps one that is also written to the local checkpoint tier (with `wait_for_local_write`, waited for
   one step later, so a lost process loses at most the period); `auto` periods are planned here
   (`trainer.elastic.periods`);
4. fault injection (local virtual slices): faults due before step N+1 fire here;
5. returning slices: the membership round (several processes, every step) or a health check of the
   inactive slices (at most every poll interval); any found are returned, for the supervisor to act on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax

from trainer.observe import catalogue


@dataclasses.dataclass
class RecoveryStats:
    """Counters across attempts: the last completed step, failures, steps lost, and downtime (from the
    moment a failure reached the train function to the first completed step after it)."""

    last_step: int = 0
    furthest_step: int = 0  # the run's net progress: the furthest step any attempt completed
    failed_at: float | None = None  # wall time of the failure not yet recovered from
    downtime_s: float = 0.0
    steps_lost: int = 0
    failures: int = 0


class StepBoundary:
    def __init__(
        self,
        *,
        active: Sequence[int],
        stats: RecoveryStats,
        events,
        profiler,
        snapshots,
        periods,
        wait_for_local_write: bool = False,
        injector=None,
        returning: Callable[[], list[int]] = list,
        wall_time: Callable[[], float] = time.time,
    ):
        self.active = list(active)
        self.stats = stats
        self.events = events
        self.profiler = profiler
        self.snapshots = snapshots
        self.periods = periods  # .snapshot and .local, read every step (trainer.elastic.periods.AutoPeriods)
        self.wait_for_local_write = wait_for_local_write
        self._writing: int | None = None  # the step whose local write may still be running
        self.injector = injector
        self.returning = returning
        self.wall_time = wall_time

    def before_step(self, step: int) -> None:
        self.profiler.before_step(step)

    def before_stop(self, step: int, state, data_state: dict) -> None:
        """A stop at `step`: with the local tier on, write the state there first (synchronously; the
        fastest save), before the loop's persistent checkpoint."""
        if self.periods.local:
            self.snapshots.take(step, state, data_state, block=True, persist=True)

    def saves_at(self, step: int) -> bool:
        """Whether `after_step(step, ...)` takes a snapshot (plans first: a new plan may make one due)."""
        self.periods.after_step(step)  # idempotent per step: after_step's own call then changes nothing
        return self.periods.due("local", step) or self.periods.due("snapshot", step)

    def after_step(self, step: int, state, data_state: Callable[[], dict]) -> list[int]:
        """Bookkeeping after `step` was dispatched (`state` is its output, maybe still running);
        returns the slices that came back (empty: carry on)."""
        self.stats.last_step = step
        self.stats.furthest_step = max(self.stats.furthest_step, step)
        self.profiler.after_step(step, state)
        if self.stats.failed_at is not None:
            jax.block_until_ready(state)  # the timeline's "first step" means completed
            down = self.wall_time() - self.stats.failed_at
            self.stats.downtime_s += down
            self.stats.failed_at = None
            self.events.emit(
                catalogue.FIRST_STEP_AFTER_RECOVERY,
                step=step,
                seconds_since_detection=round(down, 3),
                slices=self.active,
            )
        if self._writing is not None and step > self._writing:
            # The local write of the previous step commits before this step's record is written, so a
            # lost process never trains more than local_checkpoint_period steps again.
            self.snapshots.wait_for_copy()
            self._writing = None
        self.periods.after_step(step)
        persist = self.periods.due("local", step)
        if persist or self.periods.due("snapshot", step):
            self.snapshots.take(step, state, data_state(), persist=persist)
            self.periods.saved(step, persisted=persist)
            self._writing = step if persist and self.wait_for_local_write else None
        if self.injector is not None:
            self.injector.at_step_boundary(step + 1, in_flight=state)
        return self.returning()
