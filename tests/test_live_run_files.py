"""A gs:// run's files are live and durable on the bucket (trainer/observe/rundir.py, live_upload.py).

Against a real GCS JSON API (fake-gcs-server, tests/gcs_server.py): the logs' new bytes are appended by
composition (never the whole file again), whole lines only, a log near GCS's component limit is
rewritten once, a restarted process continues from what the bucket holds, a mirror that diverged from
the bucket gives way to it; the uploader sends within its interval and at once after a committed
checkpoint; and the real CLI killed -9 a few steps after a committed checkpoint has its metrics and
events in the bucket through that step.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_harness import MICRO, pod_env, pod_mirror

from trainer.observe import catalogue, rundir
from trainer.observe.live_upload import LiveUpload
from trainer.observe.rundir import run_paths


@pytest.fixture
def gcs(gcs_server):
    with gcs_server.applied():
        yield gcs_server


def _paths(bucket: str, tmp_path: Path, monkeypatch, pod: str = "pod"):
    monkeypatch.setenv("TRAINER_LOCAL_RUN_ROOT", str(tmp_path / pod))
    return run_paths(f"gs://{bucket}/runs", "live")


def test_new_log_lines_are_appended_by_composition_whole_lines_only(gcs, tmp_path, monkeypatch):
    bucket = gcs.new_bucket("append")
    paths = _paths(bucket, tmp_path, monkeypatch)
    paths.local.mkdir(parents=True)
    log = paths.local / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n')
    (paths.local / "config.yml").write_text("steps: 3\n")

    assert paths.sync() == len(log.read_bytes()) + len("steps: 3\n")
    assert gcs.read(bucket, "runs/live/metrics.jsonl") == log.read_bytes()

    with open(log, "a") as f:
        f.write('{"step": 3}\n{"step": 4, "lo')  # the last line is still being written
    assert paths.sync() == len('{"step": 3}\n'), "only the new whole line goes up; config.yml is unchanged"
    assert gcs.read(bucket, "runs/live/metrics.jsonl") == b'{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    with open(log, "a") as f:
        f.write('ss": 2.0}\n')
    assert paths.sync() == len('{"step": 4, "loss": 2.0}\n')
    assert gcs.read(bucket, "runs/live/metrics.jsonl") == log.read_bytes()
    assert paths.sync() == 0, "nothing new: nothing sent"
    assert not [n for n in gcs.names(bucket, "runs/") if ".append-" in n], "no part object left behind"


def test_a_log_near_the_component_limit_is_rewritten_whole_once(gcs, tmp_path, monkeypatch):
    bucket = gcs.new_bucket("rewrite")
    monkeypatch.setattr(rundir, "REWRITE_AT_COMPONENTS", 3)
    paths = _paths(bucket, tmp_path, monkeypatch)
    paths.local.mkdir(parents=True)
    log = paths.local / "events.jsonl"
    sent = []
    for i in range(5):
        with open(log, "a") as f:
            f.write(json.dumps({"event": "x", "i": i}) + "\n")
        sent.append(paths.sync())
    line = len(json.dumps({"event": "x", "i": 0}) + "\n")
    # new object (whole), composed once (component 2), then whole again at the limit, composed, whole
    assert sent == [line, line, 3 * line, line, 5 * line]
    assert gcs.read(bucket, "runs/live/events.jsonl") == log.read_bytes()


def test_a_restarted_process_continues_from_what_the_bucket_holds(gcs, tmp_path, monkeypatch):
    bucket = gcs.new_bucket("restart")
    paths = _paths(bucket, tmp_path, monkeypatch)
    paths.local.mkdir(parents=True)
    log = paths.local / "events.jsonl"
    log.write_text('{"i": 1}\n')
    paths.sync()
    with open(log, "a") as f:
        f.write('{"i": 2}\n')  # written, then the process was killed before its next sync

    again = _paths(bucket, tmp_path, monkeypatch)  # the restarted process, on the same node
    again.pull()
    assert log.read_text() == '{"i": 1}\n{"i": 2}\n', "the node's own newer mirror is kept"
    assert again.sync() == len('{"i": 2}\n'), "only what the bucket lacks"
    assert gcs.read(bucket, "runs/live/events.jsonl") == b'{"i": 1}\n{"i": 2}\n'


def test_a_mirror_that_diverged_from_the_bucket_gives_way_to_it(gcs, tmp_path, monkeypatch):
    """Pod A's node kept unsent lines; pod B, on another node, continued the run from the bucket. When
    the run comes back to A's node, the bucket's history wins over A's stale mirror."""
    bucket = gcs.new_bucket("diverged")
    a = _paths(bucket, tmp_path, monkeypatch, pod="node-a")
    a.local.mkdir(parents=True)
    (a.local / "events.jsonl").write_text('{"pod": "a", "i": 1}\n')
    a.sync()
    with open(a.local / "events.jsonl", "a") as f:
        f.write('{"pod": "a", "i": 2, "unsent": "and long enough to outgrow the bucket"}\n')

    b = _paths(bucket, tmp_path, monkeypatch, pod="node-b")
    b.pull()
    with open(b.local / "events.jsonl", "a") as f:
        f.write('{"pod": "b", "i": 2}\n')
    b.sync()

    back = _paths(bucket, tmp_path, monkeypatch, pod="node-a")
    back.pull()
    assert (back.local / "events.jsonl").read_text() == '{"pod": "a", "i": 1}\n{"pod": "b", "i": 2}\n'


