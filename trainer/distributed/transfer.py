"""Agreeing on the restore point of a multi-process attempt and handing a host snapshot to processes without it.

Every process of a new formation calls the restore source together (it runs collectives on the new
mesh). They gather (snapshot step, newest checkpoint step, size of the data-iterator state) from each
other, so all of them take the same decision:
- the newest snapshot is not newer than the checkpoint: restore the checkpoint (Orbax, every process);
- every process holds it (survivors continuing after a loss): each puts its own copy on its devices;
- some lack it (a replacement that just joined): it is sent from the first holder in mesh order. The
  holder contributes the values and every other device zeros, and a sum over devices delivers them
  exactly (x + 0 == x), with the data-iterator state (JSON bytes) riding along the same way.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)


def _device_rows(mesh: Mesh) -> tuple[NamedSharding, dict]:
    """A sharding that gives each mesh device one row of a leading dimension, and device -> row."""
    sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    index = sharding.devices_indices_map((mesh.size,))
    return sharding, {d: idx[0].start or 0 for d, idx in index.items()}


def _rows_array(mesh: Mesh, row_value: Callable[[int], np.ndarray], shape: tuple, dtype) -> jax.Array:
    """A (devices, *shape) array whose row r (on the device holding it) is row_value(r)."""
    sharding, rows = _device_rows(mesh)
    return jax.make_array_from_callback(
        (mesh.size, *shape), sharding, lambda idx: row_value(idx[0].start or 0)[None].astype(dtype)
    )


def gather_rows(mesh: Mesh, local: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Every device's copy of this process's `local` vector, all-gathered: (table[row], process of row)."""
    local = np.asarray(local, dtype=np.int32)
    arr = _rows_array(mesh, lambda r: local, local.shape, np.int32)
    table = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))(arr)
    _, rows = _device_rows(mesh)
    process_of_row = [0] * mesh.size
    for d, r in rows.items():
        process_of_row[r] = d.process_index
    return np.asarray(table), process_of_row


def broadcast_from_row(mesh: Mesh, source_row: int, values, abstract, shardings):
    """`values` (numpy pytree, only needed on the process holding `source_row`) onto `shardings`."""

    def leaf(value, a):
        zeros = np.zeros(a.shape, a.dtype)
        return _rows_array(
            mesh, lambda r: value if (r == source_row and value is not None) else zeros, a.shape, a.dtype
        )

    if values is None:
        values = jax.tree.map(lambda a: None, abstract)
    rows = jax.tree.map(leaf, values, abstract, is_leaf=lambda x: x is None)
    total = jax.jit(
        lambda t: jax.tree.map(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), t), out_shardings=shardings
    )
    return total(rows)


def shared_snapshot_source(snapshots, events, *, barrier: Callable[[], None] = lambda: None) -> Callable:
    """A `restore_source(abstract_state, newest_checkpoint_step)` for build_attempt on many processes.
    `barrier` runs first: every process has compiled, and the collectives below start together."""

    def restore_source(abstract_state, newest_checkpoint_step):
        barrier()
        snapshots.settle()
        snap = snapshots.latest
        shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
        mesh = jax.tree.leaves(shardings)[0].mesh
        blob = json.dumps(snap.data_state).encode() if snap is not None else b""
        ckpt = -1 if newest_checkpoint_step is None else newest_checkpoint_step
        table, process_of_row = gather_rows(mesh, [snap.step if snap is not None else -1, ckpt, len(blob)])
        if len(set(table[:, 1])) != 1:
            raise RuntimeError(
                f"processes see different newest checkpoints {sorted(set(table[:, 1]))}: "
                "the checkpoint directory must be one shared filesystem"
            )
        best = int(table[:, 0].max())
        if best < 0 or best < ckpt:  # a tie goes to host RAM, as in HostSnapshots
            return None
        if (table[:, 0] == best).all():
            return snapshots.restore_source(abstract_state, newest_checkpoint_step)
        t0 = time.perf_counter()
        source_row = int(np.argmax(table[:, 0] == best))
        mine = snap is not None and snap.step == best
        size = int(table[:, 2].max())
        payload = {"state": snap.state, "data": np.frombuffer(blob.ljust(size), np.uint8)} if mine else None
        abstract = {"state": abstract_state, "data": jax.ShapeDtypeStruct((size,), np.uint8)}
        replicated = NamedSharding(mesh, PartitionSpec())
        out = broadcast_from_row(mesh, source_row, payload, abstract, {"state": shardings, "data": replicated})
        state = jax.block_until_ready(out["state"])
        data_state = json.loads(np.asarray(out["data"]).tobytes().decode().strip() or "{}")
        nbytes = int(sum(x.nbytes for x in jax.tree.leaves(state)))
        events.emit(
            "snapshot_shared",
            step=best,
            source_process=process_of_row[source_row],
            bytes=nbytes,
            seconds=round(time.perf_counter() - t0, 4),
        )
        return state, data_state, f"snapshot:{best}"

    return restore_source
