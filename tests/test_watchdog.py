"""The progress watchdog: a process that makes no progress exits 75 (restart me) and the rerun resumes.

Units: the bounds per phase (`HangTimeouts`), what counts as progress (`ProgressWatchdog.check` on a fake
clock and phase), and that the loop's save and evaluation phases keep SIGTERM at the step boundary. End
to end: the CLI with a hang injected at step 13 (`fault_schedule=step=13,hang_s=...`) and the local tier
on exits 75 within the bound plus a few seconds, leaves every thread's stack in its log, and the same
command resumes from the local tier to the parameters of an uninterrupted run, bitwise. With snapshots on,
the hang's emergency write puts the newest host snapshot (newer than every save) in the local tier, and the
rerun resumes from that step.
"""

from __future__ import annotations

import json
import time

import pytest
from cli_harness import assert_same_data_order, assert_same_params, events, metrics, run_cli

from trainer.checkpoint.local_store import committed_steps
from trainer.config import ConfigError, load_config
from trainer.failures.plan import parse_plan
from trainer.observe.rundir import run_paths
from trainer.observe.runlog import load_run, summarize
from trainer.process.preemption import EVALUATING, SAVING, STEPPING, Phases, Preempted, StopSignal
from trainer.process.watchdog import AUTO, AUTO_FLOOR_S, AUTO_MULTIPLE, HangTimeouts, ProgressWatchdog
from trainer.report import format_summary


class Fake:
    """A settable clock and phase."""

    def __init__(self):
        self.now, self.phase = 100.0, "compile"

    def clock(self) -> float:
        return self.now


def _watchdog(fake: Fake, step_s: float = AUTO, phase_s: float = 600.0) -> ProgressWatchdog:
    return ProgressWatchdog(
        HangTimeouts(step_s, phase_s), on_hang=lambda hang: None, phase=lambda: fake.phase, clock=fake.clock
    )


def test_bounds_per_phase():
    fixed, auto = HangTimeouts(30, 600), HangTimeouts(AUTO, 600)
    assert fixed.bound(STEPPING, 0.5) == 30 and fixed.bound("compile", 0.5) == 600
    assert auto.bound(STEPPING, None) == 600  # no median yet: the first steps may still compile
    assert auto.bound(STEPPING, 1.0) == AUTO_FLOOR_S
    assert auto.bound(STEPPING, 100.0) == AUTO_MULTIPLE * 100.0
    assert auto.bound(SAVING, 1.0) == auto.bound(EVALUATING, 1.0) == 600
    assert auto.bound("waiting_for_slices", 1.0) is None  # bounded by the elastic timeouts


def test_a_phase_that_outlasts_its_bound_is_a_hang_and_a_phase_change_is_progress():
    fake = Fake()
    w = _watchdog(fake)
    assert w.check() is None  # first sight of the phase starts its clock
    fake.now += 599
    assert w.check() is None
    fake.phase = "restore"  # moving on is progress
    assert w.check() is None
    fake.now += 601
    hang = w.check()
    assert hang is not None and hang.phase == "restore" and hang.seconds == 601 and hang.timeout_s == 600


def test_completed_steps_are_progress_and_set_the_auto_bound():
    fake = Fake()
    w = _watchdog(fake, phase_s=1800)
    fake.phase = STEPPING
    w.check()
    for step in range(1, 6):
        fake.now += 40.0
        w.beat(step)
        assert w.check() is None
    assert w.median_step_s() == 40.0
    fake.now += AUTO_MULTIPLE * 40.0 - 1
    assert w.check() is None
    fake.now += 2
    hang = w.check()
    assert hang is not None and hang.step == 5 and hang.timeout_s == AUTO_MULTIPLE * 40.0


def test_an_interval_across_another_phase_is_not_a_step_time():
    fake = Fake()
    w = _watchdog(fake, phase_s=1800)
    fake.phase = STEPPING
    w.check()
    for step in range(1, 5):
        fake.now += 1.0
        w.beat(step)
    fake.phase = EVALUATING
    w.check()
    fake.now += 500.0  # a long evaluation, within the phase bound
    assert w.check() is None
    fake.phase = STEPPING
    w.check()
    for step in (5, 6):
        fake.now += 1.0
        w.beat(step)
    assert w.median_step_s() == 1.0 and max(w._intervals) == 1.0


def test_unwatched_phases_never_hang():
    fake = Fake()
    fake.phase = "waiting_for_slices"
    w = _watchdog(fake, phase_s=10)
    w.check()
    fake.now += 10_000
    assert w.check() is None


