"""What the supervisor asks of the machines it trains on: a `Cluster`.

The supervisor (`trainer.elastic.supervisor`) is the retry policy; everything that differs between one
controller and several processes sits behind this contract. Every capability is stated here; one a
backend lacks has its default here (nothing to do, or "cannot"), so the supervisor never asks whether a
cluster has it:

  num_slices                    the slices the run was laid out for
  wait_for_slices(min_slices)   block until enough slices are healthy; the active ones in mesh order, and
                                whether they came with fresh device objects (compiled plans then go)
  devices(active)               each active slice's devices, in that order
  slice_down_cause(err)         why a device or peer error is a slice-down event, or None: the run ends
  attempt_parts(active, snaps)  what an attempt takes besides the devices (`trainer.attempt.builder.AttemptParts`)
  returning(active)             the step boundary's callable: inactive slices that came back
  fail(err)                     this process's own error ends the run: tell whoever must know (default: nobody)
  at_step_boundary(next_step)   between steps and before an attempt's first step (default: nothing; fault
                                injection on local virtual slices)
  hand_over(attempt)            scale-up: what must settle before the grown attempt starts (default: nothing)
  propose_stop(last_step)       this process stops outside the step loop: the others should stop too
                                (default: nobody else to stop)
  quarantine(slice_index)       treat a slice that computed wrong numbers as lost from now on; False where
                                that cannot be done (default)
  compiles_ahead                whether executables compiled for a survivor set stay valid across attempts
                                (one controller keeps its devices; default False)
  close()                       the run is over: undo what attempts installed (default: nothing)

Implementations: `LocalCluster` (`trainer.elastic.local_cluster`: one controller, Pathways or local
virtual slices), `ProcessCluster` (`trainer.elastic.process_cluster`: several processes joined by
jax.distributed, elastic) and `FixedCluster` here (several processes without elastic_enabled: the slices
never change). Which one a run gets is its backend's choice (`trainer.elastic.backends`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trainer.attempt.builder import AttemptParts

if TYPE_CHECKING:
    from trainer.elastic.snapshot import HostSnapshots


@dataclasses.dataclass(frozen=True)
class ActiveSlices:
    """What waiting for slices gave: the active slices in mesh order; `fresh_devices` when the slices'
    devices are new objects (a fresh client), so executables compiled for the old ones cannot run."""

    active: list[int]
    fresh_devices: bool = False


class Cluster:
    """See the module docstring. Errors: `wait_for_slices` raises TimeoutError when enough slices are not
    healthy in time (the supervisor turns it into `SlicesUnavailable`), and may raise `Preempted` (a stop
    the job agreed on) or `PeerFailed` (another process's own error). Every cluster states the first six
    (`num_slices` to `returning`); the rest have their defaults here."""

    num_slices: int
    compiles_ahead: bool = False

    def wait_for_slices(self, min_slices: int) -> ActiveSlices:
        raise NotImplementedError(f"{type(self).__name__} does not state wait_for_slices")

    def devices(self, active: Sequence[int]) -> list[list]:
        raise NotImplementedError(f"{type(self).__name__} does not state devices")

    def slice_down_cause(self, err: Exception) -> str | None:
        raise NotImplementedError(f"{type(self).__name__} does not state slice_down_cause")

    def attempt_parts(self, active: list[int], snapshots: HostSnapshots) -> AttemptParts:
        raise NotImplementedError(f"{type(self).__name__} does not state attempt_parts")

    def returning(self, active: list[int]) -> Callable[[], list[int]]:
        raise NotImplementedError(f"{type(self).__name__} does not state returning")

    def fail(self, err: BaseException) -> None:
        """Nobody else to tell: the error ends this process, which is the whole job."""

    def at_step_boundary(self, next_step: int, in_flight=None) -> None:
        """Nothing is injected between steps."""

    def hand_over(self, attempt) -> None:
        """The supervisor's synchronous snapshot is all the grown attempt needs."""

    def propose_stop(self, last_step: int) -> None:
        """One process: nobody else to stop."""

    def quarantine(self, slice_index: int) -> bool:
        """This cluster cannot take a healthy-looking slice out of service."""
        return False

    def close(self) -> None:
        """Nothing to undo."""


class FixedCluster(Cluster):
    """Every slice, always, and nothing watched: a job of several processes without elastic_enabled
    (jax.distributed ends the job when a process is lost; no error is a slice-down event). `stop` is the
    job's coordinated stop (`trainer.distributed.stop.CoordinatedStop`), or None."""

    def __init__(self, slices: list[list], *, stop=None):
        self.slice_to_devices = dict(enumerate(slices))
        self.stop = stop

    @property
    def num_slices(self) -> int:
        return len(self.slice_to_devices)

    def wait_for_slices(self, min_slices: int) -> ActiveSlices:
        return ActiveSlices(sorted(self.slice_to_devices))

    def devices(self, active: Sequence[int]) -> list[list]:
        return [self.slice_to_devices[i] for i in active]

    def slice_down_cause(self, err: Exception) -> str | None:
        return None

    def attempt_parts(self, active: list[int], snapshots: HostSnapshots) -> AttemptParts:
        return AttemptParts(snapshots=snapshots)

    def returning(self, active: list[int]) -> Callable[[], list[int]]:
        return list  # every slice is active: none can come back

    def propose_stop(self, last_step: int) -> None:
        if self.stop is not None:
            self.stop.propose_after(last_step)
