"""What the supervisor asks of the machines it trains on: a `Cluster`.

The supervisor (`trainer.elastic.supervisor`) is the retry policy; everything that differs between one
controller and several processes sits behind this protocol:

  wait_for_slices(min_slices)   block until enough slices are healthy; the active ones in mesh order, and
                                whether they came with fresh device objects (compiled plans then go)
  devices(active)               each active slice's devices, in that order
  slice_down_cause(err)         why a device or peer error is a slice-down event, or None: the run ends
  fail(err)                     this process's own error ends the run: tell whoever must know
  attempt_parts(active, snaps)  what `AttemptBuilder.__call__` takes besides the devices (`AttemptParts`)
  at_step_boundary(next_step)   between steps and before an attempt's first step (fault injection)
  returning(active)             the step boundary's callable: inactive slices that came back
  hand_over(attempt)            scale-up: what must settle before the grown attempt starts
  propose_stop(last_step)       this process stops outside the step loop: the others should stop too
  close()                       the run is over: undo what attempts installed

Implementations: `LocalCluster` (`trainer.elastic.local_cluster`: one controller, Pathways or local
virtual slices), `ProcessCluster` (`trainer.elastic.process_cluster`: several processes joined by
jax.distributed, elastic) and `FixedCluster` here (several processes without elastic_enabled: the slices
never change). Another backend is another class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainer.elastic.snapshot import HostSnapshots


@dataclasses.dataclass(frozen=True)
class ActiveSlices:
    """What waiting for slices gave: the active slices in mesh order; `fresh_devices` when the slices'
    devices are new objects (a fresh client), so executables compiled for the old ones cannot run."""

    active: list[int]
    fresh_devices: bool = False


@dataclasses.dataclass(frozen=True)
class AttemptParts:
    """The parts of one attempt that depend on the cluster (`trainer.runtime.attempt.AttemptBuilder.__call__`).

    snapshots                   where host-RAM snapshots are restored from (`runtime.restore.SnapshotSource`)
    wrap_step                   wraps the compiled step (a fault injector's or the membership's guard), or None
    wrap_replay                 wraps the compiled replay check (the fault injector's), or None
    checkpoint_multiprocessing  Orbax MultiprocessingOptions when only some processes take part, or None
    checkpoint_barrier          Orbax's barrier between processes (one that notices a dead peer), or None
    """

    snapshots: Any = None
    wrap_step: Callable | None = None
    wrap_replay: Callable | None = None
    checkpoint_multiprocessing: Any = None
    checkpoint_barrier: Any = None

    def kwargs(self) -> dict[str, Any]:
        """As keyword arguments of `AttemptBuilder.__call__` (shallow: the parts themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class Cluster(Protocol):
    """See the module docstring. Errors: `wait_for_slices` raises TimeoutError when enough slices are not
    healthy in time (the supervisor turns it into `SlicesUnavailable`), and may raise `Preempted` (a stop
    the job agreed on) or `PeerFailed` (another process's own error)."""

    @property
    def num_slices(self) -> int: ...

    def wait_for_slices(self, min_slices: int) -> ActiveSlices: ...

    def devices(self, active: Sequence[int]) -> list[list]: ...

    def slice_down_cause(self, err: Exception) -> str | None: ...

    def fail(self, err: BaseException) -> None: ...

    def attempt_parts(self, active: list[int], snapshots: HostSnapshots) -> AttemptParts: ...

    def at_step_boundary(self, next_step: int, in_flight=None) -> None: ...

    def returning(self, active: list[int]) -> Callable[[], list[int]]: ...

    def hand_over(self, attempt) -> None: ...

    def propose_stop(self, last_step: int) -> None: ...

    def close(self) -> None: ...


class FixedCluster:
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

    def fail(self, err: BaseException) -> None:
        pass

    def attempt_parts(self, active: list[int], snapshots: HostSnapshots) -> AttemptParts:
        return AttemptParts(snapshots=snapshots)

    def at_step_boundary(self, next_step: int, in_flight=None) -> None:
        pass

    def returning(self, active: list[int]) -> Callable[[], list[int]]:
        return list  # every slice is active: none can come back

    def hand_over(self, attempt) -> None:
        pass

    def propose_stop(self, last_step: int) -> None:
        if self.stop is not None:
            self.stop.propose_after(last_step)

    def close(self) -> None:
        pass
