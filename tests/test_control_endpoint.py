"""The control endpoint (trainer.observe.control, trainer.elastic.control, python -m trainer.control): the token
check and the request queue, what each action does at a step boundary, and the real CLI on a tiny run
(checkpoint now commits within a few steps; drain exits 42 with the newest state saved and the same command
resumes from it; a bad token changes nothing)."""

from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cli_harness import cli_env, command
from helpers import auto_periods

from trainer.config.schema import CheckpointConfig
from trainer.elastic.control import ControlActions, refusals
from trainer.elastic.periods import WARMUP_STEPS, AutoPeriods, FixedPeriods
from trainer.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED
from trainer.observe import catalogue
from trainer.observe.control import CONTROL_DIR, ControlRequests, read_access, remove_access, write_access
from trainer.observe.events import EventLog
from trainer.observe.metrics_server import Endpoint, LiveMetrics

TOKEN = "s3cret-token"


def _requests(tmp_path: Path) -> tuple[ControlRequests, EventLog]:
    events = EventLog(tmp_path / "events.jsonl")
    requests = ControlRequests(events, token=TOKEN)
    requests.offer({})
    return requests, events


def _control_events(path: Path) -> list[dict]:
    return [e for e in _events(path) if e["event"] in (catalogue.CONTROL_REQUEST, catalogue.CONTROL_APPLIED)]


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def test_a_missing_or_wrong_token_is_refused_queues_nothing_and_is_an_event(tmp_path):
    requests, _ = _requests(tmp_path)
    assert requests.handle("POST", "/control/drain", "")[0] == 401
    assert requests.handle("POST", "/control/drain", "Bearer wrong")[0] == 403
    assert requests.handle("POST", "/control/drain", TOKEN)[0] == 401  # no scheme: no token
    assert requests.handle("POST", "/control/drain", f"Bearer {TOKEN}x")[0] == 403
    assert requests.take() == []
    got = _control_events(tmp_path / "events.jsonl")
    assert [(e["action"], e["accepted"], e["status"]) for e in got] == [
        ("drain", False, s) for s in (401, 403, 401, 403)
    ]
    assert all("token" in e["reason"] for e in got)


