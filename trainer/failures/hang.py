"""A hang: one step's dispatch blocks and raises nothing, as a collective that never returns would (what
the progress watchdog, `hang_timeout_seconds`, is for).

    step=N,hang_s=S        step N's dispatch blocks S seconds; once per run (a restart that trains step N
                           again does not hang there again)
"""

from __future__ import annotations

import dataclasses
import time

from trainer.failures.kind import (
    SLICES,
    FailureKind,
    Fields,
    Injection,
    InjectionContext,
    Kill,
    entry_error,
    step_and_number,
)
from trainer.observe import catalogue


@dataclasses.dataclass(frozen=True)
class Hang:
    step: int
    seconds: float


def parse(entry: str, fields: Fields, num_slices: int) -> Hang:
    fault = Hang(*step_and_number(entry, fields, "hang_s", "a hang is step=N,hang_s=S (N an integer, S seconds)"))
    if fault.step < 1 or not 0 < fault.seconds < float("inf"):
        raise entry_error(entry, "step must be >= 1 and hang_s a number of seconds > 0")
    return fault


class HangInjection(Injection):
    def __init__(self, faults: tuple, context: InjectionContext):
        self.hangs = {f.step: f.seconds for f in faults}  # step -> seconds its dispatch blocks
        self.context = context

    def at_boundary(self, next_step: int) -> list[Kill]:
        seconds = self.hangs.pop(next_step, 0.0)
        if seconds and self.context.once_per_run(f"hang_at_step_{next_step}"):
            self._hang(next_step, seconds)
        return []

    def _hang(self, step: int, seconds: float) -> None:
        """Block before step `step`'s dispatch, raising nothing (the watchdog's stack dump names this)."""
        cause = "fault_schedule hang_s"
        self.context.events.emit(catalogue.HANG_INJECTED, step=step, seconds=seconds, cause=cause)
        time.sleep(seconds)


def injection(faults: tuple, context: InjectionContext) -> HangInjection | None:
    return HangInjection(faults, context) if faults else None


KIND = FailureKind(
    name="hang",
    keys=frozenset({"hang_s"}),
    parse=parse,
    faults=(Hang,),
    grammar="step=N,hang_s=S",
    scope=SLICES,
    injection=injection,
    injected_by="trainer.failures.hang:HangInjection",
    detected_by="trainer.process.watchdog:ProgressWatchdog",
    outcome="the newest host snapshot is written to the local tier and the process exits for a restart",
    events=(catalogue.HANG_INJECTED, catalogue.HANG_DETECTED),
    goodput_cause="hang",
)
