"""Progress watchdog: a process that stops making progress ends, restartable, instead of idling for hours.

A collective that never returns, a host stuck in I/O or a wedged device raise nothing: the main thread
just waits. A watchdog thread watches two signals of progress, the main thread's phase
(`trainer.process.preemption.Phases`: compile, restore, steps, checkpoint_save, evaluation, ...) and, in
the step loop, each completed step (`beat`). When neither has moved for the phase's bound it calls
`on_hang` with a `Hang`; the process root (`trainer.process_root`) then dumps every thread's stack, emits
`hang_detected`, writes the newest host snapshot to the local tier when it can, and exits with the
transient code (75) so the scheduler restarts the same command, which resumes.

The bounds (`HangTimeouts`):
- between completed steps: `hang_timeout_seconds`, or with `auto` `AUTO_MULTIPLE` times the median of the
  recent step intervals, never under `AUTO_FLOOR_S`; until `MIN_INTERVALS` intervals are known (the first
  steps of a process may still compile), the phase bound;
- every other phase: `hang_timeout_phase_seconds` (compile, restore, a save's blocking part, an
  evaluation, start-up);
- waiting for slices is not watched: the elastic timeouts bound it (`elastic_timeout_seconds`).
One watchdog per process, owned by the process root (`trainer.process_root`), like the phases it reads;
the loop's beats reach it through the root.

A frozen process (SIGSTOP, a paused VM) of a job of several processes is the other failure that raises
nothing: its peers declare it dead and go on without it. When it wakes it must not write anything (its
step, records and saves belong to a formation that no longer exists). The watchdog thread ticks every
poll; a gap between ticks longer than `freeze_bound_s` (the time after which the peers declared it dead)
means the whole process was frozen: `fenced()` is then true, and every writer (the event log and the
metrics sinks) checks it, and `on_frozen` ends the process, restartable, so it comes back as a
replacement.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import threading
import time
from collections.abc import Callable

from trainer.logevents import event_extra
from trainer.process.preemption import STEPPING

log = logging.getLogger(__name__)

AUTO = -1
AUTO_MULTIPLE = 10.0
AUTO_FLOOR_S = 300.0
MIN_INTERVALS = 3
UNWATCHED = frozenset({"waiting_for_slices"})


@dataclasses.dataclass(frozen=True)
class HangTimeouts:
    """`step_s`: seconds between completed steps (AUTO: from the median step interval); `phase_s`: the
    bound of every other phase."""

    step_s: float
    phase_s: float

    def bound(self, phase: str, median_step_s: float | None) -> float | None:
        """The phase's bound in seconds; None where the phase is not watched."""
        if phase in UNWATCHED:
            return None
        if phase != STEPPING:
            return self.phase_s
        if self.step_s > 0:
            return self.step_s
        if median_step_s is None:
            return self.phase_s
        return max(AUTO_FLOOR_S, AUTO_MULTIPLE * median_step_s)


@dataclasses.dataclass(frozen=True)
class Hang:
    """No progress for `seconds` (over `timeout_s`) in `phase`; `step`: the last completed step, if any."""

    phase: str
    step: int | None
    seconds: float
    timeout_s: float


class ProgressWatchdog:
    """Calls `on_hang` (from its own thread, once) when the process makes no progress within the bound.
    `phase()`: the main thread's current phase (`Phases.current`)."""

    def __init__(
        self,
        timeouts: HangTimeouts,
        on_hang: Callable[[Hang], None],
        *,
        phase: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 1.0,
        freeze_bound_s: float = 0.0,
        on_frozen: Callable[[float], None] = lambda seconds: None,
    ):
        self.timeouts = timeouts
        self.on_hang = on_hang
        self._phase = phase
        self._clock = clock
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._seen_phase: str | None = None
        self._since = clock()  # the newest progress: a phase change or a completed step
        self._last_beat: float | None = None  # the previous step's completion, in this stretch of steps
        self._intervals: collections.deque[float] = collections.deque(maxlen=64)
        self.step: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.freeze_bound_s = freeze_bound_s  # 0: a frozen process is not fenced (one process: nobody moves on)
        self.on_frozen = on_frozen
        self._tick = clock()

    def frozen_for(self) -> float:
        """Seconds since the watchdog thread last ticked, when that is over the freeze bound; else 0."""
        gap = self._clock() - self._tick
        return gap if self.freeze_bound_s and gap > self.freeze_bound_s else 0.0

    def fenced(self) -> bool:
        """Whether this process was frozen past the point its peers declared it dead: nothing may be written."""
        return bool(self.frozen_for())

    def beat(self, step: int) -> None:
        """Step `step` completed (its metrics reached the host)."""
        with self._lock:
            now = self._clock()
            if self._last_beat is not None:
                self._intervals.append(now - self._last_beat)
            self._last_beat = self._since = now
            self.step = step

    def median_step_s(self) -> float | None:
        with self._lock:
            return statistics.median(self._intervals) if len(self._intervals) >= MIN_INTERVALS else None

    def check(self) -> Hang | None:
        """A `Hang` when the current phase has made no progress within its bound, else None."""
        phase = self._phase()
        median = self.median_step_s()
        with self._lock:
            now = self._clock()
            if phase != self._seen_phase:  # entering or leaving a phase is progress
                self._seen_phase, self._since = phase, now
                self._last_beat = None  # an interval across another phase is not a step time
                return None
            bound = self.timeouts.bound(phase, median)
            if bound is None:
                self._since = now
                return None
            stalled = now - self._since
            if stalled <= bound:
                return None
            return Hang(phase=phase, step=self.step, seconds=round(stalled, 3), timeout_s=round(bound, 3))

    def start(self) -> ProgressWatchdog:
        self._thread = threading.Thread(target=self._run, name="progress-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.poll_s)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if frozen := self.frozen_for():
                log.error(
                    "this process was stopped for %.1f s (frozen); its peers went on without it",
                    frozen,
                    extra=event_extra("frozen", {"seconds": round(frozen, 1)}),
                )
                self.on_frozen(frozen)
                return
            self._tick = self._clock()
            hang = self.check()
            if hang is not None:
                log.error(
                    "no progress in phase %s at step %s for %.1f s (bound %.1f s)",
                    hang.phase,
                    hang.step,
                    hang.seconds,
                    hang.timeout_s,
                    extra=event_extra(
                        "hang",
                        {
                            "phase": hang.phase,
                            "step": hang.step,
                            "seconds": hang.seconds,
                            "timeout_s": hang.timeout_s,
                        },
                    ),
                )
                self.on_hang(hang)
                return
