"""The goodput planner: the simulator against closed-form cases, its measured costs, the seeded Poisson
fault source, and the `python -m trainer.plan` command line."""

import json
import math
import re
import subprocess
import sys

import pytest

from trainer.config.errors import ConfigError
from trainer.failures.plan import parse_plan
from trainer.failures.slice_loss import PoissonFaults, RandomSliceLoss
from trainer.observe.goodput import CAUSES
from trainer.plan import model
from trainer.plan.model import Costs, Failures, Periods

COSTS = Costs(
    step_s=0.5,
    startup_s=30.0,
    step_gap_s=0.01,
    tail_s=2.0,
    first_step_extra_s=1.5,
    checkpoint_save_s=4.0,
    snapshot_save_s=0.2,
    checkpoint_restore_s=6.0,
    snapshot_restore_s=1.0,
    detect_s=3.0,
    reschedule_s=20.0,
)
NO_FAILURES = Failures(slices=4)


def test_without_failures_the_run_is_startup_steps_saves_and_tail():
    steps, periods = 100, Periods(checkpoint=30, snapshot=10)
    want_saves = 4 * COSTS.checkpoint_save_s  # steps 30, 60, 90 and the final step
    want_productive = steps * COSTS.step_s + 10 * COSTS.snapshot_save_s + COSTS.first_step_extra_s
    want_wall = COSTS.startup_s + want_productive + want_saves + steps * COSTS.step_gap_s + COSTS.tail_s
    for outcome in (
        model.expected(COSTS, NO_FAILURES, periods, steps, "pause_resume"),
        model.simulate(COSTS, NO_FAILURES, periods, steps, "pause_resume", trials=1),
    ):
        assert outcome.failures == 0
        assert outcome.productive_s == pytest.approx(want_productive)
        assert outcome.wall_s == pytest.approx(want_wall)
        assert outcome.badput_s["checkpoint_save"] == pytest.approx(want_saves)
        assert outcome.badput_s["wasted_progress"] == 0


def test_a_period_longer_than_the_run_saves_only_the_final_step():
    failures = Failures(slices=4, mtbf_per_slice_s=400.0)
    longer = model.expected(COSTS, failures, Periods(checkpoint=10_000), 100, "full_restart")
    final_only = model.expected(COSTS, failures, Periods(checkpoint=100), 100, "full_restart")
    assert longer.wall_s == pytest.approx(final_only.wall_s)


def test_one_failure_at_a_known_step_rewinds_to_the_newest_snapshot_and_pays_each_phase_once():
    steps, periods = 50, Periods(checkpoint=50, snapshot=10)
    per_step = COSTS.step_s + COSTS.step_gap_s
    # Step 1 is slower (first step), step 10 started a snapshot; the failure falls inside step 24.
    t_fail = 23 * per_step + COSTS.first_step_extra_s + COSTS.snapshot_save_s * 2 + 0.2
    out = model.replay(COSTS, Failures(slices=4, mtbf_per_slice_s=1e9), periods, steps, "pause_resume", [t_fail])
    assert out.failures == 1
    # Noticed after step 24 completes; restored from the snapshot of step 20: steps 21..24 rewound.
    assert out.badput_s["wasted_progress"] == pytest.approx(4 * COSTS.step_s)
    assert out.badput_s["restore"] == pytest.approx(COSTS.snapshot_restore_s)
    assert out.badput_s["waiting_for_slices"] == pytest.approx(COSTS.reschedule_s)
    no_failure = model.replay(COSTS, Failures(slices=4), periods, steps, "pause_resume", [])
    recovery = COSTS.detect_s + COSTS.reschedule_s + COSTS.snapshot_restore_s + COSTS.first_step_extra_s
    assert out.wall_s - no_failure.wall_s == pytest.approx(recovery + 4 * per_step)


def test_one_failure_under_full_restart_pays_startup_again_and_rewinds_to_the_checkpoint():
    steps, periods = 50, Periods(checkpoint=15, snapshot=10)
    costs = Costs(step_s=1.0, startup_s=30.0, restart_s=60.0, checkpoint_restore_s=6.0, detect_s=3.0)
    out = model.replay(costs, Failures(slices=2, mtbf_per_slice_s=1e9), periods, steps, "full_restart", [23.5])
    assert out.badput_s["wasted_progress"] == pytest.approx(9 * costs.step_s)  # step 24 back to 15
    assert out.badput_s["startup_compile"] == pytest.approx(2 * costs.startup_s)
    assert out.badput_s["other"] == pytest.approx(costs.detect_s + costs.restart_s)
    assert out.badput_s["restore"] == pytest.approx(costs.checkpoint_restore_s)


