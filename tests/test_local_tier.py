"""The local checkpoint tier: host snapshots written to node-local disk and read back by a new process."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.attempt.restore import LocalStepsAllUnusable, restore_state
from trainer.checkpoint.local_store import LocalStepUnusable, LocalStore, committed_steps
from trainer.elastic.pinned_snapshots import PinnedSnapshots
from trainer.elastic.snapshot import HostSnapshots
from trainer.errors import EXIT_BAD_INPUT, exit_code_for
from trainer.observe.events import EventLog
from trainer.observe.sinks import RecordedSteps


class _Events:
    def __init__(self):
        self.seen = []

    def emit(self, name, **fields):
        self.seen.append((name, fields))

    def names(self):
        return [n for n, _ in self.seen]


def _state(step: int):
    """A small train-state-like tree with the dtypes a real one has (bfloat16, float32, int32 scalar)."""
    return {
        "step": jnp.array(step, jnp.int32),
        "params": {"w": jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) * step, "b": jnp.ones(5, jnp.bfloat16)},
    }


def _abstract(state):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def _host(state):
    return jax.tree.map(np.asarray, state)


def test_a_written_step_reads_back_bitwise_with_its_data_state(tmp_path):
    store = LocalStore(tmp_path, keep=2, events=_Events(), config={"base_emb_dim": 8})
    state = _state(7)
    store.write(7, _host(state), {"cursor": 7})
    got, data = store.read(7, _abstract(state))
    assert data == {"cursor": 7}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).tobytes(), np.asarray(b).tobytes())


def test_a_partial_write_never_counts_and_is_removed(tmp_path):
    events = _Events()
    store = LocalStore(tmp_path, keep=2, events=events)
    store.write(5, _host(_state(5)), {})
    (tmp_path / "10.partial-999").mkdir()  # a write killed half-way
    (tmp_path / "10.partial-999" / "state.bin").write_bytes(b"\0" * 10)
    assert committed_steps(tmp_path) == [5]
    assert store.cleanup_partial() == ["10.partial-999"]
    assert not (tmp_path / "10.partial-999").exists()
    assert "local_checkpoint_partial_removed" in events.names()


def test_a_write_killed_just_before_its_commit_rename_never_counts_and_is_removed(tmp_path):
    """The partial holds everything a committed step does (payload and manifest): only the rename commits."""
    events = _Events()
    store = LocalStore(tmp_path, keep=2, events=events)
    store.write(5, _host(_state(5)), {"cursor": 5})
    store.write(10, _host(_state(10)), {"cursor": 10})
    (tmp_path / "10").rename(tmp_path / "15.partial-999")  # complete, but never renamed to "15"
    (tmp_path / "15.partial-999" / "manifest.json").write_text(
        (tmp_path / "15.partial-999" / "manifest.json").read_text().replace('"step": 10', '"step": 15')
    )
    assert committed_steps(tmp_path) == [5] and store.newest_step() == 5
    assert store.cleanup_partial() == ["15.partial-999"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5"]
    assert "local_checkpoint_partial_removed" in events.names()


def test_only_the_newest_steps_are_kept(tmp_path):
    store = LocalStore(tmp_path, keep=2, events=_Events())
    for step in (5, 10, 15, 20):
        store.write(step, _host(_state(step)), {})
    assert committed_steps(tmp_path) == [15, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["15", "20"]


def test_a_truncated_or_foreign_step_is_unusable(tmp_path):
    store = LocalStore(tmp_path, keep=3, events=_Events())
    state = _state(5)
    store.write(5, _host(state), {})
    other = {"step": state["step"], "params": {"w": jnp.zeros((3, 4))}}  # another model's leaves
    with pytest.raises(LocalStepUnusable, match="another train state"):
        store.read(5, _abstract(other))
    wider = {"step": state["step"], "params": {"b": state["params"]["b"], "w": jnp.zeros((3, 5))}}
    with pytest.raises(LocalStepUnusable, match="expects"):
        store.read(5, _abstract(wider))
    payload = tmp_path / "5" / "state.bin"
    payload.write_bytes(payload.read_bytes()[:-3])
    with pytest.raises(LocalStepUnusable, match="bytes"):
        store.read(5, _abstract(state))


def _restore(snaps, abstract, checkpoint_step=None):
    class Checkpoints:
        def cleanup_partial(self):
            return []

        def latest_committed_step(self):
            return checkpoint_step

        def restore(self, abstract_state):
            state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_state)
            return type("R", (), {"state": state, "data_state": {"cursor": -1}, "step": checkpoint_step})

    return restore_state(
        abstract,
        checkpoints=Checkpoints(),
        snapshots=snaps,
        load_full_state_path="",
        load_parameters_path="",
        fresh_state=lambda params: pytest.fail("a saved state exists"),
    )


def test_a_persisted_snapshot_is_what_a_new_process_restores(tmp_path):
    events = EventLog(None)
    first = HostSnapshots(events, store=LocalStore(tmp_path, keep=2, events=events))
    first.take(4, _state(4), {"cursor": 4}, block=True)  # RAM only
    first.take(6, _state(6), {"cursor": 6}, block=True, persist=True)
    assert committed_steps(tmp_path) == [6]
    # The process is gone; a new one starts with an empty RAM and the same local directory.
    fresh = HostSnapshots(events, store=LocalStore(tmp_path, keep=2, events=events))
    got = _restore(fresh, _abstract(_state(0)))
    assert got.label == "local:6" and got.data_state == {"cursor": 6}
    np.testing.assert_array_equal(got.state["params"]["w"], np.asarray(_state(6)["params"]["w"]))


@pytest.mark.parametrize("checkpoint_step, label", [(None, "local:6"), (6, "local:6"), (8, "checkpoint:8")])
def test_the_local_step_wins_unless_a_checkpoint_is_newer(tmp_path, checkpoint_step, label):
    events = EventLog(None)
    HostSnapshots(events, store=LocalStore(tmp_path, keep=2, events=events)).take(
        6, _state(6), {"cursor": 6}, block=True, persist=True
    )
    fresh = HostSnapshots(events, store=LocalStore(tmp_path, keep=2, events=events))
    assert _restore(fresh, _abstract(_state(0)), checkpoint_step).label == label


def test_ram_beats_the_local_tier_at_the_same_step_and_an_unusable_step_falls_back(tmp_path):
    events = _Events()
    store = LocalStore(tmp_path, keep=3, events=events)
    snaps = HostSnapshots(events, store=store)
    snaps.take(5, _state(5), {"cursor": 5}, block=True, persist=True)
    snaps.take(10, _state(10), {"cursor": 10}, block=True, persist=True)
    assert _restore(snaps, _abstract(_state(0))).label == "snapshot:10"  # RAM holds it: no disk read
    (tmp_path / "10" / "state.bin").write_bytes(b"")  # the newest local step is damaged
    fresh = HostSnapshots(events, store=store)
    got = _restore(fresh, _abstract(_state(0)))
    assert got.label == "local:5" and got.data_state == {"cursor": 5}
    skipped = [f for n, f in events.seen if n == "local_checkpoint_skipped"]
    assert skipped and skipped[0]["step"] == 10


def test_a_local_step_restores_onto_another_mesh(tmp_path):
    """Saved from one device, restored sharded over four (a resize, or a restart on another mesh)."""
    events = EventLog(None)
    HostSnapshots(events, store=LocalStore(tmp_path, keep=2, events=events)).take(
        6, _state(6), {"cursor": 6}, block=True, persist=True
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    spec = {"step": jax.sharding.PartitionSpec(), "params": {"w": jax.sharding.PartitionSpec(None, "fsdp")}}
    spec["params"]["b"] = jax.sharding.PartitionSpec()
    abstract = jax.tree.map(
        lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, p)),
        _state(0),
        spec,
    )
    got = _restore(HostSnapshots(events, store=LocalStore(tmp_path, keep=2, events=events)), abstract)
    assert got.label == "local:6"
    w = got.state["params"]["w"]
    assert w.sharding == abstract["params"]["w"].sharding and len(w.addressable_shards) == 4
    np.testing.assert_array_equal(np.asarray(w), np.asarray(_state(6)["params"]["w"]))


@pytest.mark.parametrize("checkpoint_step", [None, 3])
def test_a_run_whose_local_steps_are_all_unusable_is_not_restarted_from_scratch(tmp_path, checkpoint_step):
    """Every local step damaged and no other saved state: a clear error (exit 2), never a silent start from
    init (a persistent tier whose steps are all corrupt is refused alike); an older checkpoint still serves."""
    events = _Events()
    store = LocalStore(tmp_path, keep=3, events=events)
    snaps = HostSnapshots(events, store=store)
    for step in (5, 10):
        snaps.take(step, _state(step), {"cursor": step}, block=True, persist=True)
        (tmp_path / str(step) / "state.bin").write_bytes(b"")  # a corrupt payload
    fresh = HostSnapshots(events, store=store)  # a new process: nothing in RAM
    if checkpoint_step is not None:
        assert _restore(fresh, _abstract(_state(0)), checkpoint_step).label == "checkpoint:3"
    else:
        with pytest.raises(LocalStepsAllUnusable, match=r"5, 10.*not restarted from scratch") as raised:
            _restore(fresh, _abstract(_state(0)))
        assert exit_code_for(raised.value) == EXIT_BAD_INPUT
    assert [f["step"] for n, f in events.seen if n == "local_checkpoint_skipped"] == [10, 5]
    assert committed_steps(tmp_path) == [5, 10]  # nothing is deleted: they stay for inspection


def _on_mesh(state):
    """`state` on a one-device mesh (a pinned snapshot splits its state along a mesh axis)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    return jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


