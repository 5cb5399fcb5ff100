"""Snapshots of a slice spread over several processes, and the shard-by-shard transfer a rejoin uses.

One process with 8 CPU devices stands in for several: a process's devices are a subset of the mesh,
and the values a process "holds" are what a callback returns for its devices. What is checked is the
arithmetic that multi-process runs rely on (tests/test_multiprocess.py runs them for real):
- `Blocks` keeps only the blocks a process's devices hold, finds sub-blocks, and counts its own bytes;
- `broadcast_from_data_row` delivers one row's replica to every row bit for bit (negative zeros and
  NaN payloads included) and fails loudly for a leaf sharded over the data axis;
- each device receives only its own shard: the stacked input is one shard per device, not a whole state.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.distributed.transfer import broadcast_from_data_row, data_rows_of
from trainer.elastic.snapshot import Blocks, HostSnapshots, _assemble, block_key, block_of, held_nbytes


class _Events:
    def __init__(self):
        self.rows = []

    def emit(self, event, **fields):
        self.rows.append({"event": event, **fields})


def _mesh(data=2, fsdp=4) -> Mesh:
    devices = np.array(jax.devices()[: data * fsdp]).reshape(data, fsdp, 1, 1)
    return Mesh(devices, ("data", "fsdp", "tensor", "expert"))


def test_a_partial_cover_is_kept_as_blocks_and_a_full_one_as_an_array():
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    halves = [((slice(0, 4), slice(None)), x[:4]), ((slice(4, 8), slice(None)), x[4:])]
    whole = _assemble(x.shape, x.dtype, halves)
    assert isinstance(whole, np.ndarray) and np.array_equal(whole, x)
    part = _assemble(x.shape, x.dtype, halves[:1])
    assert isinstance(part, Blocks) and part.nbytes == x[:4].nbytes
    assert np.array_equal(part.block((slice(0, 4), slice(None))), x[:4])
    assert np.array_equal(part.block((slice(1, 3), slice(2, 4))), x[1:3, 2:4]), "a sub-block of a held one"
    assert part.block((slice(4, 8), slice(None))) is None, "another process's block"
    assert np.array_equal(block_of(x, (slice(2, 6), slice(None))), x[2:6])
    assert held_nbytes({"a": part, "b": x}) == x[:4].nbytes + x.nbytes
    assert block_key((slice(None), slice(1, None)), (8, 4)) == ((0, 8), (1, 4))


def test_a_process_snapshot_of_its_own_shards_restores_onto_its_devices():
    """A snapshot taken of an fsdp-sharded state keeps blocks; `can_serve` checks them against the
    attempt's shardings and `load` puts them back bit for bit."""
    mesh = _mesh(1, 4)
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    state = {"w": jax.device_put(jnp.arange(16.0).reshape(8, 2), sharding), "step": jnp.int32(7)}
    snaps = HostSnapshots(_Events())
    snaps.take(7, state, {"next_step": 8}, block=True)
    assert isinstance(snaps.latest.state["w"], np.ndarray), "one process holding every shard keeps an array"
    # As a process holding only devices 0-1 of the slice would: keep their blocks only.
    w = snaps.latest.state["w"]
    snaps.latest.state["w"] = Blocks(w.shape, w.dtype, {((0, 4), (0, 2)): w[:4]})
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    assert not snaps.can_serve(abstract), "devices 2-3's blocks are on another process"
    snaps.latest.state["w"] = Blocks(w.shape, w.dtype, {((0, 4), (0, 2)): w[:4], ((4, 8), (0, 2)): w[4:]})
    assert snaps.can_serve(abstract)
    restored, data = snaps.load(abstract)
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(state["w"])) and data == {"next_step": 8}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_one_rows_replica_reaches_every_row_bit_for_bit(dtype):
    mesh = _mesh(2, 4)
    value = np.arange(64, dtype=np.float32).reshape(16, 4) - 20.0
    if dtype != jnp.int32:
        value[0, 0] = -0.0  # a float sum would make it +0.0
        value[0, 1] = np.nan
    value = np.asarray(jnp.asarray(value, dtype))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    abstract = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype), "s": jax.ShapeDtypeStruct((), np.int32)}
    asked = []

    def held(number, index):  # leaves in abstract's order: "s", "w"
        asked.append((number, index))
        return np.int32(5)[index] if number == 0 else value[index]

    shardings = {"w": sharding, "s": NamedSharding(mesh, PartitionSpec())}
    out = broadcast_from_data_row(mesh, 1, held, abstract, shardings)
    got = np.asarray(out["w"])
    assert got.dtype == value.dtype and got.tobytes() == value.tobytes()
    assert int(out["s"]) == 5
    for shard in out["w"].addressable_shards:  # every device holds its own shard of the replica
        assert shard.data.shape == (4, 4)
        assert np.asarray(shard.data).tobytes() == value[shard.index].tobytes()
    # Only the source row's devices were asked for values, each for its own shard (4 of them, plus "s").
    w_asks = [index for number, index in asked if number == 1]
    assert len(w_asks) == 4 and all(value[i].shape == (4, 4) for i in w_asks)


def test_a_leaf_sharded_over_the_data_axis_is_refused():
    mesh = _mesh(2, 4)
    abstract = {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}
    with pytest.raises(ValueError, match="sharded over 'data'"):
        broadcast_from_data_row(
            mesh, 0, lambda n, i: None, abstract, {"w": NamedSharding(mesh, PartitionSpec("data"))}
        )


def test_data_rows_name_the_processes_of_each_replica():
    assert data_rows_of(_mesh(2, 4)) == [{0}, {0}]  # one process here
    # 2 slices x 2 processes x 2 devices, as a mesh's (data, fsdp) grid of devices with their processes:
    devices = np.array([[SimpleNamespace(process_index=2 * r + f // 2) for f in range(4)] for r in range(2)])
    mesh = SimpleNamespace(devices=devices, axis_names=("data", "fsdp"))
    assert data_rows_of(mesh) == [{0, 1}, {2, 3}]