def test_the_planner_gives_up_by_the_trainers_rule_failures_faster_than_progress_not_failures_spread():
    from trainer.elastic.retry_budget import RetryBudget

    budget = RetryBudget(max_retries=10, window_steps=50)
    costs = Costs(step_s=1.0, detect_s=0.5)
    failures = Failures(slices=2, mtbf_per_slice_s=1e9)
    periods = Periods(checkpoint=1000, snapshot=1)
    # Twelve failures spread over a 130-step run (one every ~10 steps): it finishes.
    spread = [10.5 * k for k in range(1, 13)]
    out = model.replay(costs, failures, periods, 130, "pause_resume", spread, budget=budget)
    assert out.failures == 12 and out.gave_up == 0
    # Twelve in a burst, one per step (each its own recovery): the eleventh ends the run, as the trainer's
    # supervisor would.
    burst = [20.2 + 1.5 * k for k in range(12)]
    out = model.replay(costs, failures, periods, 130, "pause_resume", burst, budget=budget)
    assert out.gave_up == 1 and out.failures == 11


def test_the_defaults_never_give_up_at_the_failure_rates_of_the_docs_table():
    # docs/running_at_scale.md: 1,000,000 steps with 2, 19 and 100 failures per run (1k, 10k, 50k chips).
    for failures in (2, 19, 100):
        assert model.give_up_chance(failures, 1_000_000, model.DEFAULT_BUDGET) < 1e-12
    assert model.give_up_chance(1_000, 1_000, model.DEFAULT_BUDGET) > 0.999  # one failure per step: hopeless


def test_young_daly_optimum_for_a_single_tier():
    costs = Costs(step_s=1.0, checkpoint_save_s=10.0, checkpoint_restore_s=5.0, restart_s=30.0)
    failures = Failures(slices=1, mtbf_per_slice_s=20_000.0)
    periods, _ = model.recommend(costs, failures, 1_000_000, "full_restart", available=("checkpoint",))
    young_daly = math.sqrt(2 * costs.checkpoint_save_s * failures.mtbf_per_slice_s) / costs.step_s  # 632
    assert periods.checkpoint == pytest.approx(young_daly, rel=0.1)
    assert (periods.local, periods.snapshot) == (0, 0)
    wall = {
        p: model.expected(costs, failures, Periods(p), 1_000_000, "full_restart").wall_s for p in (316, 632, 1264)
    }
    assert wall[632] < wall[316] and wall[632] < wall[1264]


@pytest.mark.parametrize("mode", model.MODES)
def test_closed_form_agrees_with_the_monte_carlo_replay(mode):
    failures = Failures(slices=4, mtbf_per_slice_s=400.0, process_kill_share=0.2)
    periods = Periods(checkpoint=40, snapshot=5)
    closed = model.expected(COSTS, failures, periods, 400, mode)
    sim = model.simulate(COSTS, failures, periods, 400, mode, trials=300, seed=3)
    assert closed.failures > 2  # failures matter in this case
    assert closed.goodput == pytest.approx(sim.goodput, abs=0.02)
    # A failure every ~100 s against ~40 s full restarts: the renewal closed form drifts a few percent.
    assert closed.wall_s == pytest.approx(sim.wall_s, rel=0.07)


def test_badput_causes_are_the_reports_categories():
    out = model.expected(COSTS, Failures(4, 400.0, 0.2), Periods(40, 10, 5), 400, "replica_resize")
    assert set(out.badput_s) <= set(CAUSES)
    assert out.productive_s + sum(out.badput_s.values()) == pytest.approx(out.wall_s)