def test_the_thread_calls_on_hang_once_and_the_roots_beat_reaches_its_watchdog(tmp_path):
    from trainer.process_root import ProcessRoot

    hangs = []
    root = ProcessRoot(load_config("base.yml").train, run_paths(str(tmp_path), "r"), backend=None)
    w = ProgressWatchdog(HangTimeouts(0.3, 0.3), hangs.append, phase=lambda: STEPPING, poll_s=0.05)
    root.watchdog = w
    try:
        w.start()
        for step in range(1, 6):  # steps every 0.1 s keep it quiet
            time.sleep(0.1)
            root.beat(step)
        assert not hangs and w.step == 5
        deadline = time.monotonic() + 60
        while not hangs and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert len(hangs) == 1 and hangs[0].step == 5
    finally:
        w.stop()


@pytest.mark.parametrize("inner", [SAVING, EVALUATING])
def test_sigterm_during_a_save_or_an_evaluation_still_stops_at_the_step_boundary(inner):
    phases = Phases()
    stop = StopSignal(60, phases=phases, exit_process=lambda code: None, main_thread=lambda: True)
    with phases.enter(STEPPING), phases.enter(inner):
        stop._handle(15, None)  # no Preempted raised: the loop finishes the save or evaluation
    assert stop.requested
    stop.finished()
    other = StopSignal(60, phases=phases, exit_process=lambda code: None, main_thread=lambda: True)
    with pytest.raises(Preempted), phases.enter("compile"):
        other._handle(15, None)
    other.finished()


def test_hang_entries_parse_and_bad_ones_name_the_form():
    (fault,) = parse_plan("step=13,hang_s=600", num_slices=1).faults
    assert fault.step == 13 and fault.seconds == 600
    for bad in ("step=13,hang_s=0", "step=0,hang_s=5", "step=13,hang_s=x", "step=13,hang_s=5,slice=0"):
        with pytest.raises(ConfigError, match="hang"):
            parse_plan(bad, num_slices=1)


def test_a_hung_step_exits_75_within_the_bound_and_the_same_command_resumes_bitwise(tmp_path):
    common = ["steps=20", f"local_checkpoint_directory={tmp_path / 'node'}", "local_checkpoint_period=5"]
    base = run_cli(tmp_path, "base", *common, devices=1)
    assert base.returncode == 0, base.stderr[-3000:]

    hang = [*common, "hang_timeout_seconds=5", "fault_schedule=step=13,hang_s=600"]
    started = time.monotonic()
    first = run_cli(tmp_path, "hung", *hang, devices=1)
    took = time.monotonic() - started
    assert first.returncode == 75, first.stderr[-3000:]
    assert took < 120, f"the hang took {took:.0f} s to end the process"  # a hang would take the full 600 s
    assert "STATUS: transient: hang: no progress in phase steps" in first.stdout
    assert "Thread 0x" in first.stderr and "in _hang" in first.stderr  # every thread's stack, the hung one too
    run_dir = tmp_path / "hung"
    (detected,) = [e for e in events(run_dir) if e["event"] == "hang_detected"]
    assert detected["phase"] == STEPPING and detected["timeout_s"] == 5
    assert 5 <= detected["seconds"] < 5 + 3  # detected within the bound plus the watchdog's polling
    assert detected["step"] in (11, 12)  # the last completed step: 13's dispatch blocked
    assert "in _hang" in open(detected["stacks"]).read()
    finish = [e for e in events(run_dir) if e["event"] == "finish"][-1]
    assert finish["exit_code"] == 75 and finish["status"] == "transient"
    newest = max((run_dir / "lease").glob("*.json"), key=lambda p: int(p.stem))
    assert json.loads(newest.read_text())["released"], "a hang exit releases the run's lease"

    second = run_cli(tmp_path, "hung", *hang, devices=1)  # the same command, as the scheduler reruns it
    assert second.returncode == 0, second.stderr[-3000:]
    restores = [e for e in events(run_dir) if e["event"] == "restore_end"]
    assert restores[-1]["source"] == "local:10"
    assert [e["event"] for e in events(run_dir)].count("hang_injected") == 1  # once per run
    assert_same_params(run_dir, tmp_path / "base")
    assert_same_data_order(run_dir, tmp_path / "base", steps=20)

    summary = summarize(load_run(run_dir))  # what trainer.report prints
    assert summary.goodput["badput_s"]["hang"] == detected["seconds"]
    assert "hangs             1" in format_summary(summary)


def _hang_command(tmp_path, snapshot_period: int, hang_step: int) -> list[str]:
    """20 steps on one device, the local tier every 5 steps under tmp_path/node, snapshots every
    `snapshot_period`, no loss-spike rollback (a step's row is written once the next is dispatched), and
    with `hang_step` given, that step's dispatch hangs under a 5 s watchdog."""
    common = ["steps=20", f"local_checkpoint_directory={tmp_path / 'node'}", "local_checkpoint_period=5"]
    common += [f"snapshot_period={snapshot_period}", "loss_spike_threshold=0"]
    if hang_step:
        common += ["hang_timeout_seconds=5", f"fault_schedule=step={hang_step},hang_s=600"]
    return common


