"""A loss spike: one step's loss and its update to the parameters are multiplied by a factor (what
`loss_spike_threshold` is for).

    step=N,spike=F         step N's loss, gradient norm and update times F (F > 1), once per run

The update itself is scaled: a bad batch's gradients move the model, and Adam's update is nearly
scale-free, so scaling the gradients alone would not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from trainer.failures.kind import (
    SLICES,
    FailureKind,
    Fields,
    Injection,
    InjectionContext,
    entry_error,
    step_and_number,
)
from trainer.observe import catalogue

CAUSE = "loss_spike"  # a rollback's cause (trainer.attempt.outcome.Rollback)


@dataclasses.dataclass(frozen=True)
class LossSpike:
    step: int
    factor: float


def parse(entry: str, fields: Fields, num_slices: int) -> LossSpike:
    fault = LossSpike(
        *step_and_number(entry, fields, "spike", "a loss spike is step=N,spike=F (N an integer, F > 1)")
    )
    if fault.step < 1 or not 1 < fault.factor < float("inf"):
        raise entry_error(entry, "step must be >= 1 and spike a factor > 1")
    return fault


class SpikeInjection(Injection):
    def __init__(self, faults: tuple, context: InjectionContext):
        self.spikes = {f.step: f.factor for f in faults}  # step -> factor on its loss and update
        self.context = context
        self._before = None  # (factor, params before the step) of a spike under way

    def before_step(self, step: int, state, batch, slices: Mapping[int, list]):
        self._before = None  # a step that raised before it ran leaves nothing behind
        factor = self.spikes.pop(step, 0.0)
        if factor and self.context.once_per_run(f"spike_at_step_{step}"):
            self._before = factor, jax.tree.map(jnp.copy, state["params"])  # the step donates its input
        return batch

    def after_step(self, step: int, state, metrics: dict, slices: Mapping[int, list]):
        if self._before is None:
            return state, metrics
        (factor, before), self._before = self._before, None
        self.context.events.emit(catalogue.SPIKE_INJECTED, step=step, factor=factor)
        params = jax.tree.map(lambda b, a: b + factor * (a - b), before, state["params"])
        metrics = dict(metrics, loss=metrics["loss"] * factor, grad_norm=metrics["grad_norm"] * factor)
        return dict(state, params=params), metrics


def injection(faults: tuple, context: InjectionContext) -> SpikeInjection | None:
    return SpikeInjection(faults, context) if faults else None


KIND = FailureKind(
    name="loss_spike",
    keys=frozenset({"spike"}),
    parse=parse,
    faults=(LossSpike,),
    grammar="step=N,spike=F",
    scope=SLICES,
    injection=injection,
    injected_by="trainer.failures.spike:SpikeInjection",
    detected_by="trainer.attempt.loss_spikes:LossSpikePolicy",
    outcome="rollback to the newest saved state before the spike; the spiking batch is skipped for good",
    events=(catalogue.SPIKE_INJECTED, catalogue.LOSS_SPIKE_ROLLBACK, catalogue.ROLLBACK),
    goodput_cause="rollback",
)
