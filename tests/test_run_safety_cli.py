"""A run is never lost, forked or silently restarted (the real CLI on the micro model, one device).

- A transient storage error while restoring changes nothing; a step whose own files are damaged is set
  aside naming the failed check, and the previous step restores; a run directory with steps but none
  resumable never starts over.
- Two jobs on one run directory: the second exits 2 naming the first, which ends as a solo run would; a
  holder killed on another host is waited out until its heartbeat is stale, then the run trains.
- Storage that cannot be reached at the start is transient: exit 75 (restart me), never 2.
- A load path is checked whatever the run holds, and one the resumed run does not use is said.
- Step directories this trainer did not write are never removed.

A config that does not fit the saved step (refused before compiling): tests/test_preflight_cli.py.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from cli_harness import (
    assert_same_data_order,
    assert_same_params,
    cli_env,
    command,
    events,
    metrics,
    run_cli,
)

pytestmark = pytest.mark.slow

FIRST = ["steps=6", "checkpoint_period=3", "num_slices=1"]
LONGER = ["steps=9", "checkpoint_period=3", "num_slices=1"]


def _status(proc) -> str:
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _starts(run: Path) -> list[dict]:
    return [e for e in events(run) if e["event"] == "attempt_start"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 6 steps with checkpoints 3 and 6, copied fresh for each test."""
    root = tmp_path_factory.mktemp("safety")
    proc = run_cli(root, "r", *FIRST, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "r"


@pytest.fixture
def run(finished, tmp_path):
    import shutil

    shutil.copytree(finished, tmp_path / "r")
    return tmp_path / "r"


def test_a_read_error_on_resume_is_retried_and_leaves_every_step_in_place(run):
    proc = run_cli(run.parent, "r", *LONGER, "fault_schedule=storage=restore,count=1", devices=1)

    assert proc.returncode == 0, proc.stderr[-3000:]
    evs = events(run)
    [failed] = [e for e in evs if e["event"] == "checkpoint_restore_failed"]
    assert failed["step"] == 6 and failed["transient"] is True
    assert not [e for e in evs if e["event"] == "checkpoint_set_aside"]
    assert _starts(run)[-1]["source"] == "checkpoint:6"
    assert not list((run / "checkpoints").glob("*.unreadable-*"))


def test_a_read_error_that_outlasts_the_retries_exits_75_and_changes_nothing(run):
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = run_cli(run.parent, "r", *LONGER, "fault_schedule=storage=restore,count=9", devices=1)

    assert proc.returncode == 75 and _status(proc).startswith("STATUS: transient:"), proc.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert run_cli(run.parent, "r", *LONGER, devices=1).returncode == 0


def test_a_truncated_array_file_sets_the_step_aside_naming_the_check_and_the_previous_step_restores(run):
    chunk = sorted((run / "checkpoints" / "6" / "state").glob("**/d/*"))[0]
    chunk.write_bytes(chunk.read_bytes()[:10])
    proc = run_cli(run.parent, "r", *LONGER, devices=1)

    assert proc.returncode == 0, proc.stderr[-3000:]
    [aside] = [e for e in events(run) if e["event"] == "checkpoint_set_aside"]
    assert aside["step"] == 6 and aside["check"].startswith("truncated state/"), aside
    assert Path(aside["path"]).is_dir(), "kept for inspection"
    assert _starts(run)[-1]["source"] == "checkpoint:3"
    assert {"6", "9"} <= {p.name for p in (run / "checkpoints").iterdir()}, "step 6 saved again"


def test_a_run_whose_steps_are_all_set_aside_never_starts_a_new_run(run):
    for step in ("3", "6"):
        os.rename(run / "checkpoints" / step, run / "checkpoints" / f"{step}.unreadable-100")
    proc = run_cli(run.parent, "r", *LONGER, devices=1)

    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "set aside as corrupt: 3.unreadable-100, 6.unreadable-100" in proc.stderr
    assert not [e for e in events(run) if e["event"] == "attempt_start" and e["source"] == "init"][1:]


def test_a_step_another_tool_wrote_is_left_alone_and_reported(run):
    foreign = run / "checkpoints" / "100"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"not ours")
    proc = run_cli(run.parent, "r", *LONGER, devices=1)

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (foreign / "weights.bin").read_bytes() == b"not ours"
    assert [e["path"] for e in events(run) if e["event"] == "checkpoint_foreign_step"] == [str(foreign)]


