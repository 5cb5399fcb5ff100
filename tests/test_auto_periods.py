"""`auto` save periods: planned from the run's measured costs by trainer.plan's model, with the snapshot
floor; the step boundary takes a planned tier's saves a period after the previous one."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import auto_periods

from trainer.config import ConfigError, load_config
from trainer.config.schema import AUTO
from trainer.elastic.periods import WARMUP_STEPS, AutoPeriods, FixedPeriods
from trainer.plan import model
from trainer.plan.auto import plan, snapshot_floor

COSTS = model.Costs(step_s=0.5, snapshot_save_s=0.1, snapshot_write_s=0.6, checkpoint_save_s=2.0)


class Events:
    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": str(event), **fields})


def test_auto_is_the_elastic_default_and_parses_from_text():
    assert load_config("base.yml").elastic.snapshot_period == AUTO
    cfg = load_config("base.yml", ["local_checkpoint_period=auto", "local_checkpoint_directory=/tmp/x"])
    assert cfg.checkpoint.local_checkpoint_period == AUTO
    assert load_config("base.yml", ["snapshot_period=7"]).elastic.snapshot_period == 7
    assert load_config("base.yml").checkpoint.checkpoint_period == AUTO
    assert load_config("base.yml", ["checkpoint_period=500"]).checkpoint.checkpoint_period == 500
    with pytest.raises(ConfigError, match="checkpoint_period=0"):
        load_config("base.yml", ["checkpoint_period=0"])


def test_the_snapshot_floor_bounds_the_overhead_and_waits_for_the_previous_copy():
    # 0.1 s per snapshot at 5% of a 0.5 s step: every 4 steps; the 0.6 s copy needs 2 steps.
    assert snapshot_floor(COSTS, 0.05) == 4
    assert snapshot_floor(dataclasses.replace(COSTS, snapshot_write_s=2.6), 0.05) == 6
    assert snapshot_floor(dataclasses.replace(COSTS, snapshot_save_s=0.0, snapshot_write_s=0.0), 0.05) == 1
    assert snapshot_floor(COSTS, 0.0) is None


def test_a_plan_is_the_models_recommendation_with_the_floor_and_keeps_given_periods():
    kwargs = dict(slices=2, steps=10_000, mode="pause_resume", enabled=("snapshot", "checkpoint"))
    rare = plan(COSTS, mtbf_per_slice_s=1e8, fixed={"checkpoint": 500}, max_overhead=0.05, **kwargs)
    periods, _ = model.recommend(
        COSTS, model.Failures(2, 1e8), 10_000, "pause_resume", available=("snapshot", "checkpoint"),
        fixed={"checkpoint": 500},
    )  # fmt: skip
    assert rare.recommended["snapshot"] == periods.snapshot > 4
    assert rare.periods["snapshot"] == 4 and rare.periods["checkpoint"] == 500  # floor; given kept
    off = plan(COSTS, mtbf_per_slice_s=1e8, fixed={"checkpoint": 500}, max_overhead=0.0, **kwargs)
    assert off.periods["snapshot"] == periods.snapshot
    # A failure every 10 s: the model's own period is shorter than the floor, and it wins.
    often = plan(COSTS, mtbf_per_slice_s=20.0, fixed={"checkpoint": 500}, max_overhead=0.05, **kwargs)
    assert often.periods["snapshot"] == often.recommended["snapshot"] < 4


def _auto(measure, events, **kw):
    clock = [0.0]
    return auto_periods(measure, events, **{"clock": lambda: clock[0], **kw}), clock


def _run(periods, steps):
    """Steps through a boundary's calls; returns the steps that saved."""
    saved = []
    for step in steps:
        periods.after_step(step)
        if periods.due("snapshot", step):
            saved.append(step)
            periods.saved(step, persisted=False)
    return saved


