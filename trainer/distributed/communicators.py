"""Fresh CPU collective communicators for each new formation of processes.

XLA's CPU collectives (gloo) keep one communicator per ordered device list for the life of the CPU
client, and meet through keys `cpu:gloo/<device ids>/<rank>` in the coordination service. Both
outlive a failure: after a peer restarts, a survivor's cached communicator still holds the dead
peer's sockets ("Connection closed by peer"), and the replacement's rendezvous finds the old keys
("ALREADY_EXISTS"). A collective that timed out with every process alive leaves the same broken
state. (Communicators are not keyed by process incarnation on CPU; NCCL's are, on GPU.)

So a formation after a failure starts clean on every member, between two barriers in which no member
runs a collective:
1. the lowest member process deletes every rendezvous key (`forget_rendezvous`);
2. each member whose client already ran collectives over one of the new mesh's device groups
   (`mesh_cliques`) drops its CPU client and creates a new one (`fresh_cpu_client`; process 0, which
   publishes the client's global topology, deletes that key first and publishes it again).
This works any number of times on the same device order. Compiled executables belong to the dropped
client: the next attempt compiles again, from the persistent compilation cache (`jax_cache_dir`)
when it is on. A formation whose groups are all new to every member (the survivors of a lost slice
of one process, on a smaller mesh) keeps its clients and its compiled steps, and recovers in seconds.
Every member that used a group used it with all of the group's other members, so they all decide
alike; a replacement's new client has used none.
"""

from __future__ import annotations

import itertools
import logging
import math
import time

import numpy as np

from trainer.distributed import internals

log = logging.getLogger(__name__)


def needs_fresh_communicators() -> bool:
    """Whether this backend's collectives must be rebuilt after a failure (CPU / gloo only)."""
    import jax

    return jax.default_backend() == "cpu"


def mesh_cliques(mesh) -> set[tuple[int, ...]]:
    """The device groups a computation on `mesh` can run collectives over: for every subset of the mesh
    axes, each set of devices that differ only along those axes, when it spans several processes. By
    device id, which a new client keeps. (A superset of what XLA uses: reusing one is what matters.)"""
    devices = mesh.devices
    out: set[tuple[int, ...]] = set()
    for count in range(1, devices.ndim + 1):
        for axes in itertools.combinations(range(devices.ndim), count):
            size = math.prod(devices.shape[a] for a in axes)
            if size == 1:
                continue
            rest = [a for a in range(devices.ndim) if a not in axes]
            for group in np.transpose(devices, rest + list(axes)).reshape(-1, size):
                if len({d.process_index for d in group}) > 1:
                    out.add(tuple(sorted(d.id for d in group)))
    return out


def forget_rendezvous(client) -> None:
    """Delete every gloo rendezvous key: the next collective of each device list meets afresh."""
    client.key_value_delete(internals.GLOO_RENDEZVOUS_DIR)


def fresh_cpu_client(client, *, process_index: int) -> list:
    """Drop this process's CPU client (its communicators and compiled executables) and create a new one;
    returns the new client's devices (every process's, as `jax.devices()`)."""
    t0 = time.perf_counter()
    if process_index == 0:
        client.key_value_delete(internals.CPU_TOPOLOGY_KEY)  # re-published by the new client below
    # live_devices remembers the previous round's devices to detect failures; those objects belong to the
    # dropped client, and compared with the new ones every device would look failed: renew forgets them.
    devices = internals.renew_cpu_client()
    log.info("fresh CPU client: %d devices in %.2f s", len(devices), time.perf_counter() - t0)
    return devices
