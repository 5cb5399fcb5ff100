"""A JAX profiler trace over a window of steps that survives elastic retries.

The trace covers steps skip_first_n_steps_for_profiler+1 .. +profiler_steps. If an attempt ends inside
the window (a slice failure), `close()` stops the trace cleanly and the next attempt starts a new
one at its next step inside the window, under <run dir>/profile/from_step_<N>.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from trainer.observe import catalogue

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, cfg, logdir: Path, events):
        """`cfg`: the run's ObserveConfig (`profiler`, `skip_first_n_steps_for_profiler`, `profiler_steps`).
        Read by attribute, not imported: trainer.observe sits below trainer.config (whose failure kinds
        declare their events in the catalogue here)."""
        self.enabled = cfg.profiler == "xplane"
        self.first = cfg.skip_first_n_steps_for_profiler + 1
        self.last = cfg.skip_first_n_steps_for_profiler + cfg.profiler_steps
        self.logdir = logdir
        self.events = events
        self.active = False
        self.done = False

    def before_step(self, step: int) -> None:
        """`step` is about to run."""
        if self.enabled and not self.done and not self.active and self.first <= step <= self.last:
            # One directory per trace: JAX names a trace by the second it started, so a trace resumed
            # after a quick recovery would otherwise overwrite the interrupted one.
            logdir = self.logdir / f"from_step_{step:06d}"
            jax.profiler.start_trace(str(logdir))
            self.active = True
            self.events.emit(catalogue.PROFILER_START, step=step, logdir=str(logdir))

    def after_step(self, step: int, state=None) -> None:
        if self.active and step >= self.last:
            if state is not None:
                jax.block_until_ready(state)
            self._stop(step, complete=True)

    def close(self) -> None:
        """End of an attempt: a trace still running is stopped; the window resumes in the next attempt."""
        if self.active:
            self._stop(None, complete=False)

    def _stop(self, step, *, complete: bool) -> None:
        try:
            jax.profiler.stop_trace()
        except Exception as e:  # a trace broken by a device failure must not break recovery
            log.warning("stopping the profiler trace failed: %s", e)
        self.active = False
        self.done = complete
        self.events.emit(catalogue.PROFILER_STOP, step=step, complete=complete)