def test_replica_resize_beats_pause_and_resume_when_slices_are_slow_to_return():
    failures = Failures(slices=8, mtbf_per_slice_s=2000.0)
    periods = Periods(checkpoint=100, snapshot=5)
    slow = Costs(step_s=0.5, reschedule_s=120.0, snapshot_restore_s=1.0, detect_s=2.0)
    resize = model.expected(slow, failures, periods, 2000, "replica_resize")
    pause = model.expected(slow, failures, periods, 2000, "pause_resume")
    assert resize.useful_goodput > pause.useful_goodput
    resize_wait, pause_wait = (o.badput_s["waiting_for_slices"] / o.failures for o in (resize, pause))
    assert resize_wait == pytest.approx(pause_wait / 8)  # per failure, one slice of 8 waits, not all


def test_a_rate_entry_parses_and_replays_the_same_seeded_times():
    (fault,) = parse_plan("rate=0.5,seed=7,down_s=2", num_slices=3).faults
    assert (fault.rate, fault.seed, fault.down_s, fault.slice, fault.slices) == (0.5, 7, 2.0, -1, 3)

    def fire_times(f):
        source, fired = PoissonFaults(f), []
        for i in range(4000):  # a step boundary every 0.1 s
            fired += [(i, kill.slice) for kill in source.due(i + 1, i * 0.1)]
        return fired

    first, again = fire_times(fault), fire_times(fault)
    assert first == again
    assert 150 <= len(first) <= 250  # 400 s at 0.5/s: 200 expected
    assert {s for _, s in first} == {0, 1, 2}
    pinned = fire_times(RandomSliceLoss(rate=0.5, seed=7, slices=3, slice=1, step=100))
    assert pinned[0][0] >= 99 and {s for _, s in pinned} == {1}


@pytest.mark.parametrize(
    "text, message",
    [
        ("rate=0.5", "rate=R,seed=S"),
        ("rate=0,seed=1", "rate must be a finite number > 0"),
        ("rate=x,seed=1", "rate and down_s are numbers"),
        ("rate=1,seed=1,slice=5", "slice must be in [0, 3)"),
        ("rate=1,seed=1,nan=1", "mixes the keys of slice_loss and non_finite failures"),
    ],
)
def test_bad_rate_entries_name_the_entry_and_the_fix(text, message):
    with pytest.raises(ConfigError, match="fault_schedule entry") as err:
        parse_plan(text, num_slices=3)
    assert message in str(err.value)


def _write_run(path, events, metrics, config):
    path.mkdir()
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "config.yml").write_text("".join(f"{k}: {v}\n" for k, v in config.items()))


def _synthetic_run(path):
    """A run of 12 steps of 1 s (snapshots every 4 steps cost 0.5 s more) with one failure after step 6,
    restored from the snapshot of step 4 after waiting 2 s and reading for 0.25 s."""
    events = [{"event": "start", "time": 0.0}, {"event": "attempt_start", "time": 10.0, "start_step": 0}]
    metrics, t = [], 10.0
    for step in (1, 2, 3, 4, 5, 6):
        dt = 1.0 + (0.5 if step == 4 else 0.0) + (0.3 if step == 1 else 0.0)
        t += dt
        metrics.append({"step": step, "step_time_s": dt, "time": t, "devices": 4})
        if step == 4:
            events.append({"event": "snapshot_taken", "time": t, "step": 4, "seconds": 0.7})
    events += [
        {"event": "slice_killed", "time": t + 0.01, "step": 7},
        {"event": "slice_down_detected", "time": t + 0.02},
        {"event": "wait_start", "time": t + 0.1},
        {"event": "wait_end", "time": t + 2.1, "seconds": 2.0},
        {"event": "restore_start", "time": t + 2.2},
        {"event": "restore_end", "time": t + 2.45, "seconds": 0.25, "source": "snapshot:4"},
        {"event": "attempt_start", "time": t + 2.5, "start_step": 4},
    ]
    t += 2.5
    for step in range(5, 13):
        dt = 1.0 + (0.5 if step in (8, 12) else 0.0) + (0.3 if step == 5 else 0.0)
        t += dt
        metrics.append({"step": step, "step_time_s": dt, "time": t, "devices": 4})
        if step in (8, 12):
            events.append({"event": "snapshot_taken", "time": t, "step": step, "seconds": 0.7})
    events.append({"event": "finish", "time": t + 1.0, "status": "finished"})
    config = {"steps": 12, "num_slices": 2, "snapshot_period": 4, "checkpoint_period": 100}
    _write_run(path, events, metrics, config)


