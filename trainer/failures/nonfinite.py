"""A non-finite step: a step's loss or gradients are NaN/inf (what `nan_policy` is for).

step=N,nan=1           step N's loss is reported NaN and the step non-finite, once
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from trainer.failures.kind import SLICES, FailureKind, Fields, Injection, InjectionContext, entry_error
from trainer.observe import catalogue

CAUSE = ""  # a rollback's cause (trainer.attempt.outcome.Rollback): the default one


@dataclasses.dataclass(frozen=True)
class NonFiniteStep:
    step: int


def parse(entry: str, fields: Fields, num_slices: int) -> NonFiniteStep:
    try:
        if set(fields) != {"step", "nan"}:
            raise ValueError
        fault = NonFiniteStep(int(fields["step"]))
    except ValueError:
        raise entry_error(entry, "a non-finite step is step=N,nan=1 (N an integer)") from None
    if fault.step < 1:
        raise entry_error(entry, "step must be >= 1")
    return fault


class NonFiniteInjection(Injection):
    def __init__(self, faults: tuple, context: InjectionContext):
        self.steps = {f.step for f in faults}
        self.events = context.events

    def after_step(self, step: int, state, metrics: dict, slices: Mapping[int, list]):
        if step not in self.steps:
            return state, metrics
        self.steps.discard(step)  # fires once, like a slice fault
        self.events.emit(catalogue.NAN_INJECTED, step=step)
        return state, dict(metrics, loss=metrics["loss"] * float("nan"), finite=metrics["finite"] & False)


def injection(faults: tuple, context: InjectionContext) -> NonFiniteInjection | None:
    return NonFiniteInjection(faults, context) if faults else None


KIND = FailureKind(
    name="non_finite",
    keys=frozenset({"nan"}),
    parse=parse,
    faults=(NonFiniteStep,),
    grammar="step=N,nan=1",
    scope=SLICES,
    injection=injection,
    injected_by="trainer.failures.nonfinite:NonFiniteInjection",
    detected_by="trainer.attempt.nonfinite:NonFinitePolicy",
    outcome="the update is never applied; nan_policy skips the step, rolls back or stops the run",
    events=(catalogue.NAN_INJECTED, catalogue.NONFINITE_STEP, catalogue.ROLLBACK),
    goodput_cause="wasted_progress",
)
