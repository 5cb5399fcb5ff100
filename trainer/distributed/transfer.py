"""Small collectives over every device of a mesh, for values that live on some processes only.

`gather_rows`: each process's small int vector, seen by all. `broadcast_from_row`: a pytree held by
one process put on the shardings of every process's devices: the holder contributes the values and
every other device zeros, and a sum over devices delivers them exactly (x + 0 == x).
"""

from __future__ import annotations

import logging
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
