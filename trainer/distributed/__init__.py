"""Multi-process JAX (jax.distributed, one process per host) and its fault tolerance.

`init`: settings from config and environment, joining the job (recoverability, heartbeat, collective
timeout). `membership`: live processes agreed through `live_devices`, slices = process groups, fresh
mesh orders. `transfer`: the restore point every process agrees on, and a host snapshot sent to a
process that rejoined.
"""

from __future__ import annotations

from trainer.config.errors import ConfigError
from trainer.distributed.init import DistributedSettings, initialize, leave, process_log_dir, resolve_settings


def coordination_client():
    """The coordination-service client of this process (after `initialize`)."""
    from jax._src import distributed

    return distributed.global_state.client


def process_slices(cfg, settings: DistributedSettings, events):
    """(devices of each slice, Membership or None): slices are groups of processes_per_slice processes;
    the Membership (live processes, rounds, mesh orders) only when elastic_enabled."""
    import jax

    from trainer.distributed.membership import Membership

    membership = Membership(
        jax.devices(),
        settings.processes_per_slice,
        process_index=jax.process_index(),
        client=coordination_client(),
        events=events,
    )
    if cfg.mesh.num_slices != membership.num_slices:
        raise ConfigError(
            f"num_slices={cfg.mesh.num_slices} but {settings.num_processes} processes with "
            f"processes_per_slice={settings.processes_per_slice} form {membership.num_slices} "
            f"slices; set num_slices={membership.num_slices}"
        )
    if cfg.elastic.fault_schedule:
        raise ConfigError(
            "fault_schedule injects virtual-slice failures in one process; with several "
            "processes, kill one (scripts/launch_local.py, scripts/multiprocess_demo.py)"
        )
    return membership.slice_devices(), (membership if cfg.elastic.elastic_enabled else None)


__all__ = [
    "DistributedSettings",
    "coordination_client",
    "initialize",
    "leave",
    "process_log_dir",
    "process_slices",
    "resolve_settings",
]
