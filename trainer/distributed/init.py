"""Joining a multi-process JAX job (one process per host; GPU clusters and multi-host CPU, no Pathways).

Settings come from the `distributed` config section, else from the environment that Kubernetes
JobSet (our manifests export JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID,
NODES_PER_SLICE, JAX_HEARTBEAT_TIMEOUT_SECONDS) and Slurm (SLURM_NTASKS, SLURM_PROCID) provide.
`resolve_settings` is pure, so the process id is known before JAX starts (the run directory of a
non-zero process depends on it).

Fault tolerance (with elastic_enabled) needs three things before JAX's backend exists, all done by
`initialize`:
- `jax_enable_recoverability`: without it the coordination service aborts every survivor when a peer
  stops heartbeating.
- a heartbeat timeout: how long a silent process takes to be declared dead (kill -> detection).
- a bounded CPU collective timeout in XLA_FLAGS: a survivor whose gloo receive waits on a dead peer
  otherwise hangs for XLA's default 30 minutes. XLA reads the flags once, when the backend starts.

Process 0 hosts the coordination service. Its loss ends every process of the job (the survivors'
clients abort within milliseconds); only a restart of the whole job, which resumes from the newest
committed checkpoint, recovers from that.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from trainer.config.errors import ConfigError
from trainer.config.schema import DistributedConfig

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT_S = 10
DEFAULT_COLLECTIVE_TIMEOUT_S = 60
# XLA's in-process rendezvous gives up (terminates the process) after this flag's value (default 40 s);
# it must stay above the collective timeout, or a slow collective kills the process instead of failing.
_TERMINATE_MARGIN_S = 60
_COLLECTIVE_FLAG = "--xla_cpu_collective_timeout_seconds"
_TERMINATE_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Resolved multi-process settings of this process."""

    coordinator_address: str
    num_processes: int
    process_id: int
    processes_per_slice: int
    heartbeat_timeout_seconds: int
    collective_timeout_seconds: int  # 0: XLA_FLAGS already sets it (see xla_flags_with_timeout)

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1

    @property
    def num_slices(self) -> int:
        return self.num_processes // self.processes_per_slice

    @property
    def peer_dead_after_s(self) -> float:
        """How long a peer's heartbeat may be silent before this process's checkpoint barriers give up on
        it, and so how long a frozen process may sleep before its peers have gone on without it: three
        heartbeat timeouts, plus a margin for the key-value store's own delays."""
        return 3.0 * self.heartbeat_timeout_seconds + 5.0


def _env_int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def resolve_settings(cfg: DistributedConfig, environ: Mapping[str, str] | None = None) -> DistributedSettings:
    """Config values win; -1 / '' / 0 fall back to the environment, then to one process."""
    env = os.environ if environ is None else environ
    address = cfg.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS", "").strip()
    count = (
        cfg.num_processes if cfg.num_processes != -1 else (_env_int(env, "JAX_NUM_PROCESSES", "SLURM_NTASKS") or 1)
    )
    pid = (
        cfg.process_id
        if cfg.process_id != -1
        else _env_int(env, "JAX_PROCESS_ID", "SLURM_PROCID", "JOB_COMPLETION_INDEX")
    )
    per_slice = (
        cfg.processes_per_slice if cfg.processes_per_slice != -1 else (_env_int(env, "NODES_PER_SLICE") or 1)
    )
    heartbeat = (
        cfg.heartbeat_timeout_seconds
        or _env_int(env, "JAX_HEARTBEAT_TIMEOUT_SECONDS")
        or DEFAULT_HEARTBEAT_TIMEOUT_S
    )
    collective = cfg.collective_timeout_seconds
    if not collective and _COLLECTIVE_FLAG not in env.get("XLA_FLAGS", ""):
        collective = DEFAULT_COLLECTIVE_TIMEOUT_S
    problems = []
    if count > 1:
        if not address:
            problems.append(
                f"{count} processes need coordinator_address (or $JAX_COORDINATOR_ADDRESS): host:port of process 0"
            )
        if pid is None or not 0 <= pid < count:
            problems.append(f"process_id={pid} must be in [0, {count}) (set it or $JAX_PROCESS_ID)")
        if per_slice < 1 or count % per_slice:
            problems.append(f"processes_per_slice={per_slice} must be >= 1 and divide num_processes={count}")
        if heartbeat < 1:
            problems.append(f"heartbeat_timeout_seconds={heartbeat} must be >= 1")
    if problems:
        raise ConfigError("invalid multi-process settings:\n  - " + "\n  - ".join(problems))
    return DistributedSettings(address, count, pid or 0, per_slice, heartbeat, collective)


