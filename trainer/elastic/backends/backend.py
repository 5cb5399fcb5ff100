"""What a backend answers: everything about a run that depends on the machines it runs on.

A `Backend` is chosen once per process, before JAX starts (`trainer.elastic.backends.open_backend`), and
every topology-dependent part of the run is asked of it instead of branching on the process count:

  before JAX     process_id, freeze_bound_s, log_paths(paths)
  the job        join(), leave(), process_index, slices(events)
  the parts      stop(local, events), interrupt_eval(local), host_times(), cluster(...), snapshots(...),
                 allowed_periods(keys, elastic_enabled=...), sdc_unavailable

Defaults here are one process's answers; a backend overrides what differs. The config sections it reads
come in a `BackendSpec`, never the whole config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config.schema import CheckpointConfig, ElasticConfig, MeshConfig
from trainer.distributed.init import DistributedSettings

if TYPE_CHECKING:
    from trainer.elastic.cluster import Cluster
    from trainer.elastic.periods import PeriodKeys
    from trainer.elastic.snapshot import HostSnapshots
    from trainer.failures.plan import FaultPlan
    from trainer.observe.rundir import RunPaths
    from trainer.observe.slowsteps import HostTimes
    from trainer.process.preemption import StopSignal


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """The config sections a backend builds from. `cluster`: the config's key as given (`auto` too);
    `settings`: this process's multi-process settings (`trainer.distributed.resolve_settings`)."""

    cluster: str
    settings: DistributedSettings
    mesh: MeshConfig
    elastic: ElasticConfig
    checkpoint: CheckpointConfig
    faults: FaultPlan

    def asked(self, name: str, why: str) -> str:
        """How the config asked for backend `name`, for a message: `cluster=name`, or the auto rule's
        reason (`why`) when it resolved from `auto`."""
        return f"cluster={name}" if self.cluster == name else f"cluster=auto ({why}: {name})"


class Backend:
    """One backend (see the module docstring). The constructor checks that the job can be this backend
    and raises ConfigError (exit 2, before any compute) naming the key and the fix when it cannot. Every
    backend states `slices`, `cluster` and `snapshots`; the rest default to one process's answers."""

    name: str

    def __init__(self, spec: BackendSpec):
        self.spec = spec

    # ---- before JAX starts --------------------------------------------------------------------------

    @property
    def process_id(self) -> int:
        """This process's id in the job (0: the one that holds the run's lease)."""
        return self.spec.settings.process_id

    @property
    def processes(self) -> int:
        """How many trainer processes the job has (one controller: 1)."""
        return self.spec.settings.num_processes

    @property
    def freeze_bound_s(self) -> float:
        """A process frozen longer than this has been left behind by its peers: it must write nothing
        (`trainer.process.watchdog`). 0: nobody goes on without it."""
        return 0.0

    def log_paths(self, paths: RunPaths) -> RunPaths:
        """Where this process writes its logs and its local checkpoint tier."""
        return paths

    # ---- the job ------------------------------------------------------------------------------------

    def join(self) -> None:
        """Process-wide setup before any device is touched."""

    def leave(self) -> None:
        """The run is over: undo `join` (and whatever `slices` started)."""

    @property
    def process_index(self) -> int:
        """This process's index among the job's processes (after `join`)."""
        return 0

    def slices(self, events) -> list[list]:
        """Each slice's devices, in slice order (after `join`)."""
        raise NotImplementedError(f"{type(self).__name__} does not state slices")

    # ---- the parts of a run -------------------------------------------------------------------------

    def stop(self, local: StopSignal, events) -> Callable[[int], bool]:
        """The loop's `stop_requested(step)`, over this process's own stop signal."""
        return local

    def interrupt_eval(self, local: StopSignal) -> Callable[[], bool]:
        """Whether an evaluation ends early (one process: at a SIGTERM; the step boundary then stops)."""
        return lambda: local.requested

    def host_times(self) -> HostTimes | None:
        """How the processes share their host times for the slow-step monitor (None: one process)."""
        return None

    def cluster(self, slices: list[list], *, events, stop: Callable[[int], bool], chaos_dir: Path) -> Cluster:
        """What the supervisor retries on. `stop`: what `stop()` returned; `chaos_dir`: where
        `trainer.chaos` drops its requests."""
        raise NotImplementedError(f"{type(self).__name__} does not state cluster")

    def snapshots(self, events, store) -> HostSnapshots:
        """This process's host snapshots, writing to the local tier `store` (None: off)."""
        raise NotImplementedError(f"{type(self).__name__} does not state snapshots")

    def allowed_periods(self, keys: PeriodKeys, *, elastic_enabled: bool) -> PeriodKeys:
        """The period keys this backend can run: `auto` ones stay where it can plan them."""
        return keys

    @property
    def sdc_unavailable(self) -> str | None:
        """Why the silent-data-corruption check cannot run here (None: it can)."""
        return None