def test_load_paths_are_checked_whatever_the_run_holds_and_an_unused_one_is_said(run):
    missing = run_cli(run.parent, "r", *LONGER, "load_parameters_path=does/not/exist", devices=1)
    assert missing.returncode == 2 and "load_parameters_path" in missing.stderr, missing.stderr[-2000:]
    assert "does not exist" in missing.stderr

    given = run / "checkpoints" / "3"
    proc = run_cli(run.parent, "r", *LONGER, f"load_parameters_path={given}", devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first_line = next(line for line in proc.stdout.splitlines() if line.startswith("run_dir="))
    assert f"load_parameters_path={given} not used: the run resumes" in first_line
    [unused] = [e for e in events(run) if e["event"] == "load_path_unused"]
    assert unused == {**unused, "key": "load_parameters_path", "path": str(given), "resume_step": 6}
    assert _starts(run)[-1]["source"] == "checkpoint:6"


def test_a_second_job_on_the_same_run_directory_exits_2_naming_the_first_which_ends_as_a_solo_run(tmp_path):
    args = ["steps=40", "checkpoint_period=10", "num_slices=1"]
    solo = run_cli(tmp_path, "solo", *args, devices=1)
    assert solo.returncode == 0, solo.stderr[-3000:]
    # The first job stalls 20 s after step 2 (an injected slow step: no effect on the math), so the second
    # one starts while it certainly holds the run.
    first = subprocess.Popen(
        command(tmp_path, "shared", *args, "fault_schedule=step=2,slow_s=20"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(1),
    )
    try:
        deadline = time.time() + 300  # a hang guard, not a speed claim
        while time.time() < deadline and first.poll() is None:
            if (tmp_path / "shared" / "metrics.jsonl").exists() and len(metrics(tmp_path / "shared")) >= 1:
                break
            time.sleep(0.05)
        second = run_cli(tmp_path, "shared", *args, devices=1)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()

    assert second.returncode == 2 and _status(second) == "STATUS: input_error", second.stderr[-2000:]
    assert f"pid {first.pid}" in second.stderr and "two jobs must not train one run" in second.stderr
    assert first.returncode == 0, err[-3000:]
    assert_same_data_order(tmp_path / "shared", tmp_path / "solo", 40)
    assert_same_params(tmp_path / "shared", tmp_path / "solo")
    assert [e["pid"] for e in events(tmp_path / "shared") if e["event"] == "start"] == [first.pid]


def test_a_holder_killed_on_another_host_is_waited_out_and_the_run_trains_without_exit_2(tmp_path):
    from trainer.checkpoint.lease import Owner, RunLease

    run = tmp_path / "orphan"
    # What a holder killed -9 on another host leaves behind: its generation, never released, its heartbeat
    # stopped 31 s ago (at run_lease_stale_seconds=50 a holder beats every 10 s: it has missed 3 beats, so
    # it is taken for gone, and the CLI, started within the other 19 s even on a loaded machine, waits).
    killed = Owner(host="node-b", pid=4242, job="jobset:ml/earlier", boot="other-boot", started="1")
    heartbeat = time.time() - 31
    RunLease(run, stale_s=50, owner=killed, clock=lambda: heartbeat).acquire()

    proc = run_cli(tmp_path, "orphan", "steps=3", "num_slices=1", "run_lease_stale_seconds=50", devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped beating" in proc.stderr and "job jobset:ml/earlier on host node-b" in proc.stderr
    (taken,) = [e for e in events(run) if e["event"] == "lease_acquired"]
    assert taken["taken_over"].startswith("stale_") and "node-b" in taken["previous_owner"]
    assert taken["time"] - heartbeat > 50, "taken over once the heartbeat was stale, not before"


def test_a_job_whose_storage_cannot_be_reached_at_the_start_exits_75_not_2(tmp_path):
    """gs:// run directory, the store's endpoint refusing connections (a closed local port): the storage
    client retries, then the start ends as transient, so the scheduler restarts it."""
    from gcs_server import GCSServer

    away = "http://127.0.0.1:1"
    env = {**cli_env(1), **GCSServer.env.fget(type("Away", (), {"url": away})()), "TENSORSTORE_GCS_HTTP_URL": away}
    proc = subprocess.run(
        command(tmp_path, "r", "steps=3", "num_slices=1", "base_output_directory=gs://bucket/runs"),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert _status(proc).startswith("STATUS: transient: ClientConnectorError: Cannot connect to host 127.0.0.1:1")
