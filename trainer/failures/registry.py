"""Every failure kind, registered once. Adding a kind is one module of `trainer.failures` with its
`KIND` declaration (`trainer.failures.kind`) and one line here.

The order is the order in which `trainer.elastic.faults.FaultInjector` calls the kinds' hooks at each
step: a stall and a hang before the boundary's slice failures; in the step, a lost slice before anything
else (so nothing else fires on a step that never runs), a spike's scaled update before a memory fault
changes one replica's copy, a non-finite report last.
"""

from __future__ import annotations

from typing import Union

from trainer.failures import corruption, hang, nonfinite, process_death, slice_loss, slow_step, spike, storage
from trainer.failures.kind import FailureKind

KINDS: tuple[FailureKind, ...] = (
    slow_step.KIND,
    hang.KIND,
    slice_loss.KIND,
    spike.KIND,
    corruption.KIND,
    nonfinite.KIND,
    process_death.KIND,
    storage.KIND,
)

# A fault: one of the registered kinds' fault types (a tagged union: the type is the tag).
Fault = Union[tuple(t for kind in KINDS for t in kind.faults)]  # noqa: UP007 (built from the registry)


def kind_of(fault, kinds: tuple[FailureKind, ...] = KINDS) -> FailureKind:
    """The kind whose module declared `fault`'s type."""
    for kind in kinds:
        if isinstance(fault, kind.faults):
            return kind
    raise TypeError(f"{type(fault).__name__} is no registered failure kind's fault")