def _hung_run(tmp_path, *, snapshot_period: int, hang_step: int):
    """(node, run_dir, events, index of hang_detected) of a run that hung, after an uninterrupted base run
    of the same settings (tmp_path/base): the hung run exited 75."""
    base = run_cli(tmp_path, "base", *_hang_command(tmp_path, snapshot_period, 0), devices=1)
    assert base.returncode == 0, base.stderr[-3000:]
    first = run_cli(tmp_path, "hung", *_hang_command(tmp_path, snapshot_period, hang_step), devices=1)
    assert first.returncode == 75, first.stderr[-3000:]
    run_dir = tmp_path / "hung"
    evs = events(run_dir)
    return tmp_path / "node", run_dir, evs, [e["event"] for e in evs].index("hang_detected")


def _rerun_resumes_bitwise_from_local_step(tmp_path, *, snapshot_period: int, hang_step: int, step: int):
    """The same command again, as the scheduler reruns it: it reads local `step`, restores it, does not hang
    again, and ends bitwise equal to the base run. Returns the rerun's events."""
    run_dir, before = tmp_path / "hung", len(events(tmp_path / "hung"))
    second = run_cli(tmp_path, "hung", *_hang_command(tmp_path, snapshot_period, hang_step), devices=1)
    assert second.returncode == 0, second.stderr[-3000:]
    rerun = events(run_dir)[before:]
    (read,) = [e for e in rerun if e["event"] == "local_checkpoint_read"]
    assert read["step"] == step
    (restored,) = [e for e in rerun if e["event"] == "restore_end"]
    assert restored["source"] == f"local:{step}"
    assert [e["event"] for e in events(run_dir)].count("hang_injected") == 1  # once per run
    assert_same_params(run_dir, tmp_path / "base")
    assert_same_data_order(run_dir, tmp_path / "base", steps=20)
    return rerun


def test_a_hang_writes_the_newest_host_snapshot_to_the_local_tier_and_the_rerun_resumes_from_it(tmp_path):
    """Snapshots every 2 steps, the local tier every 5, the persistent tier only at the end: when step 14's
    dispatch hangs, the newest host snapshot (12) is newer than anything saved (local 10), and only the
    watchdog's emergency write puts it on disk. The rerun restores step 12 from the local tier."""
    # Without loss-spike rollback a step's metrics row is written once the next step is dispatched, and the
    # local tier commits a step only with its row: snapshot 12's row exists once 13 is dispatched.
    node, run_dir, evs, at = _hung_run(tmp_path, snapshot_period=2, hang_step=14)
    detected = evs[at]
    assert detected["step"] == 12  # step 12's row is written once 13 is dispatched; 14's dispatch blocked
    before, after = evs[:at], evs[at + 1 :]
    assert [e["step"] for e in before if e["event"] == "snapshot_taken"][-1] == 12
    assert [e["step"] for e in before if e["event"] == "local_checkpoint_save_committed"] == [5, 10]
    assert not (run_dir / "checkpoints").exists() or not [
        p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()
    ]  # nothing in the persistent tier: the newest snapshot is strictly newer than every save
    # The emergency write: after hang_detected, before the process's finish (exit 75).
    assert [(e["event"], e.get("step")) for e in after if e["event"].startswith("local_checkpoint")] == [
        ("local_checkpoint_save_start", 12),
        ("local_checkpoint_save_committed", 12),
    ]
    assert after[-1]["event"] == "finish" and after[-1]["exit_code"] == 75
    assert committed_steps(node / "hung")[-1] == 12

    rerun = _rerun_resumes_bitwise_from_local_step(tmp_path, snapshot_period=2, hang_step=14, step=12)
    (resumed,) = [e for e in rerun if e["event"] == "restart_resumed"]
    assert resumed["start_step"] == 12 and resumed["source"] == "local:12" and resumed["steps_lost"] == 0


