"""Pinned-host snapshots: the state is copied to its devices' hosts in its own sharding, a lost slice
takes its replicas with it, the restore rebuilds the state from the survivors onto any mesh, and no step
of it converts a device array to numpy (under Pathways that would route the state through the
controller)."""

from __future__ import annotations

import contextlib
import ctypes
import operator
import pickle
import threading

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


# Every route by which a jax.Array's values reach this process's memory. The methods all end in
# `_value` or the per-device copy below it, but each is counted where it is entered (the outermost one
# per conversion), so a failure names the route. Not counted: `addressable_data(i)` and
# `addressable_shards[i].data` (device arrays: only their conversion transfers, counted here),
# `__cuda_array_interface__` (a device pointer), and `__repr__`/`__str__`/`__format__`/`__iter__`, which
# read values only through `_value` (counted) and otherwise transfer nothing.
HOST_ROUTES = (
    "__array__",  # np.asarray, np.array (and item(), which calls np.asarray)
    "tolist",
    "item",
    "tobytes",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__bool__",
    "__hex__",
    "__oct__",
    "__reduce__",  # pickle, copy.copy
    "__dlpack__",  # np.from_dlpack: on CPU, the array's own memory
    "copy_to_host_async",  # starts the copy into the array's host-side cache
    "_copy_single_device_array_to_host_async",
    "_single_device_array_to_np_array_did_copy",  # the per-device copy every route above ends in
)


class _TypeHead(ctypes.Structure):
    """CPython's PyTypeObject up to `tp_as_buffer` (the same fields from 3.8 to 3.13)."""

    _fields_ = [
        ("ob_refcnt", ctypes.c_ssize_t),
        ("ob_type", ctypes.c_void_p),
        ("ob_size", ctypes.c_ssize_t),
        ("tp_name", ctypes.c_char_p),
        ("tp_basicsize", ctypes.c_ssize_t),
        ("tp_itemsize", ctypes.c_ssize_t),
        *[(name, ctypes.c_void_p) for name in ("tp_dealloc", "tp_vectorcall_offset", "tp_getattr")],
        *[(name, ctypes.c_void_p) for name in ("tp_setattr", "tp_as_async", "tp_repr", "tp_as_number")],
        *[(name, ctypes.c_void_p) for name in ("tp_as_sequence", "tp_as_mapping", "tp_hash", "tp_call")],
        *[(name, ctypes.c_void_p) for name in ("tp_str", "tp_getattro", "tp_setattro", "tp_as_buffer")],
    ]


@contextlib.contextmanager
def _no_buffer_protocol(cls):
    """Switch off `cls`'s C buffer export (PyBufferProcs.bf_getbuffer) while the context is open.

    On CPU a single-device jax.Array exports its memory through the buffer protocol, and numpy
    (np.asarray, np.array, item(), memoryview, bytes) uses that before `__array__`: no Python-level
    patch sees it, so a float32 or int32 conversion would slip past the spy. On a TPU or GPU the
    protocol refuses device memory and numpy falls back to `__array__`; without the export CPU does the
    same, and the conversion is counted."""
    head = _TypeHead.from_address(id(cls))
    heap_type = 1 << 9  # Py_TPFLAGS_HEAPTYPE: the buffer procs live in the type object, not read-only memory
    assert cls.__flags__ & heap_type and head.tp_basicsize == cls.__basicsize__, "PyTypeObject layout changed"
    assert head.tp_name.decode().rsplit(".", 1)[-1] == cls.__name__ and head.tp_as_buffer
    getbuffer = ctypes.c_void_p.from_address(head.tp_as_buffer)  # PyBufferProcs' first field
    original = getbuffer.value
    getbuffer.value = None
    try:
        yield
    finally:
        getbuffer.value = original


