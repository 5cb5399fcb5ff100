"""Multi-process JAX (jax.distributed, one process per host) and its fault tolerance.

`init`: settings from config and environment, joining the job (recoverability, heartbeat, collective
timeout). `transfer`: small collectives for values some processes lack. What elasticity builds on
them (which processes are alive, sharing a snapshot) lives in `trainer.elastic`, which uses this
package; this package never uses it.
"""

from __future__ import annotations

from trainer.distributed.init import DistributedSettings, initialize, leave, process_log_dir, resolve_settings


def coordination_client():
    """The coordination-service client of this process (after `initialize`)."""
    from trainer.distributed import internals

    return internals.coordination_client()


__all__ = [
    "DistributedSettings",
    "coordination_client",
    "initialize",
    "leave",
    "process_log_dir",
    "resolve_settings",
]