def test_costs_are_measured_from_the_run_directory(tmp_path):
    from trainer.observe.runlog import load_run
    from trainer.plan.costs import measure

    _synthetic_run(tmp_path / "run")
    costs, facts = measure(load_run(tmp_path / "run"))
    assert costs.step_s == pytest.approx(1.0)
    assert costs.snapshot_save_s == pytest.approx(0.5)
    assert costs.first_step_extra_s == pytest.approx(0.3)
    assert costs.snapshot_restore_s == pytest.approx(0.25)
    assert costs.reschedule_s == pytest.approx(2.0)
    assert costs.detect_s == pytest.approx(0.25)  # 2.5 s between the steps, less 2 s waiting and 0.25 s reading
    assert costs.startup_s == pytest.approx(10.0)
    assert costs.tail_s == pytest.approx(1.0)
    assert (facts.steps, facts.slices, facts.devices_per_slice, facts.snapshot_period) == (12, 2, 2, 4)
    assert facts.failures == 1


def _plan(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "trainer.plan", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_plan_cli_from_a_run_directory_prints_periods_per_mode_and_writes_the_plot(tmp_path):
    _synthetic_run(tmp_path / "run")
    proc = _plan("run", "--slices", "3", "--mtbf-per-slice", "2h", "--max-chips", "64", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for text in ("pause_resume", "replica_resize", "full_restart", "snapshot_period", "checkpoint_period"):
        assert text in proc.stdout
    assert "measured: goodput" in proc.stdout
    assert (tmp_path / "run" / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_cli_with_explicit_numbers(tmp_path):
    proc = _plan(
        *("--step-s", "0.2", "--slices", "64", "--chips-per-slice", "16", "--mtbf-per-chip", "30d"),
        *("--checkpoint-save-s", "2", "--reschedule-s", "50", "--checkpoint-restore-s", "5.4"),
        *("--plot", "out.png", "--max-chips", "1024"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "MTBF 1.9d per slice" in proc.stdout  # 30 days / 16 chips
    # No snapshot or local costs given: those tiers are not recommended (they would look free).
    assert re.search(r"snapshot_period +off +off +off", proc.stdout)
    assert re.search(r"local_checkpoint_period +off +off +off", proc.stdout)
    assert (tmp_path / "out.png").exists()


def test_the_sdc_check_period_balances_the_checks_against_the_steps_a_bad_chip_costs():
    step_s, check_s, rate = 0.2, 0.4, 1 / (4 * 86400)  # a bad chip every 4 days over the cluster

    def lost(n: int) -> float:
        return sum(model.sdc_check_cost(step_s, check_s, n, rate))

    best = model.sdc_check_period(step_s, check_s, rate)
    assert lost(best) <= min(lost(best // 2), lost(best * 2), lost(best - 1), lost(best + 1))
    checks, rolled_back = model.sdc_check_cost(step_s, check_s, best, rate)
    assert checks == pytest.approx(rolled_back, rel=0.01)  # at the optimum the two halves are equal
    # A high rate would check every few steps: the overhead bound keeps the checks at 5% of step time.
    assert model.sdc_check_period(step_s, check_s, 1.0) == 40
    assert model.sdc_check_period(step_s, check_s, 0.0) == 0


def test_plan_cli_recommends_an_sdc_check_period_from_a_bad_chip_rate(tmp_path):
    proc = _plan(
        *("--step-s", "0.2", "--slices", "625", "--chips-per-slice", "16", "--mtbf-per-chip", "1250d"),
        *("--sdc-mtbf-per-chip", "1000000h", "--plot", "out.png", "--max-chips", "1024"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    best = model.sdc_check_period(0.2, 0.4, 625 * 16 / 3.6e9)  # the check: two steps, no run to measure
    assert f"sdc_check_period={best} " in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--slices", "3", "--mtbf-per-slice", "2h"], "no step time"),
        (["--step-s", "1", "--mtbf-per-slice", "2h"], "--slices N is needed"),
        (["--step-s", "1", "--slices", "3"], "--mtbf-per-slice DURATION"),
        (["missing_run", "--slices", "3", "--mtbf-per-slice", "2h"], "does not exist"),
    ],
)
def test_plan_cli_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    proc = _plan(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("\n") == 1