@pytest.fixture
def numpy_conversions(monkeypatch):
    """(route, bytes) of every jax.Array whose values reached this process's memory while the test runs
    (`HOST_ROUTES`, `_value`, `jax.device_get`, and numpy's conversions with the CPU buffer export off)."""
    from jax._src import array

    seen: list[tuple[str, int]] = []
    depth = threading.local()

    def counted(route: str, fn, nbytes):
        def spy(*args, **kwargs):
            outermost = not getattr(depth, "n", 0)
            if outermost:
                seen.append((route, nbytes(*args)))
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth.n -= 1

        return spy

    cls = array.ArrayImpl
    for route in HOST_ROUTES:
        monkeypatch.setattr(cls, route, counted(route, getattr(cls, route), lambda self, *a: int(self.nbytes)))
    value = cls.__dict__["_value"]
    monkeypatch.setattr(cls, "_value", property(counted("_value", value.fget, lambda self: int(self.nbytes))))
    tree_bytes = lambda tree: sum(int(x.nbytes) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))  # noqa: E731
    monkeypatch.setattr(jax, "device_get", counted("jax.device_get", jax.device_get, tree_bytes))
    with _no_buffer_protocol(cls):
        probe = jnp.arange(3.0)  # float32, single device: on CPU numpy would read its buffer directly
        np.testing.assert_array_equal(np.asarray(probe), [0.0, 1.0, 2.0])
        assert seen == [("__array__", 12)], f"the spy missed np.asarray of a CPU array: {seen}"
        seen.clear()
        yield seen


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


# Each way a jax.Array's values can reach the host, applied to `x` (float32, 4 values) or its scalars
# `s` (float32) and `i` (int32), all made and on the device before the route runs.
ROUTES = {
    "np.asarray": lambda x, s, i: np.asarray(x),
    "np.array": lambda x, s, i: np.array(x),
    "_value": lambda x, s, i: x._value,
    "tolist": lambda x, s, i: x.tolist(),
    "item": lambda x, s, i: s.item(),
    "tobytes": lambda x, s, i: x.tobytes(),
    "float": lambda x, s, i: float(s),
    "int": lambda x, s, i: int(i),
    "index": lambda x, s, i: operator.index(i),
    "complex": lambda x, s, i: complex(s),
    "bool": lambda x, s, i: bool(s),
    "str": lambda x, s, i: str(x),
    "format": lambda x, s, i: f"{s:.1f}",
    "pickle": lambda x, s, i: pickle.dumps(x),
    "from_dlpack": lambda x, s, i: np.from_dlpack(x),
    "copy_to_host_async": lambda x, s, i: x.copy_to_host_async(),
    "device_get": lambda x, s, i: jax.device_get({"x": x}),
    "a shard's data": lambda x, s, i: np.asarray(x.addressable_shards[0].data),
    "addressable_data": lambda x, s, i: np.asarray(x.addressable_data(0)),
    "setitem into numpy": lambda x, s, i: np.zeros(4, np.float32).__setitem__(slice(None), x),
    "numpy ufunc": lambda x, s, i: np.add(np.zeros(4, np.float32), x),
}


@pytest.mark.parametrize("route", ROUTES)
def test_the_conversion_spy_counts_every_route_to_the_host(route, numpy_conversions):
    """The spy the tests above rely on counts each way a float32 array on one CPU device reaches host
    memory, the ways that numpy takes through the CPU buffer protocol too."""
    cpu = jax.devices("cpu")[0]
    x, s, i = jax.block_until_ready(jax.device_put((jnp.arange(4.0), jnp.float32(2.5), jnp.int32(3)), cpu))
    numpy_conversions.clear()
    ROUTES[route](x, s, i)
    assert numpy_conversions, f"{route} reached the host uncounted"


def test_the_cpu_buffer_export_is_off_under_the_spy(numpy_conversions):
    x = jax.block_until_ready(jax.device_put(jnp.arange(4.0), jax.devices("cpu")[0]))
    with pytest.raises(TypeError):
        memoryview(x)  # as on a TPU: no direct view of the array's memory
    assert numpy_conversions == []