def test_only_an_authenticated_post_of_an_offered_action_is_queued_in_order(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    requests = ControlRequests(events, token=TOKEN)
    auth = f"Bearer {TOKEN}"
    assert requests.handle("POST", "/control/drain", auth)[0] == 503  # the run is still starting
    requests.offer({"replan": "no period is auto"})
    assert requests.handle("GET", "/control/drain", auth)[0] == 405
    assert requests.handle("POST", "/control/explode", auth)[0] == 404
    status, body = requests.handle("POST", "/control/replan", auth)
    assert (status, body["message"]) == (409, "no period is auto")
    assert requests.handle("POST", "/control/checkpoint", auth) == (
        202,
        {"action": "checkpoint", "accepted": True, "message": "checkpoint: queued for the next step boundary"},
    )
    assert requests.handle("POST", "/control/drain", auth)[0] == 202
    assert requests.take() == ["checkpoint", "drain"] and requests.take() == []
    got = _control_events(tmp_path / "events.jsonl")
    assert [e["accepted"] for e in got] == [False, False, False, False, True, True]
    assert "reason" not in got[-1]


def test_each_process_start_gets_a_fresh_token_readable_by_its_user_only(tmp_path):
    a, b = ControlRequests(EventLog(None)), ControlRequests(EventLog(None))
    assert a.token != b.token and len(a.token) >= 32
    write_access(tmp_path, a.token, 9491)
    assert read_access(tmp_path) == (a.token, 9491)
    for name in ("token", "port"):
        assert stat.S_IMODE((tmp_path / CONTROL_DIR / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / CONTROL_DIR).stat().st_mode) == 0o700
    write_access(tmp_path, b.token, 9492)
    assert read_access(tmp_path) == (b.token, 9492)
    remove_access(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_access(tmp_path)


def test_the_bucket_copy_of_the_run_directory_leaves_the_token_out(tmp_path):
    from etils import epath

    from trainer.observe.rundir import RunPaths

    mirror = RunPaths(local=tmp_path / "run", checkpoints=epath.Path(tmp_path / "store" / "checkpoints"),
                      remote=epath.Path(tmp_path / "store"))  # fmt: skip
    mirror.local.mkdir()
    (mirror.local / "config.yml").write_text("steps: 1\n")
    write_access(mirror.local, TOKEN, 9491)
    mirror.sync()
    assert (tmp_path / "store" / "config.yml").exists()
    assert not (tmp_path / "store" / CONTROL_DIR).exists()


def _post(port: int, action: str, token: str | None) -> tuple[int, dict]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/control/{action}", data=b"", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_metrics_server_serves_the_control_paths_beside_the_metrics(tmp_path):
    requests, _ = _requests(tmp_path)
    endpoint = Endpoint(LiveMetrics(), 0, addr="127.0.0.1", control=requests.app)
    try:
        assert _post(endpoint.port, "drain", None)[0] == 401
        assert _post(endpoint.port, "drain", "nope")[0] == 403
        assert _post(endpoint.port, "checkpoint", TOKEN) == (
            202,
            {"action": "checkpoint", "accepted": True, "message": "checkpoint: queued for the next step boundary"},
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10) as r:
            assert b"trainer_badput_seconds" in r.read()
    finally:
        endpoint.close()
    assert requests.take() == ["checkpoint"]


class _Stop:
    def __init__(self):
        self.requested = []

    def request(self, where=None):
        self.requested.append(where)


def _auto_periods(events) -> AutoPeriods:
    from trainer.plan import model

    costs = model.Costs(step_s=0.5, snapshot_save_s=0.1, snapshot_write_s=0.6, checkpoint_save_s=2.0)
    return auto_periods(lambda: (costs, 0), events, checkpoint=500, mtbf_per_chip_s=4 * 3600.0)


def test_the_training_thread_acts_on_the_requests_at_the_step_boundary(tmp_path):
    requests, events = _requests(tmp_path)
    stop, periods = _Stop(), _auto_periods(events)
    actions = ControlActions(requests, stop=stop, periods=periods, events=events)
    due = actions.checkpoint_due(lambda step: step % 100 == 0)
    periods.attempt_started(0)
    auth = f"Bearer {TOKEN}"
    for action in ("checkpoint", "replan"):
        requests.handle("POST", f"/control/{action}", auth)
    assert not due(3) and stop.requested == []  # nothing happens before the boundary takes them
    actions.at_boundary()
    assert [due(4), due(5), due(100)] == [True, False, True]  # the next step asked, once; the period stays
    periods.after_step(4)  # before the warm-up's end: planned only because it was asked
    planned = [e for e in _events(tmp_path / "events.jsonl") if e["event"] == catalogue.PERIODS_PLANNED]
    assert [e["step"] for e in planned] == [4] and periods.next_plan == WARMUP_STEPS  # the schedule goes on
    requests.handle("POST", "/control/drain", auth)
    actions.at_boundary()
    assert stop.requested == ["drain (control endpoint)"]
    applied = [e["action"] for e in _events(tmp_path / "events.jsonl") if e["event"] == catalogue.CONTROL_APPLIED]
    assert applied == ["checkpoint", "replan", "drain"]


def test_a_run_refuses_what_it_cannot_do():
    fixed, auto = FixedPeriods(snapshot=5), _auto_periods(EventLog(None))
    assert refusals(CheckpointConfig(), auto, 1) == {}
    assert set(refusals(CheckpointConfig(), fixed, 1)) == {"replan"}
    assert "enable_checkpointing" in refusals(CheckpointConfig(enable_checkpointing=False), auto, 1)["checkpoint"]
    assert "drain" in refusals(CheckpointConfig(), auto, 2)["checkpoint"]


def test_the_cli_says_bad_input_without_a_served_run_directory(tmp_path):
    from trainer.control import main

    assert main([str(tmp_path / "missing"), "drain"]) == EXIT_BAD_INPUT
    assert main([str(tmp_path), "drain"]) == EXIT_BAD_INPUT  # no control/ (metrics_port not set)
    write_access(tmp_path, TOKEN, _free_port())
    assert main([str(tmp_path), "drain"]) == 1  # nothing listens: unreachable


# ---- the real CLI on a tiny run -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, predicate, proc: subprocess.Popen, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}"
            )
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {what} in {timeout:g} s")


def _control(run_dir: Path, action: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.control", str(run_dir), action], capture_output=True, text=True, timeout=60
    )


def _steps(run_dir: Path) -> int:
    rows = [e for e in _events(run_dir / "metrics.jsonl") if "loss" in e]
    return rows[-1]["step"] if rows else 0


def _of(run_dir: Path, event: str, since: int = 0) -> list[dict]:
    return [e for e in _events(run_dir / "events.jsonl")[since:] if e["event"] == event]


@pytest.mark.slow
def test_checkpoint_now_commits_drain_exits_42_saved_and_a_bad_token_changes_nothing(tmp_path):
    port = _free_port()
    argv = command(tmp_path, "r", "steps=1000000", "checkpoint_period=100000", f"metrics_port={port}")
    run_dir = tmp_path / "r"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(1))
    try:
        _wait("training", lambda: _steps(run_dir) >= 3 and (run_dir / CONTROL_DIR / "port").exists(), proc)
        token, served = read_access(run_dir)
        assert served == port and stat.S_IMODE((run_dir / CONTROL_DIR / "token").stat().st_mode) == 0o600
        # A bad token: refused (an event), and nothing is done.
        assert _post(port, "drain", "not-" + token)[0] == 403
        assert _post(port, "checkpoint", None)[0] == 401
        # checkpoint now: a persistent checkpoint, far from the periodic ones, commits within a few steps.
        done = _control(run_dir, "checkpoint")
        assert done.returncode == 0 and done.stdout.startswith("accepted"), done.stderr
        saved = _wait("checkpoint", lambda: _of(run_dir, catalogue.CHECKPOINT_SAVE_COMMITTED), proc)
        accepted = _of(run_dir, catalogue.CONTROL_REQUEST)[-1]["time"]
        asked_at = max(
            r["step"] for r in _events(run_dir / "metrics.jsonl") if r.get("time", accepted) <= accepted
        )
        assert asked_at < saved[0]["step"] <= asked_at + 4, (asked_at, saved)  # the loop records a step late
        assert proc.poll() is None  # the bad drain did not stop the run
        requests = [(e["action"], e["accepted"], e["status"]) for e in _of(run_dir, catalogue.CONTROL_REQUEST)]
        assert requests == [("drain", False, 403), ("checkpoint", False, 401), ("checkpoint", True, 202)]
        assert [e["action"] for e in _of(run_dir, catalogue.CONTROL_APPLIED)] == ["checkpoint"]
        assert not _of(run_dir, catalogue.PREEMPTED)
        # drain: the newest state saved and exit 42, as SIGTERM does.
        done = _control(run_dir, "drain")
        assert done.returncode == 0, done.stderr
        assert proc.wait(timeout=120) == EXIT_PREEMPTED, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    preempted = _of(run_dir, catalogue.PREEMPTED)
    assert preempted, "drain exited without the stop's save (no preempted event)"
    stopped = preempted[-1]["step"]
    assert stopped == _steps(run_dir) and stopped > saved[0]["step"]  # the newest step trained
    assert _of(run_dir, catalogue.CHECKPOINT_SAVE_COMMITTED)[-1]["step"] == stopped
    assert (run_dir / "checkpoints" / str(stopped)).is_dir()
    assert not (run_dir / CONTROL_DIR / "token").exists()  # the process ended: its token is gone
    # The same command resumes from the drained step, with a fresh token.
    seen = len(_events(run_dir / "events.jsonl"))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(1))
    try:
        start = _wait("the resumed start", lambda: _of(run_dir, catalogue.START, seen), proc)
        assert start[0]["resume_step"] == stopped
        _wait("the new token", lambda: (run_dir / CONTROL_DIR / "port").exists(), proc)
        assert read_access(run_dir)[0] != token
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
