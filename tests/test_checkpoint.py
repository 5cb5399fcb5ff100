"""The checkpoint contract: what is committed, what is restored, and that failures are never silent.

Tiny pytrees on the 8 virtual CPU devices tests/conftest.py sets up. Faults are real storage states
(a directory that is a file, a truncated data file, a tmp dir a killed save leaves, a step without
its commit marker) or real save errors, not mocks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.checkpoint import (
    Checkpointer,
    CheckpointSaveError,
    is_committed,
    load_full_state,
    load_parameters,
    open_checkpointer,
    save_parameters,
)
from trainer.checkpoint.checkpointer import CheckpointRestoreTransient, RunStepsAllCorrupt
from trainer.checkpoint.compat import CheckpointMismatch
from trainer.checkpoint.fence import SaveFence
from trainer.config.schema import CheckpointConfig
from trainer.failures.storage import StorageFaults


def _cfg(**changes) -> CheckpointConfig:
    return dataclasses.replace(CheckpointConfig(), **{"checkpoint_period": 10, **changes})


def _mesh(shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), axes)


def _state(mesh: Mesh, spec: P, step: int = 7) -> dict:
    """{"step", "params", "opt_state"}, the matrices sharded over `mesh` by `spec`."""
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    w = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) + step
    return {
        "step": put(jnp.array(step, jnp.int32), P()),
        "params": {"w": put(w, spec), "b": put(jnp.ones(4, jnp.bfloat16), P())},
        "opt_state": {"mu": put(w * 0.5, spec)},
    }


def _abstract(state: dict, mesh: Mesh, spec: P) -> dict:
    """The same tree as ShapeDtypeStructs: matrices sharded by `spec` on `mesh`, the rest replicated."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, spec if x.ndim == 2 else P())
        ),
        state,
    )


def _assert_same(restored, expected) -> None:
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class Events(list):
    def __call__(self, name: str, fields: dict) -> None:
        self.append((name, fields))

    def named(self, name: str) -> list[dict]:
        return [fields for n, fields in self if n == name]


@pytest.fixture
def mesh4():
    return _mesh((4,), ("fsdp",))


@pytest.mark.parametrize("async_checkpointing", [True, False], ids=["async", "sync"])
def test_save_then_restore_returns_the_same_state_data_state_and_metadata(tmp_path, mesh4, async_checkpointing):
    events = Events()
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg(async_checkpointing=async_checkpointing), on_event=events)
    state = _state(mesh4, P("fsdp"))
    assert ckpt.save(7, state, {"position": 7, "epoch": 0}, {"config": {"steps": 9}, "mesh": {"fsdp": 4}})
    if not async_checkpointing:
        assert ckpt.committed_steps() == [7]  # a sync save returns once committed
    ckpt.wait()

    restored = Checkpointer(tmp_path / "ckpt", _cfg()).restore(_abstract(state, mesh4, P("fsdp")))

    assert ckpt.committed_steps() == [7] and restored.step == 7
    _assert_same(restored.state, state)
    assert restored.data_state == {"position": 7, "epoch": 0}
    assert restored.metadata == {"config": {"steps": 9}, "mesh": {"fsdp": 4}}
    assert restored.bytes == 32 * 4 * 2 + 4 * 2 + 4
    [committed] = events.named("checkpoint_save_committed")
    assert committed["step"] == 7 and committed["bytes"] == restored.bytes and committed["seconds"] >= 0
    ckpt.close()