def test_warm_up_snapshots_every_other_step_then_plans_and_reschedules_from_the_last_save():
    events = Events()
    failures = [0]
    periods, clock = _auto(lambda: (COSTS, failures[0]), events)
    periods.attempt_started(0)
    # Step 8 plans first: the new period (4) counts from the save at step 6.
    assert _run(periods, range(1, WARMUP_STEPS + 1)) == [2, 4, 6]
    planned = [e for e in events.records if e["event"] == "periods_planned"]
    assert len(planned) == 1 and planned[0]["step"] == WARMUP_STEPS and planned[0]["rate"] == "expected"
    assert planned[0]["snapshot_period"] == 4  # the floor: the model alone would wait far longer
    assert planned[0]["mtbf_per_slice_s"] == pytest.approx(50_000 * 3600 / 4)
    assert _run(periods, range(9, 17)) == [10, 14]
    # A failure: the next attempt restores step 14 and plans after its warm-up at the observed rate.
    failures[0], clock[0] = 1, 10.0
    periods.attempt_started(14)
    assert _run(periods, range(15, 15 + WARMUP_STEPS)) == [18, 22]
    observed = [e for e in events.records if e["event"] == "periods_planned"][-1]
    assert observed["rate"] == "observed" and observed["mtbf_per_slice_s"] == pytest.approx(20.0)
    assert observed["step"] == 14 + WARMUP_STEPS and observed["snapshot_period"] < 4


def _checkpoints(periods, steps):
    """Steps through the loop's and the boundary's calls; returns the steps the persistent tier saved."""
    saved = []
    for step in steps:
        if periods.checkpoint_due(step):
            saved.append(step)
        periods.after_step(step)
    return saved


