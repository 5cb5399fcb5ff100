"""Live metrics: slow-step detection (monitor_step_time_deviation) and the Weights & Biases sink.

The W&B tests run W&B in offline mode and read back what it wrote with W&B's own reader of its run files
(`wandb leet inspect --json`); they skip when the optional `wandb` extra is not installed (.ci/run
installs it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import events, run_cli

from trainer.config.errors import ConfigError
from trainer.config.loader import load_config
from trainer.failures.plan import parse_plan
from trainer.observe.events import EventLog
from trainer.observe.slowsteps import CoordinationHostTimes, SlowStepMonitor


class RecordedEvents:
    def __init__(self):
        self.emitted: list[dict] = []

    def emit(self, event: str, **fields):
        self.emitted.append({"event": event, **fields})
        return self.emitted[-1]


def rows(times: list[float], first_step: int = 1, host: list[float] | None = None) -> list[dict]:
    return [
        {
            "step": first_step + i,
            "step_time_s": t,
            "host_time_s": (host or [0.01] * len(times))[i],
            "time": 1000.0 + i,
        }
        for i, t in enumerate(times)
    ]


# ---- the rule ------------------------------------------------------------------------------------


def test_a_step_slower_than_factor_times_the_recent_median_is_an_event():
    events = RecordedEvents()
    monitor = SlowStepMonitor(3.0, events)
    for r in rows([9.0, 1.0, 1.1, 0.9, 1.0, 1.0, 1.2, 3.5, 1.0, 2.9]):  # step 1 compiles: history only
        monitor.write(r)
    monitor.close()
    assert [(e["event"], e["step"], e["median_s"], e["slowest_process"]) for e in events.emitted] == [
        ("slow_step", 8, 1.0, 0)
    ]


def test_no_events_when_off_and_eval_rows_are_not_steps():
    events = RecordedEvents()
    off = SlowStepMonitor(0.0, events)
    for r in rows([1.0] * 6 + [50.0]):
        off.write(r)
    on = SlowStepMonitor(2.0, events)
    for r in rows([1.0] * 6):
        on.write(r)
    on.write({"kind": "eval", "step": 6, "eval_loss": 2.0, "eval_time_s": 30.0})
    assert events.emitted == []


def test_a_new_attempt_starts_a_fresh_window_so_its_compile_step_is_not_flagged():
    events = RecordedEvents()
    monitor = SlowStepMonitor(3.0, events)
    for r in rows([1.0] * 8):
        monitor.write(r)
    for r in rows([20.0, 1.0, 1.0, 1.0, 1.0, 1.0], first_step=5):  # rewound to step 5, recompiled
        monitor.write(r)
    assert events.emitted == []


class FakeCoordinationService:
    """The two calls of jax.distributed's client the exchange uses, over a dict (one per job)."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.kv
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_several_processes_name_the_process_whose_host_was_slowest():
    service = FakeCoordinationService()
    logs = [RecordedEvents() for _ in range(3)]
    monitors = [
        SlowStepMonitor(3.0, logs[p], process_index=p, host_times=CoordinationHostTimes(service, p))
        for p in range(3)
    ]
    times = [1.0] * 6 + [4.0, 1.0]  # every process sees the same slow step 7: they wait for the straggler
    host = {0: [0.01] * 8, 1: [0.01] * 6 + [3.0, 0.01], 2: [0.02] * 8}  # process 1 stalled before it
    for i in range(len(times)):
        for p, m in enumerate(monitors):  # the processes write each step in lockstep
            m.write(rows(times, host=host[p])[i])
    for p, log in enumerate(logs):
        assert [(e["step"], e["process"], e["slowest_process"]) for e in log.emitted] == [(7, p, 1)]
        assert log.emitted[0]["host_time_s"] == {"0": 0.01, "1": 3.0, "2": 0.02}


