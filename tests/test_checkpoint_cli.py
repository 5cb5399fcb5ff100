"""Checkpoints through the real CLI: kill -9 anywhere, SIGTERM, resume onto another mesh.

The oracle is an uninterrupted run: a killed-and-restarted run must end with bitwise-equal
parameters (CPU, float32) and the same batch for every step.
"""

import re
import shutil
import signal
import subprocess
import time

import pytest
from cli_harness import (
    assert_same_data_order,
    assert_same_params,
    cli_env,
    command,
    events,
    final_by_step,
    killed_during,
    metrics,
    run_cli,
)

from trainer.checkpoint import local_store
from trainer.checkpoint.commit import committed_steps

STEPS = 12
COMMON = [f"steps={STEPS}", "checkpoint_period=3", "num_slices=1"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckbase")
    proc = run_cli(root, "base", *COMMON, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "base"


def _assert_same_run(run, baseline):
    assert_same_data_order(run, baseline, STEPS)
    assert_same_params(run, baseline)


def _kill_when(root, name, ready, *extra) -> int:
    """Start the run, SIGKILL it once `ready(run dir)`; returns the killed pid."""
    proc = subprocess.Popen(
        command(root, name, *COMMON, *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(1),
    )
    try:
        deadline = time.time() + 300  # a hang guard, not a speed claim
        while time.time() < deadline and proc.poll() is None:
            if ready(root / name):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before the kill point was reached"
    return proc.pid


def _committed(run):
    return committed_steps(run / "checkpoints")


def _in_flight_save_after_a_commit(run):
    """A save is writing a step newer than every committed one. The committed steps are read first: a tmp
    directory listed before them may be renamed to its committed step in between."""
    ck = run / "checkpoints"
    if not ck.is_dir():
        return False
    committed = _committed(run)
    tmp = re.compile(r"(\d+)\.orbax-checkpoint-tmp.*")
    in_flight = [int(m.group(1)) for p in ck.iterdir() if (m := tmp.fullmatch(p.name))]
    return bool(committed) and any(step > committed[-1] for step in in_flight)


def _after_step(n):
    def ready(run):
        return (run / "metrics.jsonl").exists() and len(metrics(run)) >= n

    return ready


@pytest.mark.parametrize("point", ["during an async save", "between steps after step 7"])
def test_kill_9_anywhere_then_restart_resumes_from_the_newest_committed_step(baseline, tmp_path, point):
    ready = _in_flight_save_after_a_commit if point.startswith("during") else _after_step(7)
    for _ in range(3):  # a save may still finish between the check and the signal: kill again
        pid = _kill_when(tmp_path, "k", ready)
        if not point.startswith("during"):
            break
        # the kill landed inside a save: its start logged, its commit neither logged nor on disk
        in_flight = killed_during(tmp_path / "k", pid, "checkpoint_save_start", "checkpoint_save_committed")
        if in_flight["step"] not in _committed(tmp_path / "k"):
            break
        shutil.rmtree(tmp_path / "k")
    else:
        pytest.fail("three kills in a row landed after a save's commit: the kill point is not reachable")
    newest = _committed(tmp_path / "k")[-1]
    partial = [p.name for p in (tmp_path / "k" / "checkpoints").iterdir() if not p.name.isdigit()]
    partial = [name for name in partial if not name.endswith(".saving")]  # in-flight markers: no event
    proc = run_cli(tmp_path, "k", *COMMON, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evs = events(tmp_path / "k")
    second = [e for e in evs if e["event"] == "attempt_start"][-1]
    assert second["source"] == f"checkpoint:{newest}"
    removed = [e["path"] for e in evs if e["event"] == "checkpoint_partial_removed"]
    assert all(any(r.endswith(p) for r in removed) for p in partial), (partial, removed)
    assert not list((tmp_path / "k" / "checkpoints").glob("*.saving")), "every save committed: no marker left"
    _assert_same_run(tmp_path / "k", baseline)


@pytest.mark.parametrize("local_tier", [False, True], ids=["persistent", "local tier too"])
def test_sigterm_finishes_the_step_saves_and_exits_42_then_resumes(baseline, tmp_path, local_tier):
    tier = [f"local_checkpoint_directory={tmp_path / 'node'}", "local_checkpoint_period=5"] if local_tier else []
    proc = subprocess.Popen(
        command(tmp_path, "t", *COMMON, *tier),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(1),
    )
    try:
        deadline = time.time() + 300  # a hang guard, not a speed claim
        while time.time() < deadline and not _after_step(4)(tmp_path / "t"):
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 42, err[-3000:]  # preempted: restart me (trainer/errors.py)
    status = out.strip().splitlines()[-1]
    assert status.startswith("STATUS: preempted step=")
    step = int(status.split("step=")[1].split(":")[0])
    assert (tmp_path / "t" / "checkpoints" / str(step) / "commit_success.txt").exists()
    if local_tier:  # the fastest tier is written first, whatever its period
        assert step in _local_committed(tmp_path / "node", "t")
    proc2 = run_cli(tmp_path, "t", *COMMON, *tier, devices=1)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    second = [e for e in events(tmp_path / "t") if e["event"] == "attempt_start"][-1]
    assert second["source"] == (f"local:{step}" if local_tier else f"checkpoint:{step}")
    _assert_same_run(tmp_path / "t", baseline)


def test_a_restore_onto_three_slices_reads_one_replica_from_storage(tmp_path):
    """Saved on one slice, restored onto three (the state replicated across them): the process reads
    the checkpoint once, not once per slice (checkpoint_restore_done's read_bytes, from /proc/self/io)."""
    saved = run_cli(tmp_path, "r", "steps=2", "checkpoint_period=2", "num_slices=1", devices=1)
    assert saved.returncode == 0, saved.stderr[-3000:]
    resumed = run_cli(tmp_path, "r", "steps=3", "checkpoint_period=2", "num_slices=3", devices=3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = [e for e in events(tmp_path / "r") if e["event"] == "checkpoint_restore_done"][-1]
    assert done["step"] == 2 and 0 < done["read_bytes"] <= 1.3 * done["bytes"], done


def test_resume_onto_another_mesh_continues_the_same_run(tmp_path):
    # Global batch 4 throughout: 1 device x 4 (reference), saved on fsdp=4 x 1 (4 devices) at step 6,
    # resumed on data=2 x 2 (2 devices). Same math on another layout: reductions run in another order.
    ref = run_cli(tmp_path, "ref", *COMMON, "per_device_batch_size=4", devices=1)
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = run_cli(
        tmp_path,
        "m",
        *COMMON[1:],
        "steps=6",
        "learning_rate_schedule_steps=12",
        "ici_fsdp_parallelism=4",
        "per_device_batch_size=1",
        devices=4,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(
        tmp_path,
        "m",
        *COMMON,
        "ici_fsdp_parallelism=1",
        "ici_data_parallelism=2",
        "per_device_batch_size=2",
        devices=2,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    attempts = [e for e in events(tmp_path / "m") if e["event"] == "attempt_start"]
    assert attempts[-1]["source"] == "checkpoint:6" and attempts[-1]["global_batch_size"] == 4
    assert_same_data_order(tmp_path / "m", tmp_path / "ref", STEPS)
    assert_same_params(tmp_path / "m", tmp_path / "ref", rtol=1e-4, atol=1e-5)


def test_a_failing_checkpoint_write_exits_75_never_0_and_a_file_in_the_way_exits_2(tmp_path):
    proc = run_cli(tmp_path, "w", *COMMON, "fault_schedule=storage=save,count=99", devices=1)
    assert proc.returncode == 75, proc.stderr[-2000:]  # transient: restart me, nothing committed is harmed
    assert proc.stdout.strip().splitlines()[-1].startswith("STATUS: transient: CheckpointSaveError")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "checkpoints").write_text("not a directory")  # no restart can fix this one
    proc = run_cli(tmp_path, "f", *COMMON, devices=1)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr, proc.stderr[-2000:]


def _local_committed(local_root, run="k"):
    return local_store.committed_steps(local_root / run)  # the local tier's own commit rule


def test_kill_9_resumes_from_the_newer_local_tier_and_matches_an_uninterrupted_run(baseline, tmp_path):
    local_root = tmp_path / "node_local"
    tier = [f"local_checkpoint_directory={local_root}", "local_checkpoint_period=1"]

    def ready(run):  # a local step newer than every persistent one (period 3) is committed
        return any(s > 6 and s % 3 for s in _local_committed(local_root))

    _kill_when(tmp_path, "k", ready, *tier)
    persistent = _committed(tmp_path / "k")[-1]
    local = _local_committed(local_root)[-1]
    assert local > persistent
    proc = run_cli(tmp_path, "k", *COMMON, *tier, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from step {local}" in proc.stdout + proc.stderr
    evs = events(tmp_path / "k")
    start = [e for e in evs if e["event"] == "attempt_start"][-1]
    assert start["source"] == f"local:{local}" and start["start_step"] == local
    assert any(e["event"] == "local_checkpoint_save_committed" for e in evs)
    # Steps lost to the kill, counted.
    resumed = [e for e in evs if e["event"] == "restart_resumed"][-1]
    assert resumed["source"] == f"local:{local}"
    # A local step commits only once its metrics row is written: the restored step always has its record.
    assert resumed["last_step"] >= local and resumed["steps_lost"] == resumed["last_step"] - local
    recorded = final_by_step(metrics(tmp_path / "k"))
    assert set(recorded) == set(range(1, STEPS + 1)), "no step is missing from metrics.jsonl"
    base = final_by_step(metrics(baseline))
    assert all(recorded[s]["batch_fingerprint"] == base[s]["batch_fingerprint"] for s in recorded)
    assert_same_params(tmp_path / "k", baseline)
    assert len(_local_committed(local_root)) <= 2, "max_num_local_checkpoints_to_keep bounds the local disk use"
