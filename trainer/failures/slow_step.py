"""A slow step: the host stalls after one step, so that step's time grows (what slow-step detection,
`monitor_step_time_deviation`, is for).

    step=N,slow_s=S        the host sleeps S seconds at the boundary after step N (once: a replayed step
                           runs at full speed)
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
class SlowStep:
    step: int
    seconds: float


def parse(entry: str, fields: Fields, num_slices: int) -> SlowStep:
    fault = SlowStep(
        *step_and_number(entry, fields, "slow_s", "a slow step is step=N,slow_s=S (N an integer, S seconds)")
    )
    if fault.step < 1 or not 0 < fault.seconds < float("inf"):
        raise entry_error(entry, "step must be >= 1 and slow_s a number of seconds > 0")
    return fault


class SlowStepInjection(Injection):
    def __init__(self, faults: tuple, context: InjectionContext):
        self.stalls = {f.step: f.seconds for f in faults}  # step -> seconds the host stalls after it
        self.events = context.events

    def at_boundary(self, next_step: int) -> list[Kill]:
        if stall := self.stalls.pop(next_step - 1, 0.0):
            step = next_step - 1
            self.events.emit(catalogue.HOST_STALLED, step=step, seconds=stall, cause="fault_schedule slow_s")
            time.sleep(stall)
        return []


def injection(faults: tuple, context: InjectionContext) -> SlowStepInjection | None:
    return SlowStepInjection(faults, context) if faults else None


KIND = FailureKind(
    name="slow_step",
    keys=frozenset({"slow_s"}),
    parse=parse,
    faults=(SlowStep,),
    grammar="step=N,slow_s=S",
    scope=SLICES,
    injection=injection,
    injected_by="trainer.failures.slow_step:SlowStepInjection",
    detected_by="trainer.observe.slowsteps:SlowStepMonitor",
    outcome="logged (slow_step names the slowest host); training goes on",
    events=(catalogue.HOST_STALLED, catalogue.SLOW_STEP),
    goodput_cause="other",
)