def test_checkpoint_compression_is_a_choice_and_both_kinds_read_back_with_plain_orbax(tmp_path, mesh4):
    import orbax.checkpoint as ocp

    sharding = NamedSharding(mesh4, P("fsdp"))
    state = {"w": jax.device_put(jnp.zeros((1024, 64), jnp.float32), sharding)}  # zeros: very compressible
    sizes = {}
    for compression in (True, False):
        root = tmp_path / f"compression_{compression}"
        ckpt = Checkpointer(root, _cfg(checkpoint_compression=compression))
        ckpt.save(3, state, {}, {})
        ckpt.wait()
        ckpt.close()
        item = root / "3" / "state"
        sizes[compression] = sum(f.stat().st_size for f in item.rglob("*") if f.is_file())
        with ocp.StandardCheckpointer() as reader:  # the layout is plain Orbax: no trainer code needed
            _assert_same(reader.restore(item, _abstract(state, mesh4, P("fsdp"))), state)
    assert sizes[False] > 1024 * 64 * 4 > 10 * sizes[True], sizes


def test_an_async_save_no_longer_needs_the_device_arrays_once_save_returns(tmp_path, mesh4):
    """The train step donates the state right after save(): the save must not read it later."""
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg(async_checkpointing=True))
    state = _state(mesh4, P("fsdp"))
    expected = jax.tree.map(np.asarray, state)

    ckpt.save(7, state, {}, {})
    jax.tree.map(lambda x: x.delete(), state)
    ckpt.wait()

    _assert_same(ckpt.restore(_abstract(expected, mesh4, P("fsdp"))).state, expected)
    ckpt.close()


def test_restore_reshards_onto_meshes_of_other_sizes_and_axes(tmp_path, mesh4):
    state = _state(mesh4, P("fsdp"))
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg())
    ckpt.save(7, state, {}, {})
    ckpt.wait()

    for mesh, spec in [
        (_mesh((2,), ("data",)), P("data")),
        (_mesh((2,), ("data",)), P()),
        (_mesh((2, 2), ("fsdp", "tensor")), P("fsdp", "tensor")),
        (_mesh((2, 2), ("fsdp", "tensor")), P("tensor", "fsdp")),
    ]:
        abstract = _abstract(state, mesh, spec)
        restored = ckpt.restore(abstract)
        _assert_same(restored.state, state)
        assert jax.tree.map(lambda x: x.sharding, restored.state) == jax.tree.map(lambda x: x.sharding, abstract)
        params = load_parameters(tmp_path / "ckpt" / "7", abstract["params"])
        _assert_same(params, state["params"])
        assert params["w"].sharding == abstract["params"]["w"].sharding
    ckpt.close()


def test_cleanup_removes_its_own_partial_steps_leaves_other_tools_steps_and_restore_reads_neither(tmp_path, mesh4):
    events = Events()
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, _cfg(), on_event=events)
    abstract = _abstract(_state(mesh4, P("fsdp")), mesh4, P("fsdp"))
    assert ckpt.restore(abstract) is None
    for step in (10, 20, 30):
        ckpt.save(step, _state(mesh4, P("fsdp"), step), {"position": step}, {})
        ckpt.wait()
    # A save killed before its rename, older than the newest committed step:
    shutil.copytree(root / "10", root / "15.orbax-checkpoint-tmp")
    # the newest step, complete but for its commit marker, beside this trainer's in-flight marker (an
    # unfinished object-store save of ours):
    shutil.copytree(root / "30", root / "40")
    os.remove(root / "40" / "commit_success.txt")
    (root / "40.saving").write_text("0")
    # a save killed between writing the marker and the rename:
    shutil.copytree(root / "30", root / "50.orbax-checkpoint-tmp")
    # a marker-less step without our in-flight marker: another tool's, never removed here:
    shutil.copytree(root / "30", root / "60")
    os.remove(root / "60" / "commit_success.txt")

    assert ckpt.committed_steps() == [10, 20, 30] and ckpt.latest_committed_step() == 30
    assert ckpt.restore(abstract).data_state == {"position": 30}
    with pytest.raises(FileNotFoundError):
        ckpt.restore(abstract, step=40)

    removed = ckpt.cleanup_partial()

    expected = sorted(str(root / name) for name in ("15.orbax-checkpoint-tmp", "40", "50.orbax-checkpoint-tmp"))
    assert sorted(removed) == expected
    assert sorted(f["path"] for f in events.named("checkpoint_partial_removed")) == expected
    assert sorted(os.listdir(root)) == ["10", "20", "30", "60"]
    assert [f["path"] for f in events.named("checkpoint_foreign_step")] == [str(root / "60")]
    ckpt.close()


