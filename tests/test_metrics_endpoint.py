"""The live metrics endpoint (metrics_port): the values a scrape shows, from made-up events and rows, the
Prometheus text the endpoint serves, and a taken port as a config error before the run starts."""

from __future__ import annotations

import socket
import urllib.request
from types import SimpleNamespace

import pytest
from helpers import auto_periods
from prometheus_client.parser import text_string_to_metric_families

from trainer.config.errors import ConfigError
from trainer.errors import EXIT_BAD_INPUT, exit_code_for
from trainer.observe import catalogue
from trainer.observe.events import EventLog
from trainer.observe.goodput import CAUSES, account
from trainer.observe.metrics import BADPUT_TYPES, live_values
from trainer.observe.metrics_server import Endpoint, LiveMetrics
from trainer.run import serve_metrics


def ev(name, t, **fields):
    return {"event": str(name), "time": t, "pid": 1, **fields}


def row(step, t, *, loss=2.0, step_time_s=1.0, **more):
    return {
        "step": step,
        "time": t,
        "loss": loss,
        "learning_rate": 1e-3,
        "tokens_per_s": 500.0,
        "mfu": 0.25,
        "step_time_s": step_time_s,
        "grad_norm": 1.0,
        **more,
    }


# A run that starts, trains 3 steps, commits a checkpoint of step 2, loses a slice, restores step 2 from
# a snapshot on 1 of 2 slices and trains step 3 again; then a restarted process resumes from the
# checkpoint. The planner's expectation is in its periods_planned event.
EVENTS = [
    ev(catalogue.START, 0.0, steps=10),
    ev(catalogue.ATTEMPT_START, 5.0, attempt=1, slices=[0, 1], start_step=0, source="init", steps_rewound=0),
    ev(catalogue.CHECKPOINT_SAVE_COMMITTED, 8.0, step=2, seconds=0.5, bytes=1),
    ev(catalogue.PERIODS_PLANNED, 8.5, step=2, expected_goodput=0.81),
    ev(catalogue.SLICE_DOWN_DETECTED, 9.0, attempt=1, last_step=3, slices=[0, 1], cause="slice_lost"),
    ev(catalogue.WAIT_END, 9.5, active=[0], seconds=0.2),
    ev(catalogue.ATTEMPT_START, 10.0, attempt=2, slices=[0], start_step=2, source="snapshot:2", steps_rewound=1),
    ev(catalogue.RESTART_RESUMED, 20.0, last_step=3, start_step=2, source="checkpoint:2", steps_lost=1),
    ev(
        catalogue.ATTEMPT_START,
        20.0,
        attempt=1,
        slices=[0, 1],
        start_step=2,
        source="checkpoint:2",
        steps_rewound=1,
    ),
]
ROWS = [row(1, 6.0), row(2, 7.0), row(3, 8.0), row(3, 11.0, loss=1.5, step_time_s=0.75)]


def test_step_gauges_are_the_newest_step_rows_and_eval_rows_are_not_steps():
    rows = [*ROWS, {"kind": "eval", "step": 3, "time": 12.0, "eval_loss": 1.9, "eval_time_s": 0.5}]
    v = live_values(EVENTS, rows, now=30.0)
    assert (v.step, v.loss, v.step_time_s) == (3, 1.5, 0.75)
    assert (v.learning_rate, v.tokens_per_s, v.mfu) == (1e-3, 500.0, 0.25)


def test_goodput_and_badput_are_the_goodput_accounts_up_to_now():
    v = live_values(EVENTS, ROWS, now=30.0)
    expected = account(EVENTS, ROWS, now=30.0)
    assert v.goodput == pytest.approx(expected["goodput"]) and v.wall_s == pytest.approx(30.0)
    assert v.badput_s == expected["badput_s"] and v.badput_s["wasted_progress"] == pytest.approx(1.0)
    assert live_values(EVENTS, ROWS, now=60.0).goodput < v.goodput  # no progress since: goodput falls


def test_recoveries_failures_steps_lost_slices_saves_and_the_planners_goodput():
    v = live_values(EVENTS, ROWS, now=30.0)
    assert v.recoveries == {"snapshot": 1, "restart": 1}  # the first attempt of a run is no recovery
    assert v.failures == {"slice_lost": 1}
    assert v.steps_lost == 2
    assert v.slices == 2  # the newest attempt's
    assert v.seconds_since_save == {"checkpoint": pytest.approx(22.0)}
    assert v.predicted_goodput == 0.81


def test_a_run_with_nothing_yet_has_no_step_no_goodput_and_no_plan():
    v = live_values([], [], now=1.0)
    assert (v.step, v.goodput, v.predicted_goodput, v.slices) == (None, None, None, None)


def test_every_goodput_cause_has_an_ml_goodput_measurement_name():
    assert set(BADPUT_TYPES) == set(CAUSES)
    assert BADPUT_TYPES["checkpoint_save"] == "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"


