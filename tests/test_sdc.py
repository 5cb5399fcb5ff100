"""Silent-data-corruption check: faults injected on a slice's devices are found, named and undone.

Units: the row rotation, the bitwise comparison and who it implicates, the replicas' digests and the
majority that names an odd replica (`trainer.attempt.sdc`); the replay checksums of the real compiled
program differ per replica and change when one slice's devices compute on wrong numbers; a bit flipped in
one slice's copy of the parameters is found and names it; the config entries; an unchecked corruption
does change the step's update. End to end on 3 virtual slices with `sdc_check_period=3`: a bit flipped in
slice 2's copy of the parameters after step 10 lands in the loss, the check of step 12 names slice 2, the
run rolls back to the state verified clean (step 8) and ends bitwise equal to an uninterrupted run; a
bad chip on slice 2 from step 10 on is found by the replay at step 12 and, with `sdc_quarantine=true`,
its slice taken out, the run ending with the clean run's parameters within the resize's tolerance;
without quarantine that bad chip is found again by the replay after the rollback and the run ends with
exit 3 and `sdc_persists` instead of rolling back forever (the guard's rule is tested on its own too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_harness import assert_same_params, events, metrics, run_cli
from helpers import NANO_MODEL

from trainer.attempt.sdc import (
    AUTO,
    WARMUP_STEPS,
    Incident,
    RollbackGuard,
    SdcCheck,
    SdcPersists,
    Verdict,
    compare,
    odd_replicas,
    persists,
    replica_digests,
    rotate,
    slice_devices,
)
from trainer.config import ConfigError, load_config
from trainer.data.pipeline import make_train_iterator
from trainer.elastic.faults import FaultInjector
from trainer.errors import EXIT_GAVE_UP, exit_code_for
from trainer.failures.corruption import Corruption, flip_bits, wrong_inputs
from trainer.failures.plan import parse_plan
from trainer.failures.slice_loss import Outages
from trainer.observe.events import EventLog, read_events
from trainer.observe.runlog import load_run, summarize
from trainer.parallel.mesh import group_into_slices
from trainer.program.layout import lower_step, slice_layout, train_spec
from trainer.program.state import init_state
from trainer.report import format_summary
from trainer.run import sdc_period_plan


def corrupt_rows(results: np.ndarray, rows: range) -> np.ndarray:
    """`results` with the given replicas' rows off by one unit in the last place."""
    out = np.array(results, copy=True)
    out[rows.start : rows.stop] = np.nextafter(out[rows.start : rows.stop], np.inf, dtype=out.dtype)
    return out


def _results(replicas: int) -> np.ndarray:
    return np.arange(replicas * 5, dtype=np.float32).reshape(replicas, 5) / 7


def _computed_by(results: np.ndarray, bad_slice: int, slices: int) -> tuple[np.ndarray, np.ndarray]:
    """(original, rotated) as healthy slices would return them, with `bad_slice`'s own results off."""
    per = results.shape[0] // slices
    rotated = np.roll(results, -per, axis=0)  # replica r computed the rows one slice later
    bad = range(bad_slice * per, (bad_slice + 1) * per)
    return corrupt_rows(results, bad), corrupt_rows(rotated, bad)


def test_rotate_gives_each_slice_the_next_slices_rows():
    batch = {"inputs": np.arange(6)[:, None].repeat(2, 1)}
    assert rotate(batch, 3)["inputs"][:, 0].tolist() == [2, 3, 4, 5, 0, 1]


@pytest.mark.parametrize("slices, per_slice", [(3, 1), (4, 2)])
def test_healthy_results_match_and_a_bad_slice_is_named(slices, per_slice):
    results = _results(slices * per_slice)
    assert compare(results, np.roll(results, -per_slice, axis=0), slices).slices == ()
    for bad in range(slices):
        verdict = compare(*_computed_by(results, bad, slices), slices)
        assert verdict.suspects == (bad,)
        assert verdict.slices == tuple(sorted({bad, (bad + 1) % slices}))  # its own rows and the ones it replayed


def test_with_two_slices_both_are_suspects():
    results = _results(2)
    assert compare(*_computed_by(results, 1, 2), 2).suspects == (0, 1)


def test_a_nan_result_is_compared_by_its_bits():
    results = _results(3)
    results[1, 2] = np.nan
    assert compare(results, np.roll(results, -1, axis=0), 3).slices == ()


