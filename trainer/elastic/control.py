"""What the control endpoint's requests do (`trainer.observe.control` queues them; trainer/run.py wires this).

`ControlActions.at_boundary` is one of the stop signal's checks, so the training thread runs it at every
step boundary (a request sent while the job compiles, restores or waits waits for the next step); it takes
the accepted requests and starts each one, never from the HTTP thread:
- `checkpoint`: the persistent tier saves the next step the checkpointer asks about (`checkpoint_due`
  wraps the run's schedule, planned or the checkpointer's own period), through the loop's usual save;
- `drain`: the stop signal is raised as SIGTERM raises it: the loop saves the local tier and a persistent
  checkpoint and the process exits 42 (preempted); the same command resumes;
- `replan`: the auto periods plan after the next step from the costs measured so far (`AutoPeriods.plan_now`).
`refusals` names the actions a run cannot do, with the reason the endpoint answers (409).
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.config.schema import CheckpointConfig
from trainer.observe import catalogue
from trainer.observe.control import ControlRequests
from trainer.process.preemption import StopSignal


def refusals(checkpoint: CheckpointConfig, periods, processes: int) -> dict[str, str]:
    """action -> why this run cannot do it (an action left out is done)."""
    out = {}
    if not checkpoint.enable_checkpointing:
        out["checkpoint"] = "enable_checkpointing=false: this run keeps no checkpoints"
    elif checkpoint.enable_continuous_checkpointing:
        out["checkpoint"] = "enable_continuous_checkpointing=true already saves whenever the last save finished"
    elif processes > 1:
        out["checkpoint"] = f"the job has {processes} processes and a save needs all of them: use drain instead"
    if not periods.auto:
        out["replan"] = "no period is auto: set snapshot_period, local_checkpoint_period or checkpoint_period=auto"
    return out


class ControlActions:
    """The training thread's side of the control endpoint (module docstring). `periods`: the run's
    `AutoPeriods` or `FixedPeriods`; `events`: the run's event log."""

    def __init__(self, requests: ControlRequests, *, stop: StopSignal, periods, events):
        self.requests = requests
        self.stop = stop
        self.periods = periods
        self.events = events
        self._checkpoint = False

    def at_boundary(self) -> None:
        """Start every request accepted since the last boundary (a `StopSignal` check)."""
        for action in self.requests.take():
            self.events.emit(catalogue.CONTROL_APPLIED, action=action)
            if action == "checkpoint":
                self._checkpoint = True
            elif action == "drain":
                self.stop.request("drain (control endpoint)")
            elif action == "replan":
                self.periods.plan_now()

    def checkpoint_due(self, scheduled: Callable[[int], bool]) -> Callable[[int], bool]:
        """`scheduled`, and also the first step asked about after a `checkpoint` request."""

        def due(step: int) -> bool:
            periodic = scheduled(step)  # asked every time: a planned period counts its saves
            asked, self._checkpoint = self._checkpoint, False
            return periodic or asked

        return due