def _steps_10_and_20_with_20_corrupt(tmp_path, mesh4):
    """(checkpointer, its root, its events) after committing steps 10 and 20, then truncating 20's arrays."""
    events = Events()
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, _cfg(), on_event=events)
    for step in (10, 20):
        ckpt.save(step, _state(mesh4, P("fsdp"), step), {"position": step}, {})
        ckpt.wait()
    for data_dir in (root / "20" / "state").glob("**/d"):
        for chunk in data_dir.iterdir():
            chunk.write_bytes(chunk.read_bytes()[:3])
    return ckpt, root, events


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_committed_one(tmp_path, mesh4):
    ckpt, _, events = _steps_10_and_20_with_20_corrupt(tmp_path, mesh4)

    restored = ckpt.restore(_abstract(_state(mesh4, P("fsdp")), mesh4, P("fsdp")))

    assert restored.step == 10 and restored.data_state == {"position": 10}
    _assert_same(restored.state, _state(mesh4, P("fsdp"), 10))
    [failed] = events.named("checkpoint_restore_failed")
    assert failed["step"] == 20 and failed["error"]
    assert [f["step"] for f in events.named("checkpoint_restore_start")] == [20, 10]
    ckpt.close()


def test_an_unreadable_step_is_set_aside_and_saved_again_when_training_reaches_it(tmp_path, mesh4):
    ckpt, root, events = _steps_10_and_20_with_20_corrupt(tmp_path, mesh4)

    assert ckpt.restore(_abstract(_state(mesh4, P("fsdp")), mesh4, P("fsdp"))).step == 10
    [aside] = events.named("checkpoint_set_aside")
    assert aside["step"] == 20 and aside["reason"]
    assert aside["check"].startswith("truncated state/"), aside["check"]  # the failed check is named
    assert not (root / "20").exists() and Path(aside["path"]).is_dir(), "kept for inspection, not deleted"
    assert ckpt.committed_steps() == [10] and ckpt.cleanup_partial() == [], "neither a step nor a partial"
    # Training from step 10 reaches step 20 again: it is saved, not skipped as "already committed".
    assert ckpt.save(20, _state(mesh4, P("fsdp"), 20), {"position": 20}, {})
    ckpt.wait()
    again = ckpt.restore(_abstract(_state(mesh4, P("fsdp")), mesh4, P("fsdp")))
    assert again.step == 20 and again.data_state == {"position": 20}
    _assert_same(again.state, _state(mesh4, P("fsdp"), 20))
    ckpt.close()


def _steps_10_and_20(root, mesh4, **kwargs) -> tuple[Checkpointer, Events]:
    events = Events()
    ckpt = Checkpointer(root, _cfg(), on_event=events, sleep=lambda s: None, **kwargs)
    for step in (10, 20):
        ckpt.save(step, _state(mesh4, P("fsdp"), step), {"position": step}, {})
        ckpt.wait()
    return ckpt, events


def test_a_transient_read_error_is_retried_and_changes_nothing_on_storage(tmp_path, mesh4):
    root = tmp_path / "ckpt"
    ckpt, events = _steps_10_and_20(root, mesh4, storage_faults=StorageFaults(restore=1))

    restored = ckpt.restore(_abstract(_state(mesh4, P("fsdp")), mesh4, P("fsdp")))

    assert restored.step == 20, "the newest step, read again: a storage blip is not corruption"
    [failed] = events.named("checkpoint_restore_failed")
    assert failed["step"] == 20 and failed["transient"] and "injected" in failed["error"]
    assert not events.named("checkpoint_set_aside") and sorted(os.listdir(root)) == ["10", "20"]
    ckpt.close()