def test_a_hang_whose_newest_snapshot_has_no_metrics_row_writes_nothing_newer_and_says_why_at_once(tmp_path):
    """Snapshots every step: when step 13's dispatch hangs, the newest host snapshot is step 12, whose
    metrics row is written only once 13 is dispatched, so never. A local step must have its row (a resumed
    run's metrics.jsonl has no gap), so the emergency write leaves the local tier at its newest step with a
    row (10), says why it wrote nothing newer, and the process exits 75 at once instead of waiting
    stop_timeout_seconds (20 s) for the row. The rerun resumes from local step 10, bitwise."""
    node, run_dir, evs, at = _hung_run(tmp_path, snapshot_period=1, hang_step=13)
    detected, before, after = evs[at], evs[:at], evs[at + 1 :]
    assert detected["step"] == 11  # 12 was dispatched (and snapshotted), 13's dispatch blocked
    newest_snapshot = [e["step"] for e in before if e["event"] == "snapshot_taken"][-1]
    assert newest_snapshot == 12
    rows = {r["step"] for r in metrics(run_dir) if "loss" in r}
    assert newest_snapshot not in rows and max(rows) == 11  # its row waits for 13's dispatch: never
    committed = [e["step"] for e in before if e["event"] == "local_checkpoint_save_committed"]
    assert committed == [5, 10] and all(s in rows for s in committed)
    # The emergency write: one event naming the snapshot it did not write and why; nothing committed.
    local = [e for e in after if e["event"].startswith("local_checkpoint")]
    assert [(e["event"], e["step"]) for e in local] == [("local_checkpoint_save_failed", newest_snapshot)]
    assert "metrics row" in local[0]["error"] and "local step 10" in local[0]["error"]
    assert committed_steps(node / "hung")[-1] == committed[-1] == 10
    finish = after[-1]
    assert finish["event"] == "finish" and finish["exit_code"] == 75
    # Promptly: not after stop_timeout_seconds (20 s) spent waiting for a row that never comes.
    assert finish["time"] - detected["time"] < 10, finish["time"] - detected["time"]

    _rerun_resumes_bitwise_from_local_step(tmp_path, snapshot_period=1, hang_step=13, step=10)


def test_hang_timeout_zero_runs_no_watchdog(tmp_path):
    # A watchdog with a 1 s phase bound would end this run while it compiles: with 0 there is none.
    off = ["hang_timeout_seconds=0", "hang_timeout_phase_seconds=1", "fault_schedule=step=2,hang_s=2"]
    out = run_cli(tmp_path, "r", "steps=3", *off, devices=1)
    assert out.returncode == 0, out.stderr[-3000:]
    names = [e["event"] for e in events(tmp_path / "r")]
    assert "hang_injected" in names and "hang_detected" not in names


def test_a_process_frozen_past_the_bound_is_fenced_and_writes_nothing(tmp_path):
    from trainer.observe.events import EventLog
    from trainer.observe.sinks import Sinks
    from trainer.process_root import ProcessRoot

    fake = Fake()
    frozen = []
    w = ProgressWatchdog(
        HangTimeouts(AUTO, 600),
        lambda hang: None,
        phase=lambda: fake.phase,
        clock=fake.clock,
        freeze_bound_s=11.0,
        on_frozen=frozen.append,
    )
    root = ProcessRoot(load_config("base.yml").train, run_paths(str(tmp_path), "r"), backend=None)
    root.watchdog = w
    log = EventLog(tmp_path / "events.jsonl")
    log.writable = root.writable
    written = []

    class Sink:
        def write(self, record):
            written.append(record)

    sinks = Sinks([Sink()], writable=root.writable)
    try:
        fake.now += 10.0  # a pause the peers tolerate
        assert w.frozen_for() == 0 and root.writable()
        log.emit("goodput", goodput=1.0, wall_s=1.0, productive_s=1.0, badput_s={})
        sinks.write({"step": 1})
        fake.now += 5.0  # 15 s since the last tick: the peers declared this process dead
        assert w.frozen_for() == 15.0 and w.fenced() and not root.writable()
        log.emit("goodput", goodput=0.5, wall_s=1.0, productive_s=0.5, badput_s={})
        sinks.write({"step": 2})
        log.close()
        assert [e["goodput"] for e in events(tmp_path)] == [1.0] and written == [{"step": 1}]
        unbounded = ProgressWatchdog(
            HangTimeouts(AUTO, 600), lambda h: None, phase=lambda: fake.phase, clock=fake.clock
        )
        assert unbounded.frozen_for() == 0
        w.poll_s = 0.01
        w.start()  # its thread sees the gap at its next tick and ends the process (here: records it)
        deadline = time.monotonic() + 60
        while not frozen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert frozen == [15.0]
    finally:
        w.stop()


def test_a_watchdog_exit_releases_the_lease_first_and_a_hung_store_does_not_hold_the_exit():
    import threading

    from trainer.process_root import ReleaseThenExit

    done = []

    class Lease:
        def release(self):
            done.append("released")

    exit_ = ReleaseThenExit(exit_process=lambda code: done.append(code))
    exit_(42)  # before the lease is taken: nothing to release
    exit_.lease = Lease()
    exit_(75)
    assert done == [42, "released", 75]

    class HungStore:
        def release(self):
            threading.Event().wait(60)

    stuck = ReleaseThenExit(exit_process=lambda code: done.append(code))
    stuck.lease, stuck.RELEASE_BOUND_S = HungStore(), 0.2
    started = time.monotonic()
    stuck(75)
    assert done[-1] == 75 and time.monotonic() - started < 30  # a hang guard, not a speed claim