def test_the_persistent_tier_saves_once_in_the_warm_up_then_at_its_planned_period():
    """checkpoint_period=auto: one save in the warm-up measures its cost; the plan weighs it against the
    share of failures that take the process down (the others are recovered from snapshots)."""
    events = Events()
    periods, _ = _auto(lambda: (COSTS, 0), events, checkpoint=AUTO, steps=100_000, process_kill_share=0.1)
    periods.attempt_started(0)
    assert _checkpoints(periods, range(1, WARMUP_STEPS + 1)) == [WARMUP_STEPS // 2]
    planned = [e for e in events.records if e["event"] == "periods_planned"][-1]
    expected, _ = model.recommend(
        COSTS, model.Failures(2, 50_000 * 3600 / 4, 0.1), 100_000, "pause_resume",
        available=("snapshot", "checkpoint"),
    )  # fmt: skip
    period = planned["checkpoint_period"]
    assert period == expected.checkpoint == planned["recommended"]["checkpoint_period"]
    assert WARMUP_STEPS < period < 100_000 and planned["process_kill_share"] == 0.1
    # The next saves count from the warm-up's.
    saved = _checkpoints(periods, range(WARMUP_STEPS + 1, 4 + 2 * period + 1))
    assert saved == [4 + period, 4 + 2 * period]
    # Rarer process kills: a longer period.
    rare, _ = _auto(lambda: (COSTS, 0), Events(), checkpoint=AUTO, steps=100_000, process_kill_share=0.01)
    rare.attempt_started(0)
    _checkpoints(rare, range(1, WARMUP_STEPS + 1))
    assert rare.current["checkpoint"] > period


def test_an_unmeasured_save_keeps_the_unplanned_period_and_the_next_attempt_measures_again():
    unmeasured = dataclasses.replace(COSTS, checkpoint_save_s=0.0)
    costs = [unmeasured]
    events = Events()
    periods, _ = _auto(lambda: (costs[0], 0), events, checkpoint=AUTO, steps=100_000, process_kill_share=0.1)
    periods.attempt_started(0)
    assert _checkpoints(periods, range(1, 20)) == [4]
    assert periods.current["checkpoint"] == 10_000 and periods.current["snapshot"] < 10_000
    periods.attempt_started(19)  # after a failure: the warm-up saves again, and this time it is measured
    costs[0] = COSTS
    assert _checkpoints(periods, range(20, 20 + WARMUP_STEPS)) == [23]
    planned = [e for e in events.records if e["event"] == "periods_planned"][-1]
    assert periods.checkpoint_measured and planned["step"] == 19 + WARMUP_STEPS
    assert periods.current["checkpoint"] == planned["recommended"]["checkpoint_period"] != 10_000


def test_given_periods_are_never_planned_and_a_full_restart_run_takes_no_snapshots():
    events = Events()
    periods, _ = _auto(lambda: (COSTS, 0), events, snapshot=3)
    periods.attempt_started(0)
    assert _run(periods, range(1, 20)) == [3, 6, 9, 12, 15, 18] and not events.records
    restart, _ = _auto(lambda: (COSTS, 0), events, mode="full_restart")
    restart.attempt_started(0)
    assert _run(restart, range(1, 20)) == [] and not events.records


def test_a_failing_measurement_keeps_the_current_periods():
    def broken():
        raise OSError("metrics.jsonl vanished")

    periods, _ = _auto(broken, Events())
    periods.attempt_started(0)
    assert _run(periods, range(1, 13)) == [2, 4, 6, 8, 10, 12]


def test_fixed_periods_save_at_multiples():
    fixed = FixedPeriods(snapshot=5, local=10)
    assert [s for s in range(1, 21) if fixed.due("snapshot", s)] == [5, 10, 15, 20]
    assert [s for s in range(1, 21) if fixed.due("local", s)] == [10, 20]
    assert math.isclose(snapshot_floor(COSTS, 1.0), 2)


def test_several_processes_take_numbers_only(tmp_path):
    """Each process would plan from its own costs, but every process must snapshot the same steps."""
    from trainer.observe.rundir import run_paths
    from trainer.run import backend_for, save_periods

    two = ["num_processes=2", "process_id=0", "coordinator_address=localhost:1"]
    slices = [[object()], [object()]]
    cfg = load_config("base.yml", ["elastic_enabled=true", "num_slices=2", *two])
    paths = run_paths(str(tmp_path), "r")
    fixed = save_periods(cfg, slices, paths, Events(), backend_for(cfg))
    assert fixed == FixedPeriods(0, 0) and fixed.checkpoint_due is None  # checkpoint_period=auto: 10,000
    local = load_config(
        "base.yml",
        ["local_checkpoint_directory=/tmp/node", "local_checkpoint_period=auto", "snapshot_period=2", *two],
    )
    with pytest.raises(ConfigError, match="local_checkpoint_period=auto needs one controller"):
        save_periods(
            local,
            slices,
            run_paths(str(tmp_path), "r", local_checkpoint_directory="/tmp/node"),
            Events(),
            backend_for(local),
        )


def test_the_live_measurement_reads_the_runs_start_and_recent_past_only(tmp_path):
    """Planning after thousands of recoveries must not re-read (and hold) the whole run log."""
    import json

    from trainer.observe.runlog import load_run
    from trainer.plan.costs import measure

    events = [{"event": "start", "time": 0.0}, {"event": "attempt_start", "time": 1.0, "start_step": 0}]
    events += [{"event": "snapshot_taken", "time": 1.0 + s, "step": s, "seconds": 0.01} for s in range(1, 5000)]
    rows = [{"step": s, "time": 1.0 + s, "step_time_s": 0.5, "loss": 1.0} for s in range(1, 5000)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path, window_bytes=20_000)
    assert run.events[0]["event"] == "start" and run.events[-1] == events[-1]
    assert len(run.events) < 1000 and run.records[-1]["step"] == 4999 and len(run.records) < 1000
    costs, _ = measure(run)
    assert costs.step_s == pytest.approx(0.5)


def test_the_trainer_measures_itself_through_the_bounded_window_and_counts_every_failure(monkeypatch, tmp_path):
    """The planner's `measure` (built by trainer.run.save_periods) reads the logs' ends only, yet counts
    the failures of the whole run, as events.jsonl grows."""
    import json

    import trainer.observe.runlog as runlog
    from trainer.checkpoint.checkpointer import UNPLANNED_CHECKPOINT_PERIOD as checkpointer_default
    from trainer.elastic.periods import UNPLANNED_CHECKPOINT_PERIOD
    from trainer.observe.rundir import run_paths
    from trainer.run import MEASURE_WINDOW_BYTES, backend_for, save_periods

    assert UNPLANNED_CHECKPOINT_PERIOD == checkpointer_default  # the planner's and the checkpointer's default
    cfg = load_config("base.yml", ["elastic_enabled=true", "num_slices=2"])
    paths = run_paths(str(tmp_path), "r")
    paths.local.mkdir(parents=True, exist_ok=True)
    down = {"event": "slice_down_detected", "time": 2.0}
    lines = [{"event": "attempt_start", "time": 1.0}, *[down] * 3]
    (paths.local / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    (paths.local / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 1.5, "step_time_s": 0.5}) + "\n")
    windows = []
    real = runlog.load_run
    monkeypatch.setattr(runlog, "load_run", lambda d, **kw: windows.append(kw) or real(d, **kw))
    periods = save_periods(cfg, [[object()], [object()]], paths, Events(), backend_for(cfg))
    assert isinstance(periods, AutoPeriods) and periods.measure()[1] == 3
    with open(paths.local / "events.jsonl", "a") as f:
        f.write(json.dumps(down) + "\n")
    assert periods.measure()[1] == 4
    assert windows == [{"window_bytes": MEASURE_WINDOW_BYTES}] * 2