def test_a_read_error_that_outlasts_the_retries_exits_transient_with_every_step_in_place(tmp_path, mesh4):
    root = tmp_path / "ckpt"
    ckpt, events = _steps_10_and_20(root, mesh4, storage_faults=StorageFaults(restore=10))

    with pytest.raises(CheckpointRestoreTransient, match="nothing was changed"):
        ckpt.restore(_abstract(_state(mesh4, P("fsdp")), mesh4, P("fsdp")))

    assert [f["step"] for f in events.named("checkpoint_restore_failed")] == [20, 20, 20]
    assert sorted(os.listdir(root)) == ["10", "20"], "no step renamed, none fallen back from"
    ckpt.close()


def test_a_tree_that_does_not_fit_the_config_raises_a_mismatch_naming_the_leaves_and_changes_nothing(
    tmp_path, mesh4
):
    root = tmp_path / "ckpt"
    ckpt, events = _steps_10_and_20(root, mesh4)
    other = _state(mesh4, P("fsdp"))
    other["opt_state"] = {"mu": other["opt_state"]["mu"], "nu": other["opt_state"]["mu"]}  # another optimizer

    with pytest.raises(CheckpointMismatch, match="opt_state: 1 only in this config \\(opt_state/nu\\)"):
        ckpt.restore(_abstract(other, mesh4, P("fsdp")))

    assert not events.named("checkpoint_set_aside") and sorted(os.listdir(root)) == ["10", "20"]
    ckpt.close()


def test_when_every_step_fails_verification_the_run_is_not_restarted_from_scratch(tmp_path, mesh4):
    root = tmp_path / "ckpt"
    ckpt, events = _steps_10_and_20(root, mesh4)
    for chunk in (root / "10" / "state").glob("**/d/*"):
        chunk.unlink()  # step 10 loses its array files, step 20 its array bytes
    for chunk in (root / "20" / "state").glob("**/d/*"):
        chunk.write_bytes(chunk.read_bytes()[:3])

    with pytest.raises(RunStepsAllCorrupt, match="20 \\(truncated .*10 \\(missing file"):
        ckpt.restore(_abstract(_state(mesh4, P("fsdp")), mesh4, P("fsdp")))

    assert [a["step"] for a in events.named("checkpoint_set_aside")] == [20, 10]
    ckpt.close()


def test_a_save_of_an_older_attempt_is_fenced_and_never_commits(tmp_path, mesh4):
    fence = SaveFence()
    events = Events()
    old = Checkpointer(tmp_path / "ckpt", _cfg(async_checkpointing=False), on_event=events, fence=fence)
    newer = Checkpointer(tmp_path / "ckpt", _cfg(), fence=fence)  # the next attempt: the fence advances

    with pytest.raises(CheckpointSaveError):
        old.save(10, _state(mesh4, P("fsdp")), {}, {})

    assert [f["step"] for f in events.named("checkpoint_save_fenced")] == [10]
    assert old.committed_steps() == [] and newer.cleanup_partial(), "left as a partial, removed by cleanup"
    assert sorted(os.listdir(tmp_path / "ckpt")) == []
    assert newer.save(10, _state(mesh4, P("fsdp")), {}, {})
    newer.wait()
    assert newer.committed_steps() == [10]
    old.close()
    newer.close()


def test_every_committed_step_records_its_files_for_verification(tmp_path, mesh4):
    from trainer.checkpoint.verify import FILES, verify_step

    root = tmp_path / "ckpt"
    ckpt, _ = _steps_10_and_20(root, mesh4)
    ckpt.close()

    assert verify_step(root / "20") is None and (root / "20" / FILES).is_file()
    [chunk] = list((root / "20" / "state").glob("**/d/*"))[:1]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF  # one bit flipped, size unchanged
    chunk.write_bytes(bytes(data))
    assert verify_step(root / "20") == f"checksum mismatch {chunk.relative_to(root / '20').as_posix()}"