def _scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_endpoint_serves_rows_and_events_fed_to_it_after_those_it_started_with(tmp_path):
    clock = iter([30.0, 40.0]).__next__
    live = LiveMetrics(events=EVENTS[:3], rows=ROWS[:2], clock=clock)
    events = EventLog(tmp_path / "events.jsonl", clock=lambda: 35.0)
    events.subscribe(live.on_event)
    endpoint = Endpoint(live, 0, addr="127.0.0.1")
    try:
        got = _scrape(endpoint.port)
        assert got["trainer_step"][0].value == 2 and "trainer_predicted_goodput" not in got
        live.write(row(3, 8.0, loss=1.25))
        events.emit(catalogue.PERIODS_PLANNED, step=3, expected_goodput=0.9)
        got = _scrape(endpoint.port)
    finally:
        endpoint.close()
    assert got["trainer_step"][0].value == 3 and got["trainer_loss"][0].value == 1.25
    assert got["trainer_predicted_goodput"][0].value == 0.9
    assert 0 < got["trainer_goodput"][0].value < 1
    badput = {s.labels["cause"]: s.labels["badput_type"] for s in got["trainer_badput_seconds"]}
    assert badput == BADPUT_TYPES
    assert got["trainer_seconds_since_save"][0].labels == {"tier": "checkpoint"}
    assert got["trainer_seconds_since_save"][0].value == pytest.approx(32.0)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=2)  # closed: gone


class _Root:
    """What serve_metrics reads of the process root."""

    def __init__(self, run_dir, process_id=0):
        self.backend = SimpleNamespace(process_id=process_id)
        self.paths = SimpleNamespace(local=run_dir)
        self.events = EventLog(run_dir / "events.jsonl")
        self.held = []

    def hold(self, close):
        self.held.append(close)


def test_a_taken_port_is_a_config_error_naming_the_key_and_the_fix(tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics_port={port}.*metrics_port=0") as e:
            serve_metrics(port, _Root(tmp_path))
    assert exit_code_for(e.value) == EXIT_BAD_INPUT


def test_the_endpoint_runs_on_process_0_only_and_lives_as_long_as_the_process_root(tmp_path):
    assert serve_metrics(0, _Root(tmp_path)) is None
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
    assert serve_metrics(port, _Root(tmp_path, process_id=1)) is None
    root = _Root(tmp_path)
    root.events.emit(catalogue.START, steps=3)
    live = serve_metrics(port, root)
    root.events.emit(catalogue.PERIODS_PLANNED, step=1, expected_goodput=0.5)
    assert live.values().predicted_goodput == 0.5  # subscribed to the run's events
    assert len(live.values().badput_s) == len(CAUSES)  # and it read the run's events.jsonl so far
    assert _scrape(port)["trainer_predicted_goodput"][0].value == 0.5
    for close in root.held:
        close()
    with pytest.raises(OSError):
        _scrape(port)


def test_each_plan_of_the_periods_carries_the_models_goodput_at_the_periods_it_chose():
    from trainer.elastic.periods import WARMUP_STEPS
    from trainer.plan import model
    from trainer.plan.auto import plan

    costs = model.Costs(step_s=0.5, snapshot_save_s=0.1, snapshot_write_s=0.6, checkpoint_save_s=2.0)
    p = plan(
        costs,
        slices=2,
        mtbf_per_slice_s=3600.0,
        steps=1000,
        mode="pause_resume",
        enabled=("snapshot", "checkpoint"),
        fixed={"checkpoint": 500},
        max_overhead=0.05,
    )
    chosen = model.expected(costs, model.Failures(2, 3600.0), model.Periods(**p.periods), 1000, "pause_resume")
    assert p.expected_goodput == pytest.approx(chosen.goodput) and 0 < p.expected_goodput < 1
    events = EventLog(None)
    live = LiveMetrics()
    events.subscribe(live.on_event)
    periods = auto_periods(lambda: (costs, 0), events, checkpoint=500, mtbf_per_chip_s=4 * 3600.0)
    periods.attempt_started(0)
    for step in range(1, WARMUP_STEPS + 1):
        periods.after_step(step)
    assert live.values().predicted_goodput == pytest.approx(p.expected_goodput, abs=1e-4)


@pytest.mark.slow
def test_the_cli_exits_2_before_training_when_the_metrics_port_is_taken(tmp_path):
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [
            "model=qwen3-tiny",
            "steps=2",
            f"base_output_directory={tmp_path}",
            "run_name=r",
            f"metrics_port={port}",
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "trainer.train", "base.yml", *argv], capture_output=True, text=True, timeout=300
        )
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("STATUS: config_error")
    assert f"metrics_port={port}" in proc.stdout + proc.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # nothing trained
