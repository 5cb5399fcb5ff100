"""Metrics records, sinks and the MFU peak table."""

import json
import logging

import pytest

from trainer.observe.events import EventLog, read_events
from trainer.observe.peaks import peak_tflops
from trainer.observe.sinks import JsonlSink, LogSink, Sinks
from trainer.observe.spans import Span, closed, spans


def test_peak_table_covers_tpus_and_gpus_and_cpu_is_none():
    assert peak_tflops("TPU v5 lite") == 197.0
    assert peak_tflops("TPU v5p") == 459.0 and peak_tflops("TPU v4") == 275.0
    assert peak_tflops("TPU v6 lite") == 918.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA B200") == 2250.0
    assert peak_tflops("cpu") is None
    assert peak_tflops("cpu", override=0.3) == 0.3


def test_event_log_appends_json_lines_with_time_and_pid(tmp_path):
    clock = iter([10.0, 11.5])
    log = EventLog(tmp_path / "events.jsonl", clock=lambda: next(clock))
    log.emit("start", run_name="x")
    log("checkpoint_save_start", {"step": 3})
    log.close()
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["event"], e["time"]) for e in events] == [("start", 10.0), ("checkpoint_save_start", 11.5)]
    assert events[1]["step"] == 3 and "pid" in events[0]


def test_read_events_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"event": "start", "time": 1}) + '\n{"event": "fin')
    assert [e["event"] for e in read_events(path)] == ["start"]


def test_log_sink_prints_every_period_and_the_last_step(caplog):
    record = {
        "step": 3,
        "loss": 1.0,
        "learning_rate": 1e-3,
        "grad_norm": 0.5,
        "step_time_s": 0.1,
        "tokens_per_s": 10.0,
        "tflops_per_device": 0.01,
        "mfu": None,
    }
    sink = LogSink(period=5)
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        sink.write(record)
        sink.write({**record, "step": 5})
        sink.write({**record, "step": 7, "last": True})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("step=5 ") and "mfu=null" in lines[0]
    assert lines[1].startswith("step=7 ")


def test_jsonl_sink_writes_one_object_per_record(tmp_path):
    sinks = Sinks([JsonlSink(tmp_path / "m.jsonl")])
    sinks.write({"step": 1, "loss": 2.0, "mfu": None})
    sinks.write({"step": 2, "loss": 1.5, "mfu": 0.4})
    sinks.close()
    rows = [json.loads(l) for l in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["mfu"] is None


def test_remote_run_directory_mirrors_logs_and_sends_checkpoints_to_the_store(tmp_path, monkeypatch):
    from etils import epath

    from trainer.observe.rundir import RunPaths, run_paths

    monkeypatch.setenv("TRAINER_LOCAL_RUN_ROOT", str(tmp_path / "local"))
    paths = run_paths("gs://bucket/runs", "r1")
    assert str(paths.checkpoints) == "gs://bucket/runs/r1/checkpoints"
    assert paths.local == tmp_path / "local" / "trainer_runs" / "gs_bucket_runs_r1"
    # The copy itself, with a local directory standing in for the object store:
    mirror = RunPaths(
        local=tmp_path / "run",
        checkpoints=epath.Path(tmp_path / "store" / "checkpoints"),
        remote=epath.Path(tmp_path / "store"),
    )
    (mirror.local / "tensorboard").mkdir(parents=True)
    (mirror.local / "metrics.jsonl").write_text('{"step": 1}\n')
    (mirror.local / "tensorboard" / "events.out").write_bytes(b"tb")
    (mirror.local / "chaos").mkdir()
    (mirror.local / "chaos" / "req.json").write_text("{}")
    mirror.sync()
    assert (tmp_path / "store" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "store" / "tensorboard" / "events.out").read_bytes() == b"tb"
    assert not (tmp_path / "store" / "chaos").exists()
    # Only what changed goes up again, and a sync asked for too soon after the last sends nothing: a run
    # that recovers hundreds of times does not upload its whole logs at every recovery.
    with (mirror.local / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2}\n')
    assert mirror.sync(min_interval_s=3600) == 0
    assert mirror.sync() == len('{"step": 1}\n{"step": 2}\n')  # metrics only, not the TensorBoard file
    assert (tmp_path / "store" / "metrics.jsonl").read_text().count("step") == 2
    assert mirror.sync() == 0


def test_local_run_directory_is_used_as_is(tmp_path):
    from trainer.observe.rundir import run_paths

    paths = run_paths(str(tmp_path), "r2")
    assert paths.remote is None and paths.local == tmp_path / "r2"
    assert str(paths.checkpoints) == str(tmp_path / "r2" / "checkpoints")


def test_goodput_counts_a_save_as_badput_only_beyond_waiting_for_the_step_it_saves():
    from trainer.observe.goodput import account

    events = [
        {"event": "start", "time": 0.0},
        {"event": "attempt_start", "time": 1.0},
        {"event": "checkpoint_save_blocked", "time": 3.5, "step": 2, "seconds": 0.5, "waited_for_step_s": 0.4},
        {"event": "finish", "time": 5.0},
    ]
    steps = [{"step": s, "step_time_s": t, "time": 1.0 + s} for s, t in ((1, 1.0), (2, 1.0), (3, 1.5), (4, 0.5))]
    out = account(events, steps)
    # 4 s of steps; only the 0.1 s the save itself held the loop is not productive.
    assert out["badput_s"]["checkpoint_save"] == pytest.approx(0.1)
    assert out["productive_s"] == pytest.approx(3.9)


def test_spans_pair_each_end_with_the_newest_open_start_and_keep_the_last_one_open():
    def ev(name, t):
        return {"event": name, "time": t}

    w0, w1, w2, e1 = ev("wait_start", 1.0), ev("wait_start", 2.0), ev("wait_start", 9.0), ev("wait_end", 5.0)
    events = [ev("wait_end", 0.5), w0, w1, ev("restore_start", 3.0), e1, ev("wait_end", 6.0), w2]
    # the end before any start and the second end after it are ignored; w0, never ended, is replaced by w1
    assert spans(events, "wait_start", "wait_end") == [Span(2.0, e1), Span(9.0, None)]
    assert [(s.start, s.end, s.seconds) for s in spans(events, "wait_start", "wait_end")] == [
        (2.0, 5.0, 3.0),
        (9.0, None, None),
    ]
    assert closed(events, "wait_start", "wait_end") == [Span(2.0, e1)]
    assert spans(events, "restore_start", "restore_end") == [Span(3.0, None)]
