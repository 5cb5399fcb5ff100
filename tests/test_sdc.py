"""Silent-data-corruption check by replay: a slice that computes wrong numbers is named and undone.

Units: the row rotation, the bitwise comparison and who it implicates (`trainer.runtime.sdc`), the config
and `corrupt` entries, and that an unchecked corruption does change the step's update (so the end-to-end
equality below means the check undid it). End to end on 3 virtual slices: a one-shot corruption of slice
2 at step 9 with `sdc_check_period=3` is detected at step 9 (by step 12), names slice 2, rolls back, and
the final parameters are bitwise equal to an uninterrupted run's; with `sdc_quarantine=true` the run
goes on without slice 2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_harness import assert_same_params, events, metrics, run_cli

from trainer.config import ConfigError, load_config
from trainer.config.fault_schedule import parse_fault_schedule
from trainer.elastic.faults import FaultInjector, Outages
from trainer.observe.events import EventLog
from trainer.observe.runlog import load_run, summarize
from trainer.report import format_summary
from trainer.runtime.sdc import compare, corrupt_rows, rotate


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


def test_settings_and_entries_are_checked():
    with pytest.raises(ConfigError, match="num_slices >= 2"):
        load_config("base.yml", ["sdc_check_period=3"])
    (fault,) = parse_fault_schedule("step=9,slice=2,corrupt=1", num_slices=3)
    assert (fault.step, fault.slice, fault.corrupt) == (9, 2, True)
    for bad in ("step=9,slice=2,corrupt=2", "step=9,corrupt=1", "step=9,slice=x,corrupt=1"):
        with pytest.raises(ConfigError, match="corrupt"):
            parse_fault_schedule(bad, num_slices=3)
    with pytest.raises(ConfigError, match="slice must be in"):
        parse_fault_schedule("step=9,slice=3,corrupt=1", num_slices=3)


def test_a_corruption_the_check_does_not_see_changes_the_update_once(tmp_path):
    injector = FaultInjector(
        parse_fault_schedule("step=2,slice=0,corrupt=1", 1), Outages(), tmp_path / "chaos", EventLog(None)
    )
    state = {"params": {"w": jnp.ones(3)}}
    step = injector.guard(lambda s, b: ({"params": jax.tree.map(lambda p: p * 2, s["params"])}, {}), [0])
    injector.at_step_boundary(2)
    off, _ = step(state, None)
    assert not np.array_equal(off["params"]["w"], np.full(3, 2.0))
    again, _ = step(state, None)  # once per run
    np.testing.assert_array_equal(again["params"]["w"], np.full(3, 2.0))


SLICES = ["steps=15", "num_slices=3", "elastic_enabled=true", "snapshot_period=2"]


def test_a_corrupted_slice_is_named_rolled_back_and_the_run_ends_bitwise_equal(tmp_path):
    base = run_cli(tmp_path, "base", *SLICES)
    assert base.returncode == 0, base.stderr[-3000:]

    out = run_cli(tmp_path, "checked", *SLICES, "sdc_check_period=3", "fault_schedule=step=9,slice=2,corrupt=1")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "checked"
    (detected,) = [e for e in events(run_dir) if e["event"] == "sdc_detected"]
    assert detected["step"] == 9 and detected["slices"] == [2]  # detected by step 12, naming slice 2
    rollback = next(e for e in events(run_dir) if e["event"] == "rollback")
    assert rollback["cause"] == "silent_data_corruption"
    checked = [r["step"] for r in metrics(run_dir) if "sdc_check_s" in r]
    assert {3, 6, 9, 12, 15} <= set(checked)  # every third step, step 9 again after the rollback
    assert_same_params(run_dir, tmp_path / "base")
    run = load_run(run_dir)  # what trainer.report prints
    assert "silent data corruption 1" in format_summary(summarize(run), run.events)
    assert summarize(run).goodput["badput_s"]["sdc_check"] > 0

    quarantined = run_cli(
        tmp_path,
        "quarantined",
        *SLICES,
        "sdc_check_period=3",
        "sdc_quarantine=true",
        "elastic_min_slice_count=2",
        "fault_schedule=step=9,slice=2,corrupt=1",
    )
    assert quarantined.returncode == 0, quarantined.stderr[-3000:]
    evs = events(tmp_path / "quarantined")
    assert [e["slice"] for e in evs if e["event"] == "sdc_quarantined"] == [2]
    after = [e for e in evs if e["event"] == "attempt_start"][-1]
    assert after["slices"] == [0, 1] and after["start_step"] < 9
    assert "STATUS: finished step=15" in quarantined.stdout
    assert len([e for e in evs if e["event"] == "sdc_detected"]) == 1  # the two slices left check clean
