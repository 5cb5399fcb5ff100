"""`python -m trainer.chaos kill-slice` as a user types it: what it refuses (exit 2, one line naming the
input and the fix), what it accepts, and that a request reaches only the trainer attempt it was made for.

Most cases run the CLI against a run directory written here: "live" is the newest start event's pid
running on this host, so this test's own pid makes a live run without training. Two tests drive a
real 2-slice trainer: a refused and an accepted kill on a live job, then a resumed run that must ignore
a request left for the attempt before it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_harness import cli_env, command

from trainer.config import load_config, to_yaml
from trainer.elastic.faults import FaultInjector
from trainer.failures.chaos_requests import attempt_of, request_kill
from trainer.failures.slice_loss import Outages
from trainer.io.jsonl import read_jsonl

PROG = "python -m trainer.chaos"
HANG_GUARD_S = 300  # only catches a hang; nothing here measures time


def chaos(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.chaos", "kill-slice", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=HANG_GUARD_S,
    )


def assert_refused(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert proc.stdout == ""


def requests(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "chaos").glob("*.json"))


def fake_run(run_dir: Path, *events: dict, num_slices: int = 2) -> Path:
    """A run directory as the trainer leaves it: config.yml and events.jsonl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yml").write_text(to_yaml(load_config("base.yml", [f"num_slices={num_slices}"])))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def start(pid: int, at: float) -> dict:
    return {"event": "start", "time": at, "pid": pid}


def finish(pid: int, at: float, status: str = "finished") -> dict:
    return {"event": "finish", "time": at, "pid": pid, "status": status}


@pytest.fixture
def live(tmp_path) -> Path:
    """A 2-slice run whose trainer is 'running': its start event names this (alive) test process."""
    return fake_run(tmp_path / "runs" / "live", start(os.getpid(), time.time()))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: no such process any more
    return proc.pid


# ---- the CLI ------------------------------------------------------------------------------------------


def test_help_states_the_index_range_and_the_unit():
    out = subprocess.run(
        [sys.executable, "-m", "trainer.chaos", "kill-slice", "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "[0, num_slices)" in text and "seconds the slice stays unhealthy" in text and ">= 0" in text


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--slice", "99"], ["--slice 99", "num_slices=2", "[0, 2)"]),
        (["--slice", "2"], ["--slice 2", "[0, 2)"]),
        (["--slice", "-1"], ["--slice -1", "[0, num_slices)"]),
        (["--slice", "1", "--down-s", "-5"], ["--down-s -5.0", "finite number >= 0"]),
        (["--slice", "1", "--down-s", "nan"], ["--down-s nan", "finite number >= 0"]),
        (["--slice", "1", "--down-s", "inf"], ["--down-s inf", "finite number >= 0"]),
    ],
)
def test_out_of_range_input_is_refused_on_a_live_run_and_writes_no_request(live, args, fragments):
    assert_refused(chaos("--run-dir", str(live), *args), *fragments)
    assert requests(live) == []


def test_a_finished_run_is_refused(tmp_path):
    run = fake_run(tmp_path / "done", start(os.getpid(), 100.0), finish(os.getpid(), 200.0))
    assert_refused(chaos("--run-dir", str(run), "--slice", "1"), "has ended (status finished)", "resume the run")
    assert requests(run) == []


def test_a_run_whose_trainer_was_killed_is_refused(tmp_path):
    run = fake_run(
        tmp_path / "killed", start(os.getpid(), 100.0), finish(os.getpid(), 200.0), start(dead_pid(), 300.0)
    )  # resumed, then kill -9: no finish event
    assert_refused(chaos("--run-dir", str(run), "--slice", "1"), "not running", "resume the run first")
    assert requests(run) == []


def test_a_missing_directory_and_a_directory_that_is_not_a_run_are_refused(tmp_path):
    assert_refused(chaos("--run-dir", str(tmp_path / "nope"), "--slice", "0"), "no such directory")
    assert_refused(chaos("--run-dir", str(tmp_path), "--slice", "0"), "not a run directory", "events.jsonl")


