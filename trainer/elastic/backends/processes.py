"""`cluster=processes`: several processes joined by jax.distributed (GPU clusters, multi-host CPU; no
Pathways), a slice per `processes_per_slice` of them.

`join` joins the job (recoverable with elastic_enabled); `slices` agrees on the slices with the other
processes (`Membership`, only with elastic_enabled: without it a lost process ends the job) and starts
this process's heartbeat, which the checkpoint barriers watch; `leave` stops it and leaves the job in an
order every process survives. A SIGTERM to any process stops all of them at one step
(`CoordinatedStop`); slow-step host times go through the coordination service. Each process keeps its
own devices' blocks of a snapshot in its own RAM (its JAX client, and so any device buffer, is rebuilt
when the formation changes) and writes its logs and its local tier under `process_<i>/`. Periods are
numbers (every process must save the same steps, and each would plan from its own costs), and the
silent-data-corruption check does not run (it moves rows between slices, which the processes would
have to exchange).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax

from trainer.config.errors import ConfigError
from trainer.config.schema import AUTO, UNPLANNED_CHECKPOINT_PERIOD
from trainer.distributed import coordination_client, initialize, leave, process_log_dir
from trainer.distributed.communicators import (
    forget_rendezvous,
    fresh_cpu_client,
    mesh_cliques,
    needs_fresh_communicators,
)
from trainer.distributed.heartbeat import Heartbeat
from trainer.distributed.stop import CoordinatedStop
from trainer.elastic.backends.backend import Backend, BackendSpec
from trainer.elastic.cluster import Cluster, FixedCluster
from trainer.elastic.membership import Membership
from trainer.elastic.periods import PeriodKeys
from trainer.elastic.process_cluster import ProcessCluster
from trainer.elastic.snapshot import HostSnapshots
from trainer.failures.process_death import ProcessFaultInjector, copy_delays
from trainer.observe.rundir import RunPaths
from trainer.observe.slowsteps import CoordinationHostTimes, HostTimes
from trainer.parallel.mesh import build_mesh
from trainer.process.preemption import StopSignal

log = logging.getLogger(__name__)


class ProcessesBackend(Backend):
    name = "processes"

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        if not spec.settings.multi_process:
            raise ConfigError(
                f"cluster={self.name} needs several processes, but this job has one (num_processes, "
                "$JAX_NUM_PROCESSES or $SLURM_NTASKS): start the job's processes (scripts/launch_local.py, "
                "a JobSet, Slurm), or set cluster=local (or auto)"
            )
        self.membership: Membership | None = None
        self.heartbeat: Heartbeat | None = None

    @property
    def freeze_bound_s(self) -> float:
        return self.spec.settings.peer_dead_after_s

    def log_paths(self, paths: RunPaths) -> RunPaths:
        """Process 0 writes in the run directory; process i > 0 its logs (metrics.jsonl, events.jsonl,
        config.yml) and its local checkpoint tier under `process_<i>/` (checkpoints stay shared)."""
        local = process_log_dir(paths.local, self.spec.settings)
        if local == paths.local:
            return paths
        remote = None if paths.remote is None else paths.remote / local.name
        # The local checkpoint tier is per process too: each writes only what its own devices hold.
        tier = None if paths.local_checkpoints is None else paths.local_checkpoints / local.name
        return dataclasses.replace(paths, local=local, remote=remote, local_checkpoints=tier)

    def join(self) -> None:
        initialize(self.spec.settings, fault_tolerant=self.spec.elastic.elastic_enabled)

    def leave(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        leave(self.spec.settings)  # process 0 last: its exit takes the coordination service down

    @property
    def process_index(self) -> int:
        return jax.process_index()

    def slices(self, events) -> list[list]:
        """Slices are groups of processes_per_slice processes; with elastic_enabled the membership (live
        processes, rounds, mesh orders) agrees on them, and this process's heartbeat starts."""
        spec, settings = self.spec, self.spec.settings
        client = coordination_client()
        fresh = needs_fresh_communicators() and spec.elastic.elastic_enabled
        membership = Membership(
            jax.devices(),
            settings.processes_per_slice,
            process_index=jax.process_index(),
            client=client,
            events=events,
            fresh_devices=partial(fresh_cpu_client, client, process_index=jax.process_index()) if fresh else None,
            forget_rendezvous=partial(forget_rendezvous, client) if fresh else None,
            cliques_of=lambda slices: mesh_cliques(build_mesh(spec.mesh, slices)),
        )
        if spec.mesh.num_slices != membership.num_slices:
            raise ConfigError(
                f"num_slices={spec.mesh.num_slices} but {settings.num_processes} processes with "
                f"processes_per_slice={settings.processes_per_slice} form {membership.num_slices} "
                f"slices; set num_slices={membership.num_slices}"
            )
        if spec.checkpoint.local_checkpoint_directory and settings.processes_per_slice > 1:
            raise ConfigError(
                f"the local checkpoint tier needs every process to hold a whole replica of the train state "
                f"(processes_per_slice=1); with processes_per_slice={settings.processes_per_slice} leave "
                "local_checkpoint_directory unset"
            )
        self._faults()  # a schedule for another kind of job stops here
        if spec.elastic.elastic_enabled:
            self.membership = membership
            # Checkpoint barriers watch it (trainer/distributed/heartbeat.py).
            self.heartbeat = Heartbeat(client, jax.process_index())
        return membership.slice_devices()

    def stop(self, local: StopSignal, events) -> Callable[[int], bool]:
        """A SIGTERM to any process stops all of them at one step (trainer/distributed/stop.py)."""
        return CoordinatedStop(local, coordination_client(), events)

    def interrupt_eval(self, local: StopSignal) -> Callable[[], bool]:
        return lambda: False  # an evaluation is collective: the processes stop at the agreed step instead

    def host_times(self) -> HostTimes | None:
        return CoordinationHostTimes(coordination_client(), jax.process_index())

    def cluster(self, slices: list[list], *, events, stop: Callable[[int], bool], chaos_dir: Path) -> Cluster:
        """Elastic: a `ProcessCluster` over the membership (a process's own error is injected; lost
        processes are killed from outside). Otherwise every slice, always (`FixedCluster`)."""
        coordinated = stop if isinstance(stop, CoordinatedStop) else None
        if self.membership is None:
            return FixedCluster(slices, stop=coordinated)
        e = self.spec.elastic
        return ProcessCluster(
            self.membership,
            events=events,
            timeout_s=e.elastic_timeout_seconds,
            poll_s=e.elastic_poll_interval_seconds,
            dead_after_s=self.spec.settings.peer_dead_after_s,
            process_faults=ProcessFaultInjector(self._faults(), jax.process_index(), events),
            stop=coordinated,
        )

    def snapshots(self, events, store) -> HostSnapshots:
        """This process's devices' blocks in its own RAM; a scheduled slow copy is this process's own
        (fault_schedule step=N,process=P,slow_snapshot_s=S)."""
        return HostSnapshots(events, store=store, copy_delay=copy_delays(self._faults(), jax.process_index()))

    def allowed_periods(self, keys: PeriodKeys, *, elastic_enabled: bool) -> PeriodKeys:
        """Numbers only: each process would measure its own costs and could plan its own period, and the
        processes' saves must be of the same steps."""
        n = self.spec.settings.num_processes
        snapshot, local, checkpoint = keys.snapshot, keys.local, keys.checkpoint
        if checkpoint == AUTO:  # the checkpointer's fixed default
            checkpoint = UNPLANNED_CHECKPOINT_PERIOD
            if elastic_enabled:
                log.info("checkpoint_period=auto with %d processes: every %d steps", n, checkpoint)
        if local == AUTO:
            raise ConfigError(
                "local_checkpoint_period=auto needs one controller; with several processes give a number "
                "(every process saves the same steps)"
            )
        if snapshot == AUTO:
            log.info("snapshot_period=auto with %d processes: no snapshots (give a number)", n)
            snapshot = 0
        return PeriodKeys(snapshot=snapshot, local=local, checkpoint=checkpoint)

    @property
    def sdc_unavailable(self) -> str | None:
        n = self.spec.settings.num_processes
        return f"needs one controller (Pathways or one local process); this job has {n} processes"

    def _faults(self) -> tuple:
        """The schedule's faults, checked against this job's process count."""
        return self.spec.faults.check_processes(self.spec.settings.num_processes).faults
