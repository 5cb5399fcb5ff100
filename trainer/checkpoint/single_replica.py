"""Restores that read each byte once: with several processes and the state replicated along the mesh's
`data` axis (one row per slice), only the processes of data row 0 read the checkpoint, and a sum over
`data` (zeros from the other rows) hands every device its shard. Without it each slice's processes read
a whole replica, so a restore onto N slices pulls N copies from the bucket.

Orbax's `SingleReplicaArrayHandler` does the read and the broadcast (what MaxText's
`enable_single_replica_ckpt_restoring` uses); this module decides when it applies and gives it its
arguments. The handler is in the checkpointer's registry for every run: it saves as Orbax's default
`jax.Array` handler does, and restores as it does unless a restore passes `SingleReplicaArrayRestoreArgs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from trainer.io.orbax_internals import orbax_array_metadata_store

REPLICA_AXIS = "data"
# Bytes per device of one broadcast program (Orbax splits the state into programs of at most this much);
# set, because Orbax's default asks the device for its memory, which CPU devices do not report.
BROADCAST_LIMIT_BYTES = 1 << 30


class _ReplicaReadingArrayHandler(ocp.type_handlers.SingleReplicaArrayHandler):
    async def deserialize(self, infos, args=None):
        if args and all(isinstance(a, ocp.type_handlers.SingleReplicaArrayRestoreArgs) for a in args):
            return await super().deserialize(infos, args)
        return await ocp.type_handlers.ArrayHandler.deserialize(self, infos, args)


def type_handler_registry():
    """Orbax's default handlers, with the `jax.Array` one able to read a single replica."""
    array = _ReplicaReadingArrayHandler(
        replica_axis_index=0,
        broadcast_memory_limit_bytes=BROADCAST_LIMIT_BYTES,
        array_metadata_store=orbax_array_metadata_store(),
    )
    th = ocp.type_handlers
    scalar = th.ScalarHandler()
    return th.create_type_handler_registry(
        (int, scalar),
        (float, scalar),
        (bytes, scalar),
        (np.number, scalar),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, array),
        (str, th.StringHandler()),
    )


def applies(abstract_state) -> bool:
    """Whether a restore onto `abstract_state` can read one replica: several processes, every leaf a
    number array replicated along a `data` axis (the mesh's first) of more than one row, and every
    process's devices either all in row 0 or none (Orbax's condition: the reading processes hold whole
    replicas). The broadcast sums the rows, so a negative zero arrives as zero (the same value)."""
    if jax.process_count() == 1:
        return False
    leaves = jax.tree.leaves(abstract_state)
    if not leaves or not all(isinstance(getattr(a, "sharding", None), NamedSharding) for a in leaves):
        return False
    mesh = leaves[0].sharding.mesh
    if mesh.axis_names[0] != REPLICA_AXIS or mesh.shape[REPLICA_AXIS] < 2:
        return False
    for a in leaves:
        if not jnp.issubdtype(a.dtype, jnp.number):  # a sum would turn booleans into integers
            return False
        if a.sharding.mesh != mesh or any(
            REPLICA_AXIS == p or (isinstance(p, tuple) and REPLICA_AXIS in p) for p in a.sharding.spec
        ):
            return False
    return row0_holds_whole_processes(np.vectorize(lambda d: d.process_index)(mesh.devices))


def row0_holds_whole_processes(process_of: np.ndarray) -> bool:
    """`process_of`: each mesh position's process. Whether no process has devices both in row 0 of the
    first axis and outside it."""
    return not set(process_of[0].flat) & set(process_of[1:].flat)


def restore_args(abstract_state):
    """Orbax's restore arguments for `abstract_state`: one-replica reads where `applies`, else the usual."""
    if not applies(abstract_state):
        return ocp.checkpoint_utils.construct_restore_args(abstract_state)
    return jax.tree.map(
        lambda a: ocp.type_handlers.SingleReplicaArrayRestoreArgs(
            sharding=a.sharding, global_shape=a.shape, dtype=a.dtype
        ),
        abstract_state,
    )
