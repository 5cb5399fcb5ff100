"""Fault injection on one controller's local (virtual) slices: every registered failure kind's injector
(`trainer.failures`), driven at step boundaries and around the compiled step.

The injector names no kind: it builds each registered kind's `Injection` from the run's `FaultPlan` and
calls their hooks in registry order (`trainer.failures.registry`). Slice failures due at a boundary wait
for the step in flight, so a slice dies exactly at the device-side boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import jax

from trainer.failures.kind import FailureKind, Injection, InjectionContext, Kill
from trainer.failures.plan import FaultPlan
from trainer.failures.registry import KINDS
from trainer.failures.slice_loss import Outages, SliceLossInjection


class FaultInjector:
    """Fires the plan's faults and `trainer.chaos` requests; fails steps that run on a down slice.

    Lives for the whole run (a scheduled fault fires once, not once per attempt). The loop calls
    `at_step_boundary(next_step)` between steps; a compiled step is wrapped by `guard`, the replay check's
    program by `guard_replay`.
    """

    def __init__(
        self,
        faults: FaultPlan | Iterable,
        outages: Outages,
        chaos_dir: Path | None,
        events,
        *,
        kinds: tuple[FailureKind, ...] = KINDS,
    ):
        plan = faults if isinstance(faults, FaultPlan) else FaultPlan(tuple(faults))
        self.outages = outages
        self.chaos_dir = chaos_dir
        self.events = events
        context = InjectionContext(events, outages, chaos_dir, once_per_run=self._once_per_run)
        built = (kind.injection(plan.for_kind(kind), context) for kind in kinds if kind.injection is not None)
        self.injections: list[Injection] = [injection for injection in built if injection is not None]
        self._slices = next((i for i in self.injections if isinstance(i, SliceLossInjection)), None)
        self.next_step = 1

    def at_step_boundary(self, next_step: int, in_flight=None) -> None:
        """Fire the faults due before `next_step`. `in_flight` is the output of the step still running
        on the devices (dispatch runs a step ahead): a due slice failure first waits for it, so the slice
        dies exactly at the device-side boundary and its kill time is when that step really ended, not
        when the host loop passed the boundary. Nothing is waited for when no failure is due."""
        self.next_step = next_step
        due: list[Kill] = []
        for injection in self.injections:
            due += injection.at_boundary(next_step)
        if due and in_flight is not None:
            jax.block_until_ready(in_flight)
        for kill in due:
            self._slices.fire(kill, next_step)

    def _once_per_run(self, name: str) -> bool:
        """True the first time in the run (not only in this process) that fault `name` fires: a marker in
        the run's chaos directory keeps a restarted process that trains the step again from firing it again."""
        marker = None if self.chaos_dir is None else self.chaos_dir / name
        if marker is not None and marker.exists():
            return False
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("fired\n")
        return True

    def guard(self, step_fn, slice_devices: dict[int, list]):
        """`step_fn` as it runs on the active slices (`slice_devices`: each one's devices): it raises the
        Pathways slice-down error while any of them is down, and every fault scheduled for the step lands
        where it arises (its slice's devices, the step's result)."""
        for injection in self.injections:
            injection.attempt_started()

        def guarded(state, batch):
            step = self.next_step
            for injection in self.injections:
                batch = injection.before_step(step, state, batch, slice_devices)
            state, metrics = step_fn(state, batch)
            for injection in self.injections:
                state, metrics = injection.after_step(step, state, metrics, slice_devices)
            return state, metrics

        return guarded

    def guard_replay(self, check_fn, slice_devices: dict[int, list]):
        """The replay check's program as it runs on the slices: a fault due there lands as in the step."""

        def guarded(params, batch):
            for injection in self.injections:
                batch = injection.replay_batch(self.next_step, batch, slice_devices)
            return check_fn(params, batch)

        return guarded
