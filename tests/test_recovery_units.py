"""Pieces of in-process recovery, without the CLI: when a fault takes effect, which restore source
wins, and what a retry on slices seen before reuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NANO_MODEL

from trainer.attempt.builder import AttemptBuilder
from trainer.attempt.restore import choose_source, restore_state
from trainer.config import load_config
from trainer.elastic.faults import FaultInjector
from trainer.elastic.snapshot import HostSnapshots
from trainer.failures.slice_loss import Outages, SliceLoss
from trainer.observe.events import EventLog
from trainer.parallel.mesh import group_into_slices
from trainer.program.layout import train_spec


class _Step:
    """Stands in for a dispatched step's output: records when the injector waits for it."""

    def __init__(self, log):
        self.log = log

    def block_until_ready(self):
        self.log.append("in-flight step finished")
        return self


class _Events:
    def __init__(self, log):
        self.log = log

    def emit(self, name, **fields):
        self.log.append(name)


def test_a_due_fault_takes_effect_when_the_step_in_flight_has_finished(tmp_path):
    log = []
    injector = FaultInjector([SliceLoss(step=3, slice=1)], Outages(), tmp_path / "chaos", _Events(log))
    injector.at_step_boundary(2, in_flight=_Step(log))
    assert log == [], "no fault due: the loop must not wait for the device"
    injector.at_step_boundary(3, in_flight=_Step(log))
    assert log == ["in-flight step finished", "slice_killed"]
    assert injector.outages.take_failures([0, 1, 2]) == [1], "the next step on slice 1 fails"


def test_a_chaos_request_also_waits_for_the_step_in_flight(tmp_path):
    log = []
    chaos = tmp_path / "chaos"
    chaos.mkdir()
    (chaos / "req.json").write_text('{"slice": 2, "down_s": 0}')
    injector = FaultInjector([], Outages(), chaos, _Events(log))
    injector.at_step_boundary(5, in_flight=_Step(log))
    assert log == ["in-flight step finished", "slice_killed"]
    assert (chaos / "req.done").exists()


@pytest.fixture
def state_on_one_device():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = {"step": jnp.array(6, jnp.int32), "w": jnp.arange(8.0)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
    return state, abstract


class _Checkpoints:
    """A run's checkpoints with the newest committed one at `step` (None: none)."""

    def __init__(self, step):
        self.step = step

    def cleanup_partial(self):
        return []

    def latest_committed_step(self):
        return self.step

    def restore(self, abstract_state):
        state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_state)
        return type("Restored", (), {"state": state, "data_state": {"cursor": self.step}, "step": self.step})


@pytest.mark.parametrize("checkpoint_step, wins", [(None, True), (4, True), (6, True), (8, False)])
def test_the_snapshot_is_restored_unless_a_checkpoint_is_newer(state_on_one_device, checkpoint_step, wins):
    state, abstract = state_on_one_device
    snaps = HostSnapshots(EventLog(None))
    snaps.take(6, state, {"cursor": 6}, block=True)
    got = restore_state(
        abstract,
        checkpoints=_Checkpoints(checkpoint_step),
        snapshots=snaps,
        load_full_state_path="",
        load_parameters_path="",
        fresh_state=lambda params: pytest.fail("a saved state exists: nothing is initialised"),
    )
    if not wins:
        assert got.label == "checkpoint:8" and got.data_state == {"cursor": 8}
        return
    assert got.label == "snapshot:6" and got.data_state == {"cursor": 6}  # a tie goes to host RAM: the faster read
    np.testing.assert_array_equal(got.state["w"], np.arange(8.0))


@pytest.mark.parametrize(
    "snapshot, checkpoint, full, params, source",
    [
        (None, None, "", "", "init"),
        (None, None, "", "p", "load_parameters_path"),
        (None, None, "f", "p", "load_full_state_path"),
        (None, 3, "f", "p", "checkpoint"),
        (3, 3, "f", "p", "snapshot"),
        (2, 3, "", "", "checkpoint"),
        (5, None, "", "", "snapshot"),
    ],
)
def test_one_restore_order_for_every_source(snapshot, checkpoint, full, params, source):
    got = choose_source(
        snapshot_step=snapshot, checkpoint_step=checkpoint, load_full_state_path=full, load_parameters_path=params
    )
    assert got == source


@pytest.mark.parametrize(
    "snapshot, local, checkpoint, source",
    [
        (None, 7, 6, "local"),
        (None, 6, 6, "local"),  # a tie goes to the faster read
        (None, 5, 6, "checkpoint"),
        (7, 7, 6, "snapshot"),
        (6, 7, 6, "local"),
        (None, 7, None, "local"),
    ],
)
def test_the_local_tier_wins_when_it_is_the_newest(snapshot, local, checkpoint, source):
    got = choose_source(snapshot_step=snapshot, local_step=local, checkpoint_step=checkpoint)
    assert got == source