def test_the_uploader_syncs_every_interval_and_at_once_after_a_committed_checkpoint():
    calls = []
    synced = threading.Event()

    def sync():
        calls.append(time.monotonic())
        synced.set()

    upload = LiveUpload(sync, interval_s=3600).start()
    try:
        upload.on_event({"event": str(catalogue.CHECKPOINT_SAVE_START), "step": 5})
        assert not synced.wait(0.5), "a save that has not committed sends nothing"
        upload.on_event({"event": str(catalogue.CHECKPOINT_SAVE_COMMITTED), "step": 5})
        assert synced.wait(30), "a committed checkpoint sends the logs at once"
    finally:
        upload.stop()
    assert len(calls) == 1

    ticks = []
    periodic = LiveUpload(lambda: ticks.append(1), interval_s=0.05).start()
    deadline = time.monotonic() + 60  # a hang guard, not a speed claim
    while len(ticks) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    periodic.stop()
    assert len(ticks) >= 3


def _has_event(events_text: str, event: str, step: int) -> bool:
    whole_lines = events_text[: events_text.rfind("\n") + 1].splitlines()
    return any(e.get("event") == event and e.get("step") == step for e in map(json.loads, whole_lines))


def _committed_in(events_text: str, step: int) -> bool:
    return _has_event(events_text, "checkpoint_save_committed", step)


def _stalled_after(events_text: str, step: int) -> bool:
    return _has_event(events_text, "host_stalled", step)


@pytest.mark.slow
def test_a_gs_run_killed_9_after_a_committed_checkpoint_has_its_logs_in_the_bucket_through_it(
    gcs_server, tmp_path
):
    bucket = gcs_server.new_bucket("kill9")
    env = pod_env(gcs_server, tmp_path, "pod")
    # Checkpoints every 5 steps. The host stalls 3 s after step 11, which lets the save of step 10 finish in
    # the background (it commits at a step boundary), then 20 s after step 14 (no effect on the math): the
    # kill lands in that stall, a few steps after the commit, long before the attempt's end sends anything.
    args = [
        *MICRO,
        "steps=60",
        "checkpoint_period=5",
        f"base_output_directory=gs://{bucket}/runs",
        "run_name=k",
        "fault_schedule=step=11,slow_s=3;step=14,slow_s=20",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.train", "base.yml", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    mirror = pod_mirror(tmp_path, "pod", f"gs://{bucket}/runs/k")
    try:
        deadline = time.time() + 300  # a hang guard, not a speed claim
        while time.time() < deadline and proc.poll() is None:
            events = mirror / "events.jsonl"
            text = events.read_text() if events.exists() else ""
            if _stalled_after(text, 14) and _committed_in(text, 10):
                time.sleep(2)  # the upload after the commit has had its chance; the kill comes mid-stall
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.05)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, err[-3000:]

    committed = [
        json.loads(line)["step"]
        for line in gcs_server.read(bucket, "runs/k/events.jsonl").splitlines()
        if json.loads(line)["event"] == "checkpoint_save_committed"
    ]
    assert 10 in committed, committed
    steps = [json.loads(line)["step"] for line in gcs_server.read(bucket, "runs/k/metrics.jsonl").splitlines()]
    assert steps == list(range(1, max(steps) + 1)) and max(steps) >= 10, steps
