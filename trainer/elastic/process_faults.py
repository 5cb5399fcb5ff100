"""Errors injected into one process of a multi-process job: `fault_schedule='step=N,process=P,error=E'`.

Lost processes are injected from outside (kill -9, `scripts/launch_local.py`); what cannot be is a
process's own failure, an out-of-memory or a bug, which must end every process with its cause instead of
being retried (`trainer.distributed.fatal`). E is `oom` (a JaxRuntimeError RESOURCE_EXHAUSTED, as XLA
raises when an allocation fails) or `bug` (a RuntimeError); it is raised by the step N call on process P.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax

from trainer.config.fault_schedule import ProcessFault
from trainer.observe import catalogue

log = logging.getLogger(__name__)


class ProcessFaultInjector:
    """Wraps the train step of this process: raises the scheduled error when the step it runs is due."""

    def __init__(self, faults: list[ProcessFault], process_index: int, events):
        self.due = {f.step: f for f in faults if f.process == process_index and f.error}
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
