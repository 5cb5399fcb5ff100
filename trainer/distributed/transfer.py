"""Small collectives over every device of a mesh, for values that live on some processes only.

`gather_rows`: each process's small int vector, seen by all. `broadcast_from_data_row`: a replica of a
state held by the processes of one data-parallel row (one slice) put on every row's devices, each
device receiving only its own shard (a replacement process needs no more memory than its share).
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


def data_rows_of(mesh: Mesh, axis: str = "data") -> list[set[int]]:
    """For each index along `axis`, the processes whose devices hold that replica of the state."""
    grid = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    return [{d.process_index for d in row.flat} for row in grid]


def _uint_view(dtype) -> np.dtype | None:
    """The unsigned integer type of the same width as a float type: adding zeros to it keeps every bit
    (a float sum would turn -0.0 into +0.0)."""
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    return np.dtype(f"uint{dtype.itemsize * 8}")


def broadcast_from_data_row(
    mesh: Mesh,
    source_row: int,
    block_of: Callable[[int, tuple], np.ndarray | None],
    abstract,
    shardings,
    *,
    axis: str = "data",
):
    """One replica of a state, held by the processes of `source_row` along the mesh's `axis`, put on
    `shardings` (which replicate the state along `axis`), each device receiving only its own shard.

    `block_of(leaf_number, index)`: this process's values of leaf `leaf_number` in region `index`, or None
    (a process outside the source row, e.g. a replacement). Each leaf becomes an array with one extra
    leading dimension sharded over `axis`: the source row holds the values, every other row zeros, and a
    sum over that dimension (an all-reduce over `axis` only, as integers of the same width, so exact)
    delivers them: a device holds one shard of the input and one of the output, never the whole state."""
    leaves, treedef = jax.tree.flatten(abstract)
    out_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    rows = mesh.shape[axis]
    stacked = []
    for number, (a, sharding) in enumerate(zip(leaves, out_shardings)):
        spec = tuple(sharding.spec) + (None,) * (len(a.shape) - len(sharding.spec))
        if any(axis == p or (isinstance(p, tuple) and axis in p) for p in spec):
            raise ValueError(f"leaf {number} is sharded over {axis!r}: it is not a replica per {axis} row")
        view = _uint_view(a.dtype) or np.dtype(a.dtype)

        def values(index, number=number, a=a, view=view):
            row = index[0].start or 0
            block = block_of(number, index[1:]) if row == source_row else None
            if block is None:
                shape = [len(range(*s.indices(n))) for s, n in zip(index[1:], a.shape)]
                return np.zeros([1, *shape], view)
            return np.array(block, dtype=a.dtype, order="C").view(view)[None]  # keeps 0-d leaves 0-d

        stacked.append(
            jax.make_array_from_callback((rows, *a.shape), NamedSharding(mesh, PartitionSpec(axis, *spec)), values)
        )

    def total(parts):
        out = []
        for x, a in zip(parts, leaves):
            summed = jnp.sum(x, axis=0, dtype=x.dtype)
            out.append(jax.lax.bitcast_convert_type(summed, a.dtype) if _uint_view(a.dtype) else summed)
        return out

    result = jax.jit(total, out_shardings=out_shardings)(stacked)
    return jax.tree.unflatten(treedef, result)