def test_a_live_run_gets_a_request_naming_its_attempt_and_relative_paths_are_the_callers(live, tmp_path):
    proc = chaos("--run-dir", "runs/live", "--slice", "1", "--down-s", "2.5", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [path] = requests(live)
    request = json.loads(path.read_text())
    own_start = read_jsonl(live / "events.jsonl")[-1]
    assert request["slice"] == 1 and request["down_s"] == 2.5
    assert request["target"] == {"pid": os.getpid(), "started": own_start["time"]}


def test_a_gs_run_dir_means_the_trainers_local_mirror(tmp_path, monkeypatch):
    from trainer.observe.rundir import run_paths

    monkeypatch.setenv("TRAINER_LOCAL_RUN_ROOT", str(tmp_path / "mirrors"))
    mirror = run_paths("gs://bucket/runs", "x").local
    fake_run(mirror, start(os.getpid(), time.time()))
    proc = chaos("--run-dir", "gs://bucket/runs/x", "--slice", "0", env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert len(requests(mirror)) == 1


# ---- the trainer's reader: a request reaches only the attempt it names -------------------------------


class _Events:
    def __init__(self):
        self.killed = []

    def emit(self, name, **fields):
        self.killed.append(fields["slice"])


def _injector(run_dir: Path) -> tuple[FaultInjector, _Events]:
    events = _Events()
    return FaultInjector([], Outages(), run_dir / "chaos", events), events


def test_the_reader_fires_only_requests_for_its_own_attempt(tmp_path):
    now = time.time()
    previous = start(dead_pid(), now - 100)
    reused_pid = start(os.getpid(), now - 50)  # an earlier trainer that had this pid (a container's pid 1)
    own = start(os.getpid(), now)
    run = fake_run(
        tmp_path / "run",
        previous,
        finish(previous["pid"], now - 90),
        reused_pid,
        finish(os.getpid(), now - 40),
        own,
    )
    stale = [request_kill(run, 0, 0.0, attempt_of(previous)), request_kill(run, 0, 0.0, attempt_of(reused_pid))]
    by_hand_before = run / "chaos" / "0-by-hand-before.json"
    by_hand_before.write_text('{"slice": 0}')
    os.utime(by_hand_before, (now - 60, now - 60))
    fresh = request_kill(run, 1, 0.0, attempt_of(own))
    injector, events = _injector(run)
    injector.at_step_boundary(5)
    assert events.killed == [1]
    assert fresh.with_suffix(".done").exists()
    assert all(p.with_suffix(".ignored").exists() for p in [*stale, by_hand_before])
    assert requests(run) == []
    injector.at_step_boundary(6)
    assert events.killed == [1], "each request is read once"


def test_a_request_written_by_hand_during_the_run_still_counts(tmp_path):
    now = time.time()
    run = fake_run(tmp_path / "run", start(os.getpid(), now - 10))
    (run / "chaos").mkdir()
    (run / "chaos" / "by-hand.json").write_text('{"slice": 1, "down_s": 0}')
    injector, events = _injector(run)
    injector.at_step_boundary(2)
    assert events.killed == [1]


# ---- a real 2-slice trainer -------------------------------------------------------------------------

LIVE = [
    "num_slices=2",
    "elastic_enabled=true",
    "snapshot_period=2",
    "elastic_poll_interval_seconds=0.05",
    "elastic_timeout_seconds=120",
    "steps=100000",
]  # ended by SIGTERM (saves, exits 42: preempted), never by its steps


def _names(run_dir: Path) -> list[str]:
    return [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]


def _wait_until(proc: subprocess.Popen, done, log: Path, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        if proc.poll() is not None:
            pytest.fail(f"the trainer exited rc={proc.returncode} before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"hang: no {what} after {HANG_GUARD_S} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _preempt(proc: subprocess.Popen, log: Path) -> str:
    """SIGTERM (finish the step, save, exit 42); the trainer's output."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=HANG_GUARD_S)
    return log.read_text()


def _trainer(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:  # a file, not a pipe: nobody reads while it trains
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=cli_env(2))


@pytest.fixture(scope="module")
def live_job(tmp_path_factory):
    """A 2-slice trainer asked, while it trains, to kill slice 5 and then slice 1; then preempted."""
    root = tmp_path_factory.mktemp("chaos_live")
    cmd, run, log = command(root, "live", *LIVE), root / "live", root / "live.log"
    proc = _trainer(cmd, log)
    try:
        _wait_until(proc, lambda: len(read_jsonl(run / "metrics.jsonl")) >= 3, log, "3 steps")
        out_of_range = chaos("--run-dir", str(run), "--slice", "5")
        left = requests(run)
        valid = chaos("--run-dir", str(run), "--slice", "1")
        _wait_until(proc, lambda: "first_step_after_recovery" in _names(run), log, "the recovery")
        output = _preempt(proc, log)
    finally:
        proc.kill()
        proc.wait()
    return {
        "run": run,
        "cmd": cmd,
        "out_of_range": out_of_range,
        "left": left,
        "valid": valid,
        "rc": proc.returncode,
        "output": output,
    }


def test_on_a_live_2_slice_job_slice_5_is_refused_and_slice_1_is_killed(live_job):
    assert_refused(live_job["out_of_range"], "--slice 5", "[0, 2)")
    assert live_job["left"] == [], "a refused request writes nothing"
    assert live_job["valid"].returncode == 0, live_job["valid"].stderr
    assert live_job["rc"] == 42, live_job["output"][-3000:]
    evs = read_jsonl(live_job["run"] / "events.jsonl")
    killed = [e for e in evs if e["event"] == "slice_killed"]
    assert [(e["slice"], e["cause"].startswith("chaos")) for e in killed] == [(1, True)]
    assert [e["event"] for e in evs].count("slice_down_detected") == 1


def test_a_request_left_for_an_ended_attempt_does_not_kill_the_resumed_run(live_job):
    """The ended attempt never read it (it ended between the CLI's liveness check and its next step)."""
    run = live_job["run"]
    ended = attempt_of([e for e in read_jsonl(run / "events.jsonl") if e["event"] == "start"][-1])
    left_over = request_kill(run, 1, 0.0, ended)
    log = run.parent / "resumed.log"
    proc = _trainer(live_job["cmd"], log)
    try:
        _wait_until(
            proc,
            lambda: sum(r["pid"] == proc.pid for r in read_jsonl(run / "metrics.jsonl")) >= 3,
            log,
            "3 steps of the resumed run",
        )
        output = _preempt(proc, log)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 42, output[-3000:]
    assert left_over.with_suffix(".ignored").exists(), "the resumed run read the request and set it aside"
    mine = [e for e in read_jsonl(run / "events.jsonl") if e.get("pid") == proc.pid]
    assert mine[0]["event"] == "start"
    assert not [e for e in mine if e["event"] in ("slice_killed", "slice_down_detected")]
    assert [e["source"] for e in mine if e["event"] == "attempt_start"][0].startswith("checkpoint:")