def test_a_retry_on_slices_seen_before_reuses_their_layout_and_builds_fresh_state(tmp_path, monkeypatch):
    from trainer.attempt import builder as attempt_module
    from trainer.attempt.builder import slice_set_key

    cfg = load_config(
        "base.yml",
        [
            *NANO_MODEL,
            "num_slices=2",
            "enable_checkpointing=false",
            f"base_output_directory={tmp_path}",
        ],
    )
    slices = group_into_slices(jax.devices()[:4], 2)
    log = []
    build = AttemptBuilder(train_spec(cfg), checkpoint_dir=tmp_path / "ckpt", events=_Events(log))
    first = build(slices)
    first.close()
    second = build(slices)
    second.close()
    assert log.count("compile_done") == 1 and log.count("compile_cached") == 1
    assert second.mesh is first.mesh and second.step_fn is first.step_fn
    assert second.iterator is not first.iterator, "stateful parts are never carried over"
    assert second.state["params"] is not first.state["params"]
    other = build(slices[:1])  # another slice set: its own mesh and executable
    other.close()
    assert other.mesh.size == 2 and log.count("compile_done") == 2 and len(build.layouts) == 2
    # The cache is bounded, least recently used out first: with room for two, a third slice set evicts
    # the full set (used before `other`), and the full set compiles again when it comes back.
    monkeypatch.setattr(attempt_module, "MAX_LAYOUTS", 2)
    build(slices[1:]).close()
    assert list(build.layouts) == [slice_set_key(slices[:1]), slice_set_key(slices[1:])]
    build(slices).close()
    assert log.count("compile_done") == 4


def _built_on_all_slices(tmp_path, num_slices: int):
    """(slices of 2 devices, event log, an AttemptBuilder that built one attempt on all of them)."""
    cfg = load_config("base.yml", [*NANO_MODEL, f"num_slices={num_slices}", "enable_checkpointing=false"])
    slices = group_into_slices(jax.devices()[: 2 * num_slices], num_slices)
    log = []
    build = AttemptBuilder(train_spec(cfg), checkpoint_dir=tmp_path / "ckpt", events=_Events(log))
    build(slices).close()
    return slices, log, build


def test_survivor_layouts_compiled_ahead_serve_the_first_resize_from_the_cache(tmp_path):
    slices, log, build = _built_on_all_slices(tmp_path, 2)
    done = build.compile_ahead([slices[:1], slices[1:]])
    resized = build(slices[1:])  # may come while the background compile runs: it waits, never compiles twice
    resized.close()
    done.result(timeout=600)
    assert log.count("compile_ahead") == 2 and log.count("compile_done") == 1
    assert log.count("compile_cached") == 1 and resized.mesh.size == 2
    build(slices[:1]).close()
    assert log.count("compile_cached") == 2
    build.close()


def test_an_attempt_on_survivors_moves_their_sets_ahead_of_those_with_the_lost_slice(tmp_path):
    import threading

    from trainer.attempt.builder import slice_set_key

    slices, log, build = _built_on_all_slices(tmp_path, 3)
    release, busy = threading.Event(), threading.Event()
    build.ahead.submit("busy", [], lambda: (busy.set(), release.wait(600)))  # hold the worker
    assert busy.wait(600)
    sets = [[slices[0], slices[1]], [slices[0], slices[2]], [slices[1], slices[2]]]
    done = build.compile_ahead(sets)
    keys = [slice_set_key(s) for s in sets]
    assert build.ahead.queued() == keys
    resized = []  # slice 0 lost: the attempt on slices 1 and 2 waits for their set, which goes first
    worker = threading.Thread(target=lambda: resized.append(build(sets[2])))
    worker.start()
    for _ in range(6000):
        if build.ahead.queued()[0] == keys[2]:
            break
        threading.Event().wait(0.01)
    assert build.ahead.queued() == [keys[2], keys[0], keys[1]]
    release.set()
    worker.join(600)
    resized[0].close()
    done.result(timeout=600)
    assert log.count("compile_cached") == 1 and log.count("compile_done") == 1
    assert log.count("compile_ahead") == 3
    build.close()


def test_a_snapshot_copies_each_distinct_shard_once_and_reassembles_the_global_arrays():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.elastic.snapshot import _distinct_shards

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))  # 2 replicas of 4 shards
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp")))
    b = jax.device_put(jnp.ones(3, jnp.bfloat16), NamedSharding(mesh, P()))
    assert len(_distinct_shards(w)) == 4 and len(_distinct_shards(b)) == 1
    state = {"step": jax.device_put(jnp.array(9, jnp.int32), NamedSharding(mesh, P())), "w": w, "b": b}
    snaps = HostSnapshots(EventLog(None))
    snaps.take(9, state, {}, block=False)
    jax.tree.map(lambda x: x.delete(), state)  # the next step donates the live state right away
    snaps.wait_for_copy()
    got = snaps.latest.state
    np.testing.assert_array_equal(got["w"], np.arange(64.0).reshape(8, 8))
    assert got["b"].dtype == jnp.bfloat16 and got["step"] == 9 and got["step"].shape == ()