def xla_flags_with_timeout(flags: str, collective_timeout_s: int) -> str:
    """XLA_FLAGS plus the CPU collective timeouts, unless the flags already set them (a launcher's choice wins)."""
    if not collective_timeout_s or _COLLECTIVE_FLAG in flags:
        return flags
    extra = f"{_COLLECTIVE_FLAG}={collective_timeout_s}"
    if _TERMINATE_FLAG not in flags:
        extra += f" {_TERMINATE_FLAG}={collective_timeout_s + _TERMINATE_MARGIN_S}"
    return f"{flags} {extra}".strip()


def initialize(settings: DistributedSettings, *, fault_tolerant: bool) -> None:
    """Join the job. Must run before anything touches a JAX device (XLA_FLAGS are read once, then)."""
    import jax

    from trainer.distributed.internals import backends_initialized

    if backends_initialized():
        raise RuntimeError("trainer.distributed.initialize must run before JAX's backend is initialised")
    os.environ["XLA_FLAGS"] = xla_flags_with_timeout(
        os.environ.get("XLA_FLAGS", ""), settings.collective_timeout_seconds
    )
    if fault_tolerant:
        # Before initialize: the coordination service is created recoverable only if this is already set.
        jax.config.update("jax_enable_recoverability", True)
    # JAX's preemption service would install its own SIGTERM handler over the trainer's, and its sync
    # point assumes every process trains from the same step for the job's lifetime, which elastic
    # re-formations and replacements break; the trainer agrees on a stop step itself (distributed/stop.py).
    jax.config.update("jax_enable_preemption_service", False)
    log.info(
        "joining %d-process job as process %d (coordinator %s, heartbeat timeout %d s, fault_tolerant=%s)",
        settings.num_processes,
        settings.process_id,
        settings.coordinator_address,
        settings.heartbeat_timeout_seconds,
        fault_tolerant,
    )
    jax.distributed.initialize(
        settings.coordinator_address,
        num_processes=settings.num_processes,
        process_id=settings.process_id,
        heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
    )


def process_log_dir(run_dir: Path, settings: DistributedSettings) -> Path:
    """Where this process writes metrics.jsonl and events.jsonl: process 0 the run directory itself,
    process i its `process_<i>/` subdirectory (checkpoints stay shared in <run dir>/checkpoints)."""
    if not settings.multi_process or settings.process_id == 0:
        return run_dir
    return run_dir / f"process_{settings.process_id}"


def leave(settings: DistributedSettings, *, wait_s: float = 10.0) -> None:
    """Leave the job in an order that lets every process exit cleanly: the others disconnect, and process 0,
    whose exit takes the coordination service (and any process still connected) down, waits up to
    `wait_s` for them first. Without it a process still connected when process 0 exits aborts."""
    import threading

    import jax

    from trainer.distributed.internals import coordination_client

    client = coordination_client()
    if client is None:
        return
    if settings.process_id == 0 and settings.multi_process:
        others_gone = threading.Event()

        def wait_for_others():
            # GetAliveTasks returns once every *alive* process has called it: a process that has
            # disconnected no longer counts, so it returns {0} when everyone else has left.
            try:
                while set(client.get_live_nodes(list(range(settings.num_processes)))) != {0}:
                    time.sleep(0.05)
                others_gone.set()
            except Exception as e:  # the service is going away anyway
                log.debug("waiting for the other processes to leave: %s", e)

        threading.Thread(target=wait_for_others, name="leave-job", daemon=True).start()
        if not others_gone.wait(wait_s):
            log.warning("other processes still connected %s s after this one finished; leaving anyway", wait_s)
    jax.distributed.shutdown()
