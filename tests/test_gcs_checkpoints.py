"""Checkpoints on gs:// against a real GCS JSON API (fake-gcs-server, tests/gcs_server.py).

Orbax writes arrays with tensorstore's `gcs` driver and manages directories through etils epath
(gcsfs); both reach the server through environment variables only. On an object store Orbax renames
nothing: it writes into `<step>/` and commits by writing `<step>/commit_success.txt` last
(trainer/checkpoint/commit.py). What the bucket holds is read back with the plain JSON API, not with the
clients under test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_harness import MICRO, cli_env, pod_env, pod_mirror
from gcs_server import PreconditionFailed

from trainer.checkpoint.commit import COMMIT_MARKER, committed_steps


@pytest.fixture
def gcs(gcs_server):
    """The server, with this process pointed at it for the test (environment restored afterwards)."""
    with gcs_server.applied():
        yield gcs_server


def _committed_in_bucket(server, bucket: str, checkpoints: str) -> list[int]:
    """Steps whose top-level commit marker is in the bucket, read with the JSON API."""
    steps = []
    for name in server.names(bucket, checkpoints.rstrip("/") + "/"):
        step, _, rest = name[len(checkpoints.rstrip("/")) + 1 :].partition("/")
        if step.isdigit() and rest == COMMIT_MARKER:
            steps.append(int(step))
    return sorted(steps)


def _state(step: int) -> dict:
    import jax.numpy as jnp

    return {
        "params": {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * step, "b": jnp.full((4,), step * 0.5)},
        "opt": {"count": jnp.asarray(step, dtype=jnp.int32)},
    }


def test_orbax_saves_commits_restores_and_retains_on_gs(gcs):
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    bucket = gcs.new_bucket("orbax")
    root = f"gs://{bucket}/run/checkpoints"
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    items = ("state", "meta")
    with ocp.CheckpointManager(root, options=options, item_names=items) as mgr:
        for step in (1, 2, 3):
            mgr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(_state(step)), meta=ocp.args.JsonSave({"step": step})
                ),
            )
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3

    # In the bucket: steps 2 and 3 committed (marker written into <step>/, no tmp directory), step 1
    # deleted by retention, the arrays in OCDBT.
    names = gcs.names(bucket, "run/checkpoints/")
    assert _committed_in_bucket(gcs, bucket, "run/checkpoints") == [2, 3]
    assert not [n for n in names if n.startswith("run/checkpoints/1/")], "retention left step 1 behind"
    assert not [n for n in names if ".orbax-checkpoint-tmp" in n]
    for step in (2, 3):
        assert f"run/checkpoints/{step}/state/manifest.ocdbt" in names
        assert f"run/checkpoints/{step}/state/{COMMIT_MARKER}" in names
        assert json.loads(gcs.read(bucket, f"run/checkpoints/{step}/meta/metadata")) == {"step": step}
    assert committed_steps(root) == [2, 3]  # the trainer's commit rule, through epath

    # A fresh manager (another process, in effect) finds them and restores the newest.
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(0))
    with ocp.CheckpointManager(root, options=options, item_names=items) as mgr:
        assert mgr.all_steps() == [2, 3] and mgr.latest_step() == 3
        restored = mgr.restore(
            3, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(abstract), meta=ocp.args.JsonRestore())
        )
    assert restored["meta"] == {"step": 3}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored["state"]), jax.device_get(_state(3)))

    # An unfinished save (data, no marker) is not committed, for the trainer and for Orbax. (Written
    # through epath: gcsfs does not see what another client adds to a prefix it has listed, see below.)
    ckpts = epath.Path(root)
    (ckpts / "4" / "state" / "_METADATA").write_text("{}")
    assert gcs.names(bucket, "run/checkpoints/4/") == ["run/checkpoints/4/state/_METADATA"]
    assert committed_steps(root) == [2, 3]
    with ocp.CheckpointManager(root, options=options, item_names=items) as mgr:
        assert mgr.all_steps() == [2, 3]

    # Listing and deleting through etils epath (gcsfs).
    assert ckpts.is_dir() and sorted(p.name for p in ckpts.iterdir()) == ["2", "3", "4"]
    assert (ckpts / "3" / COMMIT_MARKER).exists()
    (ckpts / "4").rmtree()
    (ckpts / "2").rmtree()
    assert gcs.names(bucket, "run/checkpoints/4/") == [] and gcs.names(bucket, "run/checkpoints/2/") == []
    assert sorted(p.name for p in ckpts.iterdir()) == ["3"]
    with ocp.CheckpointManager(root, options=options, item_names=items) as mgr:
        assert mgr.all_steps() == [3]


def test_a_listing_sees_a_step_another_process_committed(gcs):
    import trainer.io.paths  # noqa: F401 - the trainer's one path layer, where gcsfs would be configured

    bucket = gcs.new_bucket("listing")
    root = f"gs://{bucket}/checkpoints"
    gcs.write(bucket, f"checkpoints/3/{COMMIT_MARKER}", b"")
    assert committed_steps(root) == [3]
    gcs.write(bucket, f"checkpoints/6/{COMMIT_MARKER}", b"")  # another host finishes a save
    assert committed_steps(root) == [3, 6]


def test_generations_and_create_only_writes(gcs):
    """What a lease on the bucket can build on: generations grow, ifGenerationMatch=0 creates only once,
    a stale generation is refused (JSON API and gcsfs' mode='create')."""
    import fsspec

    bucket = gcs.new_bucket("lease")
    first = gcs.create_only(bucket, "lease", b"a")
    assert first is not None and gcs.create_only(bucket, "lease", b"b") is None
    assert gcs.read(bucket, "lease") == b"a"
    second = gcs.write(bucket, "lease", b"c", if_generation_match=first)
    assert second > first and gcs.stat(bucket, "lease").generation == second
    with pytest.raises(PreconditionFailed):
        gcs.write(bucket, "lease", b"d", if_generation_match=first)
    assert gcs.read(bucket, "lease") == b"c"
    assert [(o.name, o.size) for o in gcs.list_objects(bucket)] == [("lease", 1)]

    fs = fsspec.filesystem("gs")
    fs.pipe_file(f"{bucket}/other", b"x", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{bucket}/other", b"y", mode="create")
    assert gcs.read(bucket, "other") == b"x"
    assert gcs.delete(bucket, "other") and not gcs.delete(bucket, "other")


def _train(server, tmp_path: Path, pod: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI on one pod (its own local mirror and cache), reaching gs:// through the server."""
    env = pod_env(server, tmp_path, pod)
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", "base.yml", *MICRO, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_the_cli_checkpoints_to_gs_and_a_fresh_pod_resumes_from_the_bucket(gcs_server, tmp_path):
    bucket = gcs_server.new_bucket("cli")
    args = [
        f"base_output_directory=gs://{bucket}/runs",
        "run_name=gcs",
        "checkpoint_period=3",
        "max_target_length=128",
    ]
    run_dir = f"gs://{bucket}/runs/gcs"

    first = _train(gcs_server, tmp_path, "pod-a", "steps=6", *args)
    assert first.stdout.strip().splitlines()[-1] == f"STATUS: finished step=6 trained=6 run_dir={run_dir}", (
        first.stderr[-3000:]
    )
    assert "(new run;" in first.stdout
    assert _committed_in_bucket(gcs_server, bucket, "runs/gcs/checkpoints") == [3, 6]

    # Another node (an empty local mirror): the checkpoint and the logs come from the bucket.
    second = _train(gcs_server, tmp_path, "pod-b", "steps=9", *args)
    assert second.stdout.strip().splitlines()[-1] == f"STATUS: finished step=9 trained=3 run_dir={run_dir}", (
        second.stderr[-3000:]
    )
    assert "(resuming from step 6;" in second.stdout
    assert _committed_in_bucket(gcs_server, bucket, "runs/gcs/checkpoints") == [3, 6, 9]
    names = gcs_server.names(bucket, "runs/gcs/")
    assert not [n for n in names if ".orbax-checkpoint-tmp" in n]
    metrics = [json.loads(line) for line in gcs_server.read(bucket, "runs/gcs/metrics.jsonl").splitlines()]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def _params_in(server, run_dir: str) -> dict:
    """The newest committed step's parameters, read with Orbax alone through the server."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    with server.applied():
        root = epath.Path(run_dir) / "checkpoints"
        step = max(committed_steps(root))
        with ocp.PyTreeCheckpointer() as ckptr:
            tree = ckptr.restore(root / str(step) / "state")
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree["params"])}


RUN = ["steps=12", "checkpoint_period=2", "max_num_checkpoints_to_keep=2"]


@pytest.mark.slow
def test_a_gs_run_killed_mid_save_resumes_bitwise_and_cleans_up_only_its_own_partial_step(gcs_server, tmp_path):
    import signal
    import time

    from cli_harness import killed_during

    bucket = gcs_server.new_bucket("kill")
    base = tmp_path / "local"
    solo = subprocess.run(
        [sys.executable, "-m", "trainer.train", "base.yml", *MICRO, *RUN, f"base_output_directory={base}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=cli_env(1),
        timeout=300,
    )
    assert solo.returncode == 0, solo.stderr[-3000:]
    run_dir = f"gs://{bucket}/runs/k"
    args = [*MICRO, *RUN, f"base_output_directory=gs://{bucket}/runs", "run_name=k"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.train", "base.yml", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=pod_env(gcs_server, tmp_path, "pod"),
    )
    try:
        deadline = time.time() + 300  # a hang guard, not a speed claim
        while time.time() < deadline and proc.poll() is None:
            names = gcs_server.names(bucket, "runs/k/checkpoints/")
            committed = _committed_in_bucket(gcs_server, bucket, "runs/k/checkpoints")
            saving = {int(n.rsplit("/", 1)[1].split(".")[0]) for n in names if n.endswith(".saving")}
            if committed and saving - set(committed):
                proc.send_signal(signal.SIGKILL)  # a save is in flight: marked, not committed
                break
            time.sleep(0.005)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before a save was caught in flight"
    in_flight = killed_during(
        pod_mirror(tmp_path, "pod", run_dir), proc.pid, "checkpoint_save_start", "checkpoint_save_committed"
    )
    assert in_flight["step"] in saving - set(committed)

    again = subprocess.run(
        [sys.executable, "-m", "trainer.train", "base.yml", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=pod_env(gcs_server, tmp_path, "pod"),
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert _committed_in_bucket(gcs_server, bucket, "runs/k/checkpoints") == [10, 12], "retention: the newest two"
    names = gcs_server.names(bucket, "runs/k/checkpoints/")
    assert not [n for n in names if n.endswith(".saving")], "every save committed: no in-flight marker left"
    assert all(n.split("/")[3].isdigit() for n in names), names
    a, b = _params_in(gcs_server, run_dir), _params_in(gcs_server, str(base / "qwen3-tiny-synthetic"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), "bitwise the uninterrupted run"
    lease = [n for n in gcs_server.names(bucket, "runs/k/lease/")]
    assert lease == ["runs/k/lease/1.json", "runs/k/lease/2.json"], lease
    taken = [e for e in _events(tmp_path, "pod", run_dir) if e["event"] == "lease_acquired"]
    assert taken[-1]["taken_over"] == "owner_process_gone", taken


def _events(tmp_path: Path, pod: str, run_dir: str) -> list[dict]:
    text = (pod_mirror(tmp_path, pod, run_dir) / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.slow
def test_on_gs_a_damaged_step_is_set_aside_and_a_live_lease_refuses_a_second_job(gcs_server, tmp_path):
    bucket = gcs_server.new_bucket("aside")
    run_dir = f"gs://{bucket}/runs/a"
    args = [f"base_output_directory=gs://{bucket}/runs", "run_name=a", "checkpoint_period=3"]
    first = _train(gcs_server, tmp_path, "pod", "steps=6", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    chunk = next(n for n in gcs_server.names(bucket, "runs/a/checkpoints/6/state/") if "/d/" in n)
    gcs_server.write(bucket, chunk, gcs_server.read(bucket, chunk)[:5])  # truncated in place

    second = _train(gcs_server, tmp_path, "pod", "steps=9", *args)
    assert second.returncode == 0, second.stderr[-3000:]
    [aside] = [e for e in _events(tmp_path, "pod", run_dir) if e["event"] == "checkpoint_set_aside"]
    assert aside["step"] == 6 and aside["check"].startswith("truncated state/"), aside
    assert [e for e in _events(tmp_path, "pod", run_dir) if e["event"] == "attempt_start"][-1]["source"] == (
        "checkpoint:3"
    )
    names = gcs_server.names(bucket, "runs/a/checkpoints/")
    assert any(n.startswith("runs/a/checkpoints/6.unreadable-") for n in names), "kept for inspection"
    assert _committed_in_bucket(gcs_server, bucket, "runs/a/checkpoints") == [3, 6, 9]

    # A live job holds the run (its lease generation is the newest, its heartbeat fresh): a second job
    # on another node exits 2 naming it, and writes nothing.
    import time

    newest = max(int(n.rsplit("/", 1)[1].split(".")[0]) for n in gcs_server.names(bucket, "runs/a/lease/"))
    holder = {"host": "node-7", "pid": 77, "job": "jobset:ml/other", "boot": "", "started": ""}
    record = {"generation": newest + 1, "owner": holder, "heartbeat": time.time(), "released": False}
    assert gcs_server.create_only(bucket, f"runs/a/lease/{newest + 1}.json", json.dumps(record).encode())
    before = gcs_server.names(bucket, "runs/a/")
    third = _train(gcs_server, tmp_path, "pod-b", "steps=12", *args)
    assert third.returncode == 2, third.stderr[-3000:]
    assert "in use by job jobset:ml/other on host node-7, pid 77" in third.stderr
    assert gcs_server.names(bucket, "runs/a/") == before


def test_on_gs_a_job_whose_lease_was_taken_over_commits_nothing(gcs, tmp_path):
    """The lease on the bucket (create-only generations, ifGenerationMatch=0) and the fence at Orbax's commit
    marker: once another job takes the run over, this one's saves are refused at commit."""
    import jax
    import jax.numpy as jnp
    from etils import epath

    from trainer.checkpoint import Checkpointer, CheckpointSaveError
    from trainer.checkpoint.fence import SaveFence
    from trainer.checkpoint.lease import LeaseHeld, Owner, RunLease
    from trainer.config.schema import CheckpointConfig

    bucket = gcs.new_bucket("fence")
    run = epath.Path(f"gs://{bucket}/runs/f")
    clock = [1000.0]
    frozen = RunLease(run, stale_s=60, owner=Owner("node-a", 1, "slurm:1", "", ""), clock=lambda: clock[0])
    assert frozen.acquire()["generation"] == 1
    with pytest.raises(LeaseHeld):  # live: another job is refused through the bucket's generations
        RunLease(run, stale_s=60, owner=Owner("node-b", 2, "slurm:2", "", ""), clock=lambda: clock[0]).acquire()
    state = {"w": jnp.arange(4.0), "step": jnp.int32(1)}
    cfg = CheckpointConfig(async_checkpointing=False)
    ckpt = Checkpointer(run / "checkpoints", cfg, fence=SaveFence(frozen))
    assert ckpt.save(1, state, {}, {})
    assert _committed_in_bucket(gcs, bucket, "runs/f/checkpoints") == [1]

    clock[0] += 120  # frozen past the staleness bound: another job takes the run over
    taker = RunLease(run, stale_s=60, owner=Owner("node-b", 2, "slurm:2", "", ""), clock=lambda: clock[0])
    assert taker.acquire()["taken_over"].startswith("stale_")
    with pytest.raises(CheckpointSaveError, match="no longer holds the run's lease"):
        ckpt.save(2, jax.tree.map(lambda x: x + 1, state), {}, {})
    assert _committed_in_bucket(gcs, bucket, "runs/f/checkpoints") == [1], "the fenced save never committed"
    assert not frozen.renew() and frozen.lost
    ckpt.close()
