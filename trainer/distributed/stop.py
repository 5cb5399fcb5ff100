"""A stop request (SIGTERM) seen by any process stops every process of the job at the same step.

Kubernetes and Slurm send SIGTERM to every process, but not at the same instant, and sometimes to one
only. A process that stopped on its own flag would enter the final save while its peers start the next
step's collective, and the job would hang. Instead, the first process to see its flag after step s
proposes step s + LEAD in the coordination service's key-value store (the first proposal wins); every
process reads the key at every step boundary and stops once it reaches that step, so all of them save the
same final checkpoint and exit 42 (preempted).

A process stopped outside the step loop (compiling, restoring, waiting: `trainer.process.preemption`) proposes
the stop too before it leaves (`propose_after`), and a process waiting for slices asks `agreed()` between
its rounds, so the whole job stops with the same code however the SIGTERMs fell.

Why LEAD = 2 is always in time: a process cannot finish step s + 1 before the proposer has dispatched
it (the step's collective needs every process), and the proposer writes the key before dispatching it;
a peer's host runs at most one step ahead of its last completed one (the loop reads each step's metrics
one step late), so every peer reads the key at step s + 2 at the latest, never after passing it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainer.observe import catalogue

log = logging.getLogger(__name__)

KEY = "trainer/stop_at_step"
LEAD = 2


class CoordinatedStop:
    """`stop_requested(step)` for the loop: true at the agreed step on every process."""

    def __init__(self, local: Callable[[], bool], client, events=None):
        self.local = local  # this process's own SIGTERM flag
        self.client = client
        self.events = events
        self.stop_at: int | None = None
        self._proposed = False

    def __call__(self, step: int) -> bool:
        if self.stop_at is None:
            if self.local() and not self._proposed:
                self._propose(step + LEAD)
            value = self._read()
            if value is not None:
                self.stop_at = value
                log.warning("stop requested: every process stops after step %d", value)
                if self.events is not None:
                    self.events.emit(catalogue.STOP_AGREED, step=value, proposed_here=self._proposed, at_step=step)
        return self.stop_at is not None and step >= self.stop_at

    def agreed(self) -> bool:
        """Whether any process proposed a stop (for phases without a step: waiting for slices)."""
        if self.stop_at is None:
            value = self._read()
            if value is not None:
                self.stop_at = value
        return self.stop_at is not None

    def propose_after(self, step: int) -> None:
        """This process stops outside the step loop after `step`: the others stop at the agreed step."""
        if not self._proposed and self.stop_at is None:
            self._propose(step + LEAD)

    def _propose(self, step: int) -> None:
        self._proposed = True
        try:
            self.client.key_value_set(KEY, str(step))  # fails if another process proposed first
        except Exception as e:  # noqa: BLE001 - the existing proposal is the agreed one
            log.info("stop already proposed by another process (%s)", str(e).splitlines()[0])

    def _read(self) -> int | None:
        try:
            value = self.client.key_value_try_get(KEY)
        except Exception:  # noqa: BLE001 - NOT_FOUND: nobody asked to stop
            return None
        return int(value) if value else None