def test_an_older_run_of_the_same_step_number_is_not_taken_for_this_one():
    service = FakeCoordinationService()
    stale = CoordinationHostTimes(service, 1)
    stale.publish(7, {"host_time_s": 9.0, "time": 1000.0 - 3600})  # step 7 before a rewind, an hour ago
    events = RecordedEvents()
    monitor = SlowStepMonitor(3.0, events, process_index=0, host_times=CoordinationHostTimes(service, 0))
    for r in rows([1.0] * 6 + [4.0]):
        monitor.write(r)
    monitor.close()
    assert [(e["step"], e["slowest_process"]) for e in events.emitted] == [(7, 0)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("step=5,slow_s=-1", "slow_s a number of seconds > 0"),
        ("step=5,slow_s=2,slice=0", "a slow step is step=N,slow_s=S"),
        ("step=x,slow_s=2", "a slow step is step=N,slow_s=S"),
    ],
)
def test_a_bad_slow_step_fault_is_a_config_error(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_plan(text, 1)


# ---- Weights & Biases ----------------------------------------------------------------------------


def test_enable_wandb_without_the_package_is_a_config_error_naming_the_fix(tmp_path, monkeypatch):
    from trainer import preflight

    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when it is not installed
    cfg = load_config("base.yml", ["enable_wandb=true"])
    with pytest.raises(ConfigError, match=r"enable_wandb=true but the wandb package is not installed.*\[wandb\]"):
        preflight.observe_problems(cfg)


def wandb_records(run_dir: Path) -> list[list[dict]]:
    """The records of every offline W&B run under run_dir, oldest first, as W&B itself reads them."""
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    out = []
    for run in runs:
        proc = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(next(run.glob("*.wandb")))],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append([json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")])
    return out


def history(records: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


def test_wandb_gets_the_tensorboard_scalars_and_events_and_a_restart_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from trainer.observe.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = EventLog(tmp_path / "events.jsonl")
    log.emit("start", steps=3)
    sink = WandbSink(tmp_path, log, project="p", name="fc", config={"steps": 3})
    sink.write({"step": 1, "loss": 4.0, "step_time_s": 0.5, "pid": os.getpid(), "batch_fingerprint": "ab"})
    log.emit("slice_down_detected", step=2, slices=[1])
    sink.write({"step": 2, "loss": 3.0, "step_time_s": 0.4})
    sink.write({"kind": "eval", "step": 2, "eval_loss": 3.5, "eval_perplexity": 33.1})
    sink.close()
    again = WandbSink(tmp_path, log, project="p", name="fc", config={"steps": 3})  # the restarted process
    again.write({"step": 3, "loss": 2.0, "step_time_s": 0.4})
    again.close()
    log.close()

    first, second = wandb_records(tmp_path)
    ids = [next(r["run"] for r in records if r.get("type") == "run") for records in (first, second)]
    assert ids[0]["run_id"] == ids[1]["run_id"] and ids[0]["project"] == "p" and ids[0]["display_name"] == "fc"
    started = [e for e in events(tmp_path) if e["event"] == "wandb_run"]
    assert [(e["run_id"], e["resumed"]) for e in started] == [(ids[0]["run_id"], False), (ids[0]["run_id"], True)]
    h = history(first)
    assert [(r["trainer_step"], r["train/loss"]) for r in h if "train/loss" in r] == [(1, 4.0), (2, 3.0)]
    assert not any("train/pid" in r or "train/batch_fingerprint" in r for r in h)
    assert [(r["trainer_step"], r["eval/loss"], r["eval/perplexity"]) for r in h if "eval/loss" in r] == [
        (2, 3.5, 33.1)
    ]
    assert [r["trainer_step"] for r in h if "events/slice_down_detected" in r] == [2]
    (table,) = (tmp_path / "wandb").glob("offline-run-*/files/media/table/events_*.table.json")
    rows = json.loads(table.read_text())["data"]
    assert [(step, name, json.loads(fields)) for step, name, _, fields in rows] == [
        (0, "start", {"steps": 3}),
        (2, "slice_down_detected", {"step": 2, "slices": [1]}),
    ]
    assert [(r["trainer_step"], r["train/loss"]) for r in history(second) if "train/loss" in r] == [(3, 2.0)]
    assert not [r for r in history(second) if "events/slice_down_detected" in r], "the first process logged it"


# ---- W&B away: the run trains on ----------------------------------------------------------------

# A W&B server that cannot be reached (a closed local port) with a well-formed API key: what a network
# blip or an outage of the service looks like to the client. W&B gives up after WANDB_INIT_TIMEOUT.
UNREACHABLE_WANDB = {
    "WANDB_MODE": "online",
    "WANDB_BASE_URL": "http://127.0.0.1:1",
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
    "WANDB_INIT_TIMEOUT": "5",
    "WANDB_SILENT": "true",
}


@pytest.fixture
def fresh_wandb():
    """W&B keeps process-wide state (its settings, the login) from the first `wandb.init` on: start and
    end each test that sets its environment without it."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    yield wandb
    wandb.teardown()


def test_a_wandb_service_that_cannot_be_reached_is_a_warning_and_the_sink_logs_nothing(
    tmp_path, monkeypatch, caplog, fresh_wandb
):
    from trainer.observe.wandb_sink import WandbSink

    for k, v in UNREACHABLE_WANDB.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login of the machine's user
    log = EventLog(tmp_path / "events.jsonl")
    sink = WandbSink(tmp_path, log, project="p", name="away", config={})
    sink.write({"step": 1, "loss": 4.0})
    sink.close()
    log.close()
    (away,) = [e for e in events(tmp_path) if e["event"] == "wandb_unavailable"]
    assert away["during"] == "start" and away["error"].startswith("CommError") and away["project"] == "p"
    assert not [e for e in events(tmp_path) if e["event"] in ("wandb_run", "wandb_run_closed")]
    assert "W&B unavailable during start: CommError" in caplog.text  # the event, logged as a warning
    said = [
        r.levelname for r in caplog.records if "W&B" in r.getMessage() or "wandb_unavailable" in r.getMessage()
    ]
    assert said == ["WARNING"], caplog.text  # once


def test_wandb_refusing_the_users_login_stops_the_start_naming_the_fix(tmp_path, monkeypatch, fresh_wandb):
    from trainer.errors import UserInputError
    from trainer.observe.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # no terminal to ask for a key at
    log = EventLog(tmp_path / "events.jsonl")
    with pytest.raises(
        UserInputError, match=r"W&B refused to start \(UsageError.*wandb login.*enable_wandb=false"
    ):
        WandbSink(tmp_path, log, project="p", name="nokey", config={})
    log.close()


def test_a_wandb_log_that_fails_mid_run_is_one_warning_and_the_rest_is_not_sent(
    tmp_path, monkeypatch, fresh_wandb
):
    wandb = fresh_wandb
    from trainer.observe.wandb_sink import WandbSink

    class FailingRun:
        logged: list = []

        def define_metric(self, *a, **k):
            pass

        def log(self, row):
            self.logged.append(row)
            raise wandb.errors.CommError("connection reset by peer")

        def finish(self):
            raise AssertionError("a sink that gave up does not finish the run")

    monkeypatch.setattr(wandb, "init", lambda **kwargs: FailingRun())
    log = EventLog(tmp_path / "events.jsonl")
    sink = WandbSink(tmp_path, log, project="p", name="blip", config={})
    sink.write({"step": 1, "loss": 4.0})
    sink.write({"step": 2, "loss": 3.0})
    sink.close()
    log.close()
    assert len(FailingRun.logged) == 1, "nothing more is sent after the first failure"
    (away,) = [e for e in events(tmp_path) if e["event"] == "wandb_unavailable"]
    assert away["during"] == "log" and away["step"] == 1 and "connection reset" in away["error"]


@pytest.mark.slow
def test_a_run_whose_wandb_service_cannot_be_reached_trains_and_warns(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k, v in UNREACHABLE_WANDB.items():  # the CLI's environment is a copy of this one
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(tmp_path))
    proc = run_cli(tmp_path, "w", "steps=4", "enable_wandb=true", "wandb_project=away", devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STATUS: finished step=4" in proc.stdout
    assert re.search(r"^\d\d:\d\d:\d\d WARNING W&B unavailable during start: ", proc.stderr, re.M), proc.stderr
    evs = events(tmp_path / "w")
    assert [e["event"] for e in evs].count("wandb_unavailable") == 1
    assert evs[-1]["event"] == "finish" and evs[-1]["exit_code"] == 0


# ---- the real CLI: an injected slow step, in events.jsonl, W&B and the report -------------------


@pytest.mark.slow
def test_an_injected_slow_step_is_an_event_in_the_log_wandb_and_the_report(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the CLI's environment is a copy of this one
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = [
        "steps=10",
        "num_slices=1",
        "monitor_step_time_deviation=3",
        "fault_schedule=step=8,slow_s=3",
        "enable_wandb=true",
        "wandb_project=live",
    ]
    proc = run_cli(tmp_path, "s", *run, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evs = events(tmp_path / "s")
    assert [(e["step"], e["seconds"]) for e in evs if e["event"] == "host_stalled"] == [(8, 3.0)]
    slow = [e for e in evs if e["event"] == "slow_step"]
    assert 8 in [e["step"] for e in slow], slow
    flagged = next(e for e in slow if e["step"] == 8)
    assert flagged["step_time_s"] > 3 * flagged["median_s"] and flagged["slowest_process"] == 0
    (records,) = wandb_records(tmp_path / "s")
    assert 8 in [r["trainer_step"] for r in history(records) if "events/slow_step" in r]
    assert len([r for r in history(records) if "train/loss" in r]) == 10
    report = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(tmp_path / "s")], capture_output=True, text=True, timeout=300
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert "slow steps" in report.stdout and "step 8 " in report.stdout


def test_host_time_is_the_step_time_less_every_wait_for_the_devices():
    from trainer.attempt.loop import StepRecords, _Pending

    ticks = iter([0.0, 2.0, 2.25])  # start; record: before and after reading the step's metrics
    records = StepRecords(
        flops_per_step=1.0,
        tokens_per_step=8,
        global_batch_size=2,
        devices=1,
        peak_tflops=None,
        timer=lambda: next(ticks),
    )
    records.waited_for_devices(0.5)  # the loop blocked on the step before a save
    metrics = dict.fromkeys(("loss", "learning_rate", "grad_norm", "tokens", "z_loss", "aux_loss", "finite"), 1)
    record = records.record(_Pending(1, metrics, "fp"), skipped_steps=0)
    assert record["step_time_s"] == 2.25
    assert record["host_time_s"] == 2.25 - 0.25 - 0.5
