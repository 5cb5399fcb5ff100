"""Process death: one process of a multi-process job is lost, or fails on its own.

A lost process is injected from outside, as it happens (kill -9: `scripts/launch_local.py`,
`trainer.chaos`); the membership's heartbeats find it. What cannot be injected from outside is a process's
own failure, an out-of-memory or a bug, which must end every process with its cause instead of being
retried (`trainer.distributed.fatal`). Schedule entries (several processes only):

    step=N,process=P,error=oom|bug       process P's step N raises: `oom` a JaxRuntimeError
                                         RESOURCE_EXHAUSTED (as XLA raises when an allocation fails),
                                         `bug` a RuntimeError
    step=N,process=P,slow_snapshot_s=S   process P's host copy of step N's snapshot takes S seconds longer
                                         (so a test can kill a process while its snapshot is being taken)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax

from trainer.failures.kind import PROCESSES, FailureKind, Fields, entry_error
from trainer.observe import catalogue

log = logging.getLogger(__name__)

ERRORS = ("oom", "bug")


@dataclasses.dataclass(frozen=True)
class ProcessError:
    """Process `process`'s step `step` raises its own error (`oom` or `bug`)."""

    step: int
    process: int
    error: str


@dataclasses.dataclass(frozen=True)
class SlowSnapshot:
    """Process `process`'s host copy of step `step`'s snapshot takes `seconds` longer."""

    step: int
    process: int
    seconds: float


def parse(entry: str, fields: Fields, num_slices: int) -> ProcessError | SlowSnapshot:
    try:
        if set(fields) == {"step", "process", "slow_snapshot_s"}:
            fault = SlowSnapshot(int(fields["step"]), int(fields["process"]), float(fields["slow_snapshot_s"]))
            if not 0 < fault.seconds < float("inf"):
                raise ValueError
        elif set(fields) == {"step", "process", "error"}:
            fault = ProcessError(int(fields["step"]), int(fields["process"]), fields["error"])
        else:
            raise ValueError
    except ValueError:
        raise entry_error(
            entry,
            f"with several processes the schedule injects a process's own error, "
            f"step=N,process=P,error={'|'.join(ERRORS)}, or a slow snapshot copy, "
            "step=N,process=P,slow_snapshot_s=S; "
            "lose a process by killing it (scripts/launch_local.py)",
        ) from None
    if (isinstance(fault, ProcessError) and fault.error not in ERRORS) or fault.step < 1 or fault.process < 0:
        raise entry_error(entry, f"error must be one of {list(ERRORS)}, step >= 1 and process >= 0")
    return fault


class ProcessFaultInjector:
    """Wraps the train step of this process: raises the scheduled error when the step it runs is due."""

    def __init__(self, faults, process_index: int, events):
        self.due = {f.step: f for f in faults if isinstance(f, ProcessError) and f.process == process_index}
        self.events = events

    def wrap(self, step_fn: Callable) -> Callable:
        if not self.due:
            return step_fn

        def step(state, *args, **kwargs):
            fault = self.due.pop(int(jax.device_get(state["step"])) + 1, None)
            if fault is not None:
                self.events.emit(
                    catalogue.FAULT_INJECTED, step=fault.step, process=fault.process, error=fault.error
                )
                log.warning("injecting %s at step %d (fault_schedule)", fault.error, fault.step)
                if fault.error == "oom":
                    raise jax.errors.JaxRuntimeError(
                        f"RESOURCE_EXHAUSTED: Out of memory while allocating (injected at step {fault.step})"
                    )
                raise RuntimeError(f"injected bug at step {fault.step}")
            return step_fn(state, *args, **kwargs)

        return step


def copy_delays(faults, process_index: int) -> Callable[[int], float]:
    """step -> the seconds this process's snapshot copy of it is slowed by (0 for most)."""
    slow = {f.step: f.seconds for f in faults if isinstance(f, SlowSnapshot) and f.process == process_index}
    return lambda step: slow.get(step, 0.0)


KIND = FailureKind(
    name="process_death",
    keys=frozenset({"process", "error", "slow_snapshot_s"}),
    parse=parse,
    faults=(ProcessError, SlowSnapshot),
    grammar=f"step=N,process=P,error={'|'.join(ERRORS)} | step=N,process=P,slow_snapshot_s=S",
    scope=PROCESSES,
    injection=None,  # several processes: wrapped into the process's step by its ProcessCluster
    injected_by="trainer.failures.process_death:ProcessFaultInjector",
    detected_by="trainer.elastic.membership:Membership",
    outcome="a lost process: the survivors re-form and restore (elastic_enabled); its own error: every "
    "process stops with its cause",
    events=(catalogue.FAULT_INJECTED, catalogue.FATAL_ERROR, catalogue.SLICE_DOWN_DETECTED),
    goodput_cause="wasted_progress",
    planner_term="trainer.plan.model:Failures",
)