@pytest.mark.parametrize("kind", [HostSnapshots, PinnedSnapshots])
def test_the_emergency_write_of_a_snapshot_without_its_metrics_row_writes_nothing_and_says_why_at_once(
    tmp_path, kind
):
    """A hang stops the loop before it writes the newest snapshot's row: the emergency write does not wait
    for it (a local step must have its row), reports the snapshot it left unwritten, and writes nothing."""
    events, recorded = _Events(), RecordedSteps()
    store = LocalStore(tmp_path, keep=3, events=events, recorded=recorded)
    snaps = kind(events, store=store)
    snaps.attempt_started()
    recorded.write({"step": 5})
    snaps.take(5, _on_mesh(_state(5)), {"cursor": 5}, block=True, persist=True)
    recorded.write({"step": 6})
    snaps.take(7, _on_mesh(_state(7)), {"cursor": 7}, block=True)  # RAM only; row 7 is never written

    def persist():
        got = []
        saver = threading.Thread(target=lambda: got.append(snaps.persist_latest()), daemon=True)
        started = time.monotonic()
        saver.start()
        saver.join(timeout=10)
        assert not saver.is_alive(), "the emergency write waits for a metrics row"
        return got[0], time.monotonic() - started

    before = len(events.seen)
    try:
        written, seconds = persist()
    finally:
        snaps.attempt_ended()  # a waiting write (the defect) gives up, so the test ends
    assert written is None and seconds < 5
    assert committed_steps(tmp_path) == [5] and not list(tmp_path.glob("*.partial-*"))
    ((name, fields),) = events.seen[before:]  # no local_checkpoint_save_start: nothing was written
    assert name == "local_checkpoint_save_failed" and fields["step"] == 7
    assert "metrics row" in fields["error"] and "local step 5" in fields["error"]

    snaps.attempt_started()  # with its row written, the same write goes through
    recorded.write({"step": 7})
    assert persist()[0] == 7
    assert committed_steps(tmp_path) == [5, 7] and events.names()[-1] == "local_checkpoint_save_committed"