def test_a_detection_on_the_last_rollbacks_devices_before_getting_past_its_step_persists():
    last = Incident(12, ((4, 1), (5, 1)))
    assert not persists(None, last)  # the first detection rolls back
    assert persists(last, Incident(12, ((5, 1),)))  # the replay met it again at the same step
    assert persists(last, Incident(9, ((4, 1), (6, 2))))  # or before it, on one of the same devices
    assert not persists(last, Incident(15, ((4, 1),)))  # the run got past the rollback's step
    assert not persists(last, Incident(12, ((6, 2),)))  # other devices: a fresh incident


def test_the_guard_ends_the_run_with_exit_3_and_one_event_naming_the_devices_and_their_hosts(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    guard = RollbackGuard(log)
    guard.detected(Incident(12, ((4, 1), (5, 1))), (2,))
    guard.detected(Incident(15, ((4, 1), (5, 1))), (2,))  # past step 12: rolls back again
    with pytest.raises(SdcPersists, match=r"step 15 on devices \[4, 5\].*process\(es\) \[1\]") as e:
        guard.detected(Incident(15, ((4, 1), (5, 1))), (2,))
    assert exit_code_for(e.value) == EXIT_GAVE_UP
    (ev,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "sdc_persists"]
    assert (ev["step"], ev["last_rollback_step"], ev["slices"]) == (15, 15, [2])
    assert (ev["devices"], ev["processes"]) == ([4, 5], [1]) and "replace or drain the hosts" in ev["fix"]


def test_a_suspect_slice_is_named_by_its_own_devices():
    _, layout, _, _, slices = _on_three_slices()
    assert slice_devices(layout.mesh, 3, (2,)) == tuple((d.id, d.process_index) for d in slices[2])
    assert [d for d, _ in slice_devices(layout.mesh, 3, (0, 1))] == sorted(d.id for s in slices[:2] for d in s)


def test_settings_and_entries_are_checked():
    with pytest.raises(ConfigError, match="num_slices >= 2"):
        load_config("base.yml", ["sdc_check_period=3"])
    (fault,) = parse_plan("step=9,slice=2,corrupt=1", num_slices=3).faults
    assert fault == Corruption(step=9, slice=2, persistent=False)
    for bad in ("step=9,slice=2,corrupt=2", "step=9,corrupt=1", "step=9,slice=x,corrupt=1"):
        with pytest.raises(ConfigError, match="corrupt"):
            parse_plan(bad, num_slices=3)
    with pytest.raises(ConfigError, match="slice must be in"):
        parse_plan("step=9,slice=3,corrupt=1", num_slices=3)


def test_an_auto_period_is_planned_once_steps_are_measured_and_again_from_a_measured_check(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    asked = []

    def plan(step_s, check_s):
        asked.append((step_s, check_s))
        return 3 if check_s < 1.0 else 5

    check = SdcCheck(AUTO, log, plan=plan)
    check.attempt_started(0)
    for s in range(1, WARMUP_STEPS):
        check.step_timed(s, 0.1)
        assert not check.due(s + 1, slices=3)  # not planned before WARMUP_STEPS step times
    check.step_timed(WARMUP_STEPS, 0.1)
    assert asked == [(0.1, pytest.approx(0.2))]  # a check taken as two steps until one ran
    assert [check.due(s, slices=3) for s in (2, 3)] == [False, True]  # 3 steps after the attempt's start
    assert not check.due(3, slices=1)  # one slice: nothing to compare
    (planned,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "sdc_period_planned"]
    assert (planned["period"], planned["measured"]) == (3, False)
    check._since, check._check_s = 8, 2.0  # as a check at step 8 that took 2 s sets them
    check._replan(8)
    assert check._planned == 5 and check.due(13, slices=3) and not check.due(12, slices=3)


def test_the_auto_plan_checks_as_often_as_its_overhead_allows_else_at_the_models_period():
    cfg = load_config("base.yml", ["num_slices=3"])
    plan = sdc_period_plan(cfg.elastic, chips=48)  # the seed's 3 x v5e-16
    assert plan(0.2, 0.4) == 100  # two steps' check at 2% of step time; the model alone: tens of thousands
    free = sdc_period_plan(load_config("base.yml", ["num_slices=3", "auto_sdc_max_overhead=0"]).elastic, chips=48)
    assert free(0.2, 0.4) > 10_000


def _on_three_slices():
    """(spec, layout, params, device batch, slices) of the nano model on 3 slices of one CPU device each."""
    cfg = load_config("base.yml", [*NANO_MODEL, "num_slices=3", "sdc_check_period=3"])
    slices = group_into_slices(jax.devices()[:3], 3)
    spec = train_spec(cfg)
    layout = slice_layout(spec, slices)
    state = init_state(spec.model, layout.optimizer, layout.shardings, seed=0)
    iterator = make_train_iterator(
        spec.data, vocab_size=spec.model.vocab_size, global_batch_size=layout.batch.global_batch_size
    )
    host = next(iterator)
    iterator.close()
    batch = {k: jax.make_array_from_process_local_data(layout.batch_sharding, v) for k, v in host.items()}
    return spec, layout, state["params"], batch, slices


def test_replay_checksums_differ_per_replica_and_change_with_one_devices_numbers():
    spec, layout, params, batch, slices = _on_three_slices()
    checksums = lower_step(spec, layout, "sdc").compile()
    clean = np.asarray(checksums(params, batch))
    assert clean.shape[0] == 3 and np.isfinite(clean).all()
    assert len({row.tobytes() for row in clean}) == 3  # each replica's own rows, its own gradients
    np.testing.assert_array_equal(np.asarray(checksums(params, batch)), clean)  # bitwise repeatable
    off = np.asarray(checksums(params, wrong_inputs(batch, slices[1])))  # slice 1's devices compute wrong
    assert [np.array_equal(off[r], clean[r]) for r in range(3)] == [True, False, True]


def test_a_flipped_bit_in_one_slices_copy_of_the_params_is_found_and_names_that_slice():
    _, layout, params, _, slices = _on_three_slices()
    digests = replica_digests(layout.mesh)
    assert odd_replicas(np.asarray(digests(params)), 3) == Verdict((), ())
    flipped = flip_bits(params, slices[2])
    assert odd_replicas(np.asarray(digests(flipped)), 3) == Verdict((2,), (2,))
    two = odd_replicas(np.asarray(digests(flipped))[1:], 2)  # two replicas: no majority, both suspects
    assert two == Verdict((0, 1), (0, 1))
    one = next(iter(jax.tree.leaves(flipped)))  # only slice 2's buffer changed, by one bit of one element
    shards = {s.device: np.asarray(s.data) for s in one.addressable_shards}
    a, b = shards[slices[0][0]], shards[slices[2][0]]
    assert np.array_equal(a, shards[slices[1][0]]) and (a != b).sum() == 1


def test_a_corruption_the_check_does_not_see_changes_the_update_once(tmp_path):
    _, layout, params, batch, slices = _on_three_slices()
    injector = FaultInjector(
        parse_plan("step=2,slice=1,corrupt=1", 3), Outages(), tmp_path / "chaos", EventLog(None)
    )

    def fake_step(state, b):  # an update that depends on every device's inputs
        total = jnp.sum(b["inputs"].astype(jnp.float32))
        return {"params": jax.tree.map(lambda p: p + total, state["params"])}, {}

    step = injector.guard(fake_step, dict(enumerate(slices)))
    injector.at_step_boundary(1)
    clean, _ = step({"params": params}, batch)
    injector.at_step_boundary(2)
    off, _ = step({"params": params}, batch)
    leaf = lambda s: np.asarray(next(iter(jax.tree.leaves(s["params"]))))  # noqa: E731
    assert not np.array_equal(leaf(off), leaf(clean))  # slice 1's inputs were wrong: the update is off
    again, _ = step({"params": params}, batch)  # once per run
    np.testing.assert_array_equal(leaf(again), leaf(clean))


SLICES = ["steps=15", "num_slices=3", "elastic_enabled=true", "snapshot_period=2", "checkpoint_period=4"]
CHECKED = [*SLICES, "sdc_check_period=3"]


def _losses_at(run_dir, step: int) -> list[float]:
    return [r["loss"] for r in metrics(run_dir) if r.get("step") == step and "loss" in r]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdc")
    base = run_cli(root, "base", *SLICES)
    assert base.returncode == 0, base.stderr[-3000:]
    return root / "base"


def test_a_flipped_replica_lands_is_named_rolled_back_to_a_verified_state_and_ends_bitwise_equal(
    tmp_path, clean_run
):
    out = run_cli(tmp_path, "flipped", *CHECKED, "fault_schedule=step=10,slice=2,flip=1")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "flipped"
    evs = events(run_dir)
    (injected,) = [e for e in evs if e["event"] == "sdc_injected"]
    assert (injected["step"], injected["slice"], injected["where"]) == (10, 2, "memory")
    (detected,) = [e for e in evs if e["event"] == "sdc_detected"]
    assert detected["step"] == 12 and detected["slices"] == [2] and detected["kind"] == "replicas_differ"
    assert detected["verified_step"] == 8  # the check of step 9 passed: the state after step 8 is clean
    rollback = next(e for e in evs if e["event"] == "rollback")
    assert rollback["cause"] == "silent_data_corruption" and rollback["not_after"] == 8
    after = [e for e in evs if e["event"] == "attempt_start"][-1]
    assert after["start_step"] == 8  # checkpoint 8, not the newer snapshot of step 10 (unverified)
    first, *_, last = _losses_at(run_dir, 11)
    (clean,) = _losses_at(clean_run, 11)
    assert first != clean and last == clean  # the fault landed in the loss; the rollback undid it
    assert_same_params(run_dir, clean_run)
    run = load_run(run_dir)  # what trainer.report prints
    assert "silent data corruption 1" in format_summary(summarize(run), run.events)
    assert summarize(run).goodput["badput_s"]["sdc_check"] > 0


def test_a_bad_chip_is_found_by_the_replay_its_slice_quarantined_and_the_run_ends_with_the_clean_params(
    tmp_path, clean_run
):
    quarantined = run_cli(
        tmp_path,
        "quarantined",
        *CHECKED,
        "sdc_quarantine=true",
        "elastic_min_slice_count=2",
        "fault_schedule=step=10,slice=2,corrupt=persistent",
    )
    assert quarantined.returncode == 0, quarantined.stderr[-3000:]
    run_dir = tmp_path / "quarantined"
    evs = events(run_dir)
    (detected,) = [e for e in evs if e["event"] == "sdc_detected"]  # the two slices left check clean
    assert detected["step"] == 12 and detected["slices"] == [2] and detected["kind"] == "replay_differs"
    assert [e["slice"] for e in evs if e["event"] == "sdc_quarantined"] == [2]
    after = [e for e in evs if e["event"] == "attempt_start"][-1]
    assert after["slices"] == [0, 1] and after["start_step"] == 8
    (clean,) = _losses_at(clean_run, 11)
    assert _losses_at(run_dir, 11)[0] != clean  # steps 10 and 11 trained on slice 2's wrong numbers
    assert "STATUS: finished step=15" in quarantined.stdout
    assert_same_params(run_dir, clean_run, rtol=1e-4, atol=1e-5)  # on 2 slices: the resize's tolerance


def test_a_bad_chip_that_stays_bad_ends_the_run_with_exit_3_instead_of_rolling_back_forever(tmp_path):
    out = run_cli(tmp_path, "persists", *CHECKED, "fault_schedule=step=10,slice=2,corrupt=persistent", timeout=150)
    assert out.returncode == EXIT_GAVE_UP, out.stderr[-3000:]
    evs = events(tmp_path / "persists")
    assert [e["step"] for e in evs if e["event"] == "sdc_detected"] == [12, 12]  # once, then the replay's
    assert [e["step"] for e in evs if e["event"] == "rollback"] == [12]  # one rollback, not a loop
    (persisted,) = [e for e in evs if e["event"] == "sdc_persists"]
    assert (persisted["step"], persisted["last_rollback_step"], persisted["slices"]) == (12, 12, [2])
    assert persisted["devices"] == [2] and persisted["processes"] == [0]  # slice 2: the third CPU device
    assert "elastic_gave_up: silent data corruption at step 12" in out.stdout


def test_with_no_sdc_keys_three_slices_check_at_a_planned_period_and_a_flip_is_undone(tmp_path, clean_run):
    out = run_cli(tmp_path, "auto", *SLICES, "auto_sdc_max_overhead=0.5", "fault_schedule=step=8,slice=1,flip=1")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "auto"
    evs = events(run_dir)
    assert [e["period"] for e in evs if e["event"] == "sdc_period_planned"][:1] == [4]  # 2 steps at 50%
    (detected,) = [e for e in evs if e["event"] == "sdc_detected"]
    assert detected["slices"] == [1] and detected["kind"] == "replicas_differ" and detected["step"] > 8
    assert_same_params(run_dir, clean_run)