def test_a_save_to_broken_storage_raises_and_a_later_save_to_a_healthy_directory_commits(tmp_path, mesh4):
    events = Events()
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, _cfg(), on_event=events)
    ckpt.save(10, _state(mesh4, P("fsdp")), {}, {})
    ckpt.wait()
    os.rename(root, tmp_path / "moved")
    root.write_text("not a directory")  # every write under root now fails

    with pytest.raises(CheckpointSaveError) as raised:
        ckpt.save(20, _state(mesh4, P("fsdp")), {}, {})
        ckpt.wait()

    assert raised.value.step == 20 and isinstance(raised.value.__cause__, OSError)
    assert [f["step"] for f in events.named("checkpoint_save_failed")] == [20]
    root.unlink()
    os.rename(tmp_path / "moved", root)
    assert ckpt.save(30, _state(mesh4, P("fsdp")), {}, {})
    ckpt.wait()
    assert ckpt.committed_steps() == [10, 30]
    ckpt.close()


def test_a_background_save_failure_raises_from_wait_or_the_next_save_and_saving_then_resumes(tmp_path, mesh4):
    events = Events()
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg(async_checkpointing=True), on_event=events)
    unwritable = {"position": object()}  # fails in Orbax's background writer, as a storage error would

    assert ckpt.save(10, _state(mesh4, P("fsdp")), unwritable, {})
    with pytest.raises(CheckpointSaveError) as raised:
        ckpt.wait()
    assert raised.value.step == 10
    assert ckpt.save(20, _state(mesh4, P("fsdp")), {}, {})

    assert ckpt.save(30, _state(mesh4, P("fsdp")), unwritable, {})
    with pytest.raises(CheckpointSaveError) as raised:
        ckpt.save(40, _state(mesh4, P("fsdp")), {}, {})
    assert raised.value.step == 30
    assert ckpt.save(40, _state(mesh4, P("fsdp")), {}, {})
    ckpt.wait()

    assert ckpt.committed_steps() == [20, 40]
    assert [f["step"] for f in events.named("checkpoint_save_failed")] == [10, 30]
    assert [f["step"] for f in events.named("checkpoint_save_committed")] == [20, 40]
    assert ckpt.latest_committed_step() == 40  # the failed steps' tmp dirs are partial, never listed
    ckpt.close()


def test_close_reports_a_failed_background_save_without_raising_and_is_idempotent(tmp_path, mesh4):
    events = Events()
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg(async_checkpointing=True), on_event=events)
    ckpt.save(10, _state(mesh4, P("fsdp")), {"position": object()}, {})

    ckpt.close(timeout_s=30)
    ckpt.close()

    assert [f["step"] for f in events.named("checkpoint_save_failed")] == [10]


def test_should_save_on_the_period_and_on_the_final_step_only(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg(checkpoint_period=10))
    off = open_checkpointer(tmp_path / "off", _cfg(enable_checkpointing=False))

    assert [s for s in range(1, 31) if ckpt.should_save(s, final=False)] == [10, 20, 30]
    assert ckpt.should_save(13, final=True)
    assert not off.should_save(10, final=False) and not off.should_save(13, final=True)
    ckpt.close()
    off.close()


def test_continuous_mode_saves_as_soon_as_the_previous_save_has_finished(tmp_path, mesh4):
    continuous = Checkpointer(tmp_path / "c", _cfg(checkpoint_period=1000, enable_continuous_checkpointing=True))
    periodic = Checkpointer(tmp_path / "p", _cfg(checkpoint_period=1000))
    for ckpt in (continuous, periodic):
        assert ckpt.save(1, _state(mesh4, P("fsdp")), {}, {})
        ckpt.wait()

    assert continuous.should_save(2, final=False)
    assert not periodic.should_save(2, final=False)
    continuous.close()
    periodic.close()


