"""Pinned-host snapshots: the state is copied to its devices' hosts in its own sharding, a lost slice
takes its replicas with it, the restore rebuilds the state from the survivors onto any mesh, and no step
of it converts a device array to numpy (under Pathways that would route the state through the
controller)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devices import PLATFORMS, devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.elastic.pinned_snapshots import PINNED, PinnedSnapshots
from trainer.elastic.snapshot import HostSnapshots

SIDE = {"cpu": 256, "gpu": 8192}  # the big leaf: 256 KiB on CPU, 256 MiB on a GPU


class Events:
    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": str(event), **fields})

    def named(self, name):
        return [r for r in self.records if r["event"] == name]


@pytest.fixture
def numpy_conversions(monkeypatch):
    """Bytes of every jax.Array converted to numpy while the test runs."""
    from jax._src import array

    seen: list[int] = []
    original = array.ArrayImpl.__array__

    def spy(self, *args, **kwargs):
        seen.append(int(self.nbytes))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(array.ArrayImpl, "__array__", spy)
    return seen


def _mesh(data: int, fsdp: int, devices):
    return jax.make_mesh((data, fsdp), ("data", "fsdp"), devices=devices)


def _state(mesh):
    return {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp"))),
        "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, P())),
        "step": jax.device_put(jnp.int32(7), NamedSharding(mesh, P())),
    }


def _abstract(state, mesh):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)), state
    )


def test_a_snapshot_survives_a_lost_slice_and_restores_onto_fewer_slices_without_numpy(numpy_conversions):
    devices = jax.devices("cpu")[:6]
    mesh = _mesh(3, 2, devices)  # 3 slices (data rows) of 2 devices
    state = _state(mesh)
    expected, abstract = jax.tree.map(np.asarray, state), _abstract(state, mesh)
    numpy_conversions.clear()
    events = Events()
    snaps = PinnedSnapshots(events)
    snaps.take(4, state, {"cursor": 12})
    # The next step donates the state: the snapshot is its own copy.
    state = jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s), donate_argnums=0)(state)
    assert snaps.newest_step() == 4
    taken = events.named("snapshot_taken")[0]
    assert taken["memory"] == PINNED and taken["host_bytes"] == 0 and taken["replicas"] == 3
    assert taken["bytes"] == 64 * 4 + 8 * 2 + 4  # one replica, not three

    snaps.lose(devices[2:4])  # slice 1's hosts are gone, and its replica with them
    survivors = _mesh(2, 2, devices[:2] + devices[4:6])
    abstract = _abstract(state, survivors)
    assert snaps.can_serve(abstract)
    restored, data_state = snaps.load(abstract)
    assert numpy_conversions == []  # snapshot and restore: no device array became numpy
    assert data_state == {"cursor": 12}
    restored_event = events.named("snapshot_restored")[0]
    assert restored_event["replicas"] == 2 and restored_event["host_bytes"] == 0
    for key, want in expected.items():
        assert restored[key].sharding == abstract[key].sharding
        np.testing.assert_array_equal(np.asarray(restored[key]), want)


def test_a_snapshot_whose_every_replica_was_lost_is_not_used(numpy_conversions):
    devices = jax.devices("cpu")[:2]
    mesh = _mesh(1, 2, devices)
    snaps = PinnedSnapshots(Events())
    snaps.take(3, _state(mesh), {}, block=True)
    assert snaps.newest_step() == 3
    snaps.lose(devices)
    assert snaps.newest_step() is None


def test_the_numpy_snapshot_converts_what_the_pinned_one_does_not(numpy_conversions):
    """The detector above catches a conversion: the per-process numpy snapshot makes them."""
    mesh = _mesh(1, 2, jax.devices("cpu")[:2])
    events = Events()
    snaps = HostSnapshots(events)
    snaps.take(1, _state(mesh), {}, block=True)
    assert numpy_conversions and events.named("snapshot_taken")[0]["host_bytes"] > 0


def test_the_local_tier_is_written_from_the_pinned_copy(tmp_path):
    from trainer.checkpoint.local_store import LocalStore

    mesh = _mesh(2, 2, jax.devices("cpu")[:4])
    state = _state(mesh)
    store = LocalStore(tmp_path / "local", keep=2, events=Events(), config={})
    snaps = PinnedSnapshots(Events(), store=store)
    snaps.take(5, state, {"cursor": 3}, block=True, persist=True)
    assert store.steps() == [5]
    host, data_state = store.read(5, _abstract(state, mesh))
    assert data_state == {"cursor": 3}
    np.testing.assert_array_equal(host["w"], np.arange(64.0).reshape(8, 8))


def _big_state(mesh, side: int):
    """`_state` plus a `side` x `side` float32 leaf: on a GPU, a transfer that takes real time."""
    big = jnp.arange(side * side, dtype=jnp.float32).reshape(side, side)
    return {**_state(mesh), "big": jax.device_put(big, NamedSharding(mesh, P("fsdp")))}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_pinned_snapshot_on_one_device_restores_without_numpy_after_the_step_donates(
    platform, numpy_conversions
):
    mesh = _mesh(1, 1, devices(platform, 1))
    state = _big_state(mesh, SIDE[platform])
    expected, abstract = jax.tree.map(np.asarray, state), _abstract(state, mesh)
    numpy_conversions.clear()
    events = Events()
    snaps = PinnedSnapshots(events)
    snaps.take(3, state, {"cursor": 1}, block=True)
    state = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)  # the step donates
    taken = events.named("snapshot_taken")[0]
    assert taken["memory"] == PINNED and taken["host_bytes"] == 0
    restored, data_state = snaps.load(abstract)
    assert numpy_conversions == []
    assert data_state == {"cursor": 1}
    assert restored["big"].sharding.memory_kind == "device"
    for key, want in expected.items():
        np.testing.assert_array_equal(np.asarray(restored[key]), want)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_numpy_snapshot_copies_through_pinned_host_memory_and_survives_the_next_donation(platform):
    """Several processes keep numpy snapshots (their JAX client is renewed with each formation); the copy
    out of the device goes to pinned host memory, so the device never holds a second copy of the state."""
    from trainer.elastic import snapshot

    n = 2 if platform == "cpu" else 1
    mesh = _mesh(1, n, devices(platform, n))
    state = _big_state(mesh, SIDE[platform])
    expected = jax.tree.map(np.asarray, state)
    copies = snapshot._distinct_shards(state["w"])
    assert [c.sharding.memory_kind for _, c in copies] == [PINNED] * n
    snaps = HostSnapshots(Events())
    snaps.take(2, state, {}, block=False)
    jax.jit(lambda s: jax.tree.map(lambda x: x * 0, s), donate_argnums=0)(state)  # the next step donates
    assert snaps.newest_step() == 2
    for key, want in expected.items():
        np.testing.assert_array_equal(snaps.latest.state[key], want)