@pytest.mark.parametrize("keep, expected", [(2, [3, 4]), (0, [1, 2, 3, 4])])
def test_retention_keeps_the_newest_max_num_checkpoints_to_keep(tmp_path, mesh4, keep, expected):
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg(max_num_checkpoints_to_keep=keep))
    for step in (1, 2, 3, 4):
        ckpt.save(step, _state(mesh4, P("fsdp")), {}, {})
        ckpt.wait()

    assert ckpt.committed_steps() == expected
    assert sorted(os.listdir(tmp_path / "ckpt")) == [str(s) for s in expected]
    ckpt.close()


def test_load_parameters_reads_a_params_only_checkpoint_onto_another_mesh(tmp_path, mesh4):
    params = _state(mesh4, P("fsdp"))["params"]
    save_parameters(tmp_path / "params", params)
    mesh = _mesh((2, 2), ("fsdp", "tensor"))
    abstract = _abstract(params, mesh, P("tensor", "fsdp"))

    loaded = load_parameters(tmp_path / "params", abstract)

    assert is_committed(tmp_path / "params")
    _assert_same(loaded, params)
    assert loaded["w"].sharding == abstract["w"].sharding


def test_load_full_state_reads_a_step_directory_and_refuses_a_partial_one(tmp_path, mesh4):
    state = _state(mesh4, P("fsdp"))
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg())
    ckpt.save(7, state, {}, {})
    ckpt.close()
    abstract = _abstract(state, _mesh((2,), ("data",)), P("data"))

    _assert_same(load_full_state(tmp_path / "ckpt" / "7", abstract), state)
    os.remove(tmp_path / "ckpt" / "7" / "commit_success.txt")
    with pytest.raises(FileNotFoundError):
        load_full_state(tmp_path / "ckpt" / "7", abstract)


def test_an_orbax_tmp_directory_is_never_committed_even_with_every_file_and_the_marker(tmp_path, mesh4):
    """A save killed after Orbax wrote the commit marker but before its rename leaves a tmp directory
    that looks complete: it is not committed, and neither load path reads it (directory scans filter
    the name out before asking; a path given by hand does not)."""
    state = _state(mesh4, P("fsdp"))
    ckpt = Checkpointer(tmp_path / "ckpt", _cfg())
    ckpt.save(7, state, {}, {})
    ckpt.close()
    save_parameters(tmp_path / "params", state["params"])
    step_tmp = tmp_path / "ckpt" / "9.orbax-checkpoint-tmp"
    params_tmp = tmp_path / "params.orbax-checkpoint-tmp-1234"
    shutil.copytree(tmp_path / "ckpt" / "7", step_tmp)
    shutil.copytree(tmp_path / "params", params_tmp)
    assert (step_tmp / "commit_success.txt").exists() and (params_tmp / "commit_success.txt").exists()

    assert not is_committed(step_tmp) and not is_committed(params_tmp)
    abstract = _abstract(state, mesh4, P("fsdp"))
    with pytest.raises(FileNotFoundError, match="not a committed checkpoint"):
        load_full_state(step_tmp, abstract)
    with pytest.raises(FileNotFoundError, match="not a committed checkpoint"):
        load_parameters(params_tmp, abstract["params"])


def test_asking_whether_a_save_is_in_progress_never_hangs_on_a_save_stuck_in_a_barrier():
    """With several processes Orbax's flag waits on a lock its finalize thread holds inside a barrier for
    every process; a dead peer keeps it there. The question gets an answer, or None, in bounded time."""
    import threading

    from trainer.checkpoint.checkpointer import _saving_in_progress

    stuck = threading.Event()

    class Manager:
        def __init__(self, blocked):
            self.blocked = blocked

        def is_saving_in_progress(self):
            if self.blocked:
                stuck.wait(60)
            return False

    assert _saving_in_progress(Manager(False), 5.0) is False
    assert _saving_in_progress(Manager(True), 0.2) is None
    stuck.set()
