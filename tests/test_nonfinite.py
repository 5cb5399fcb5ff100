"""nan_policy: a non-finite step never poisons the state; stop / skip_step / rollback act as documented."""

import jax
import jax.numpy as jnp
import numpy as np
from cli_harness import events, final_by_step, metrics, run_cli
from helpers import fresh_state_on_one_device, micro_config, synthetic_batch

from trainer.program.step import make_train_step

COMMON = ["steps=8", "checkpoint_period=2", "num_slices=1"]


def test_a_non_finite_update_is_never_applied():
    cfg = micro_config()
    opt, state = fresh_state_on_one_device(cfg)
    emb = state["params"]
    path = jax.tree_util.tree_leaves_with_path(emb)[0][0]
    poisoned = jax.tree_util.tree_map_with_path(lambda p, x: x.at[0].set(jnp.inf) if p == path else x, emb)
    state = dict(state, params=poisoned)
    before = jax.device_get(state)
    step = jax.jit(make_train_step(cfg.model, opt, z_loss_multiplier=0.0, micro_steps=1))
    after, m = jax.device_get(step(state, synthetic_batch(cfg, rows=2)))
    assert not bool(m["finite"])
    for a, b in zip(jax.tree.leaves(after["params"]), jax.tree.leaves(before["params"])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(after["opt_state"]), jax.tree.leaves(before["opt_state"])):
        np.testing.assert_array_equal(a, b)
    assert int(after["step"]) == int(before["step"]) + 1


def test_a_finite_loss_with_non_finite_gradients_is_never_applied():
    """The loss alone does not decide: here it is finite while the gradients are not. The reported loss is
    the cross-entropy; the z-loss term of the objective, scaled by 1e38, overflows float32 only in its
    gradient (2 x multiplier x log Z per logit), so the step must catch the gradient norm itself."""
    cfg = micro_config()
    opt, state = fresh_state_on_one_device(cfg)
    before = jax.device_get(state)
    step = jax.jit(make_train_step(cfg.model, opt, z_loss_multiplier=1e38, micro_steps=1))
    after, m = jax.device_get(step(state, synthetic_batch(cfg, rows=2)))
    assert np.isfinite(m["loss"]) and not np.isfinite(m["grad_norm"])
    assert not bool(m["finite"])
    for a, b in zip(jax.tree.leaves(after["params"]), jax.tree.leaves(before["params"])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(after["opt_state"]), jax.tree.leaves(before["opt_state"])):
        np.testing.assert_array_equal(a, b)
    assert int(after["step"]) == int(before["step"]) + 1


def test_stop_exits_1_with_a_clear_message_and_keeps_the_last_good_checkpoint(tmp_path):
    proc = run_cli(tmp_path, "stop", *COMMON, "fault_schedule=step=5,nan=1", devices=1)
    assert proc.returncode == 1
    assert "non-finite loss or gradients at step 5 (nan_policy=stop)" in proc.stdout
    committed = sorted(int(p.name) for p in (tmp_path / "stop" / "checkpoints").iterdir() if p.name.isdigit())
    assert committed and committed[-1] <= 6
    assert "nonfinite_step" in [e["event"] for e in events(tmp_path / "stop")]


def test_skip_step_continues_and_counts_the_skipped_step(tmp_path):
    proc = run_cli(tmp_path, "skip", *COMMON, "fault_schedule=step=3,nan=1", "nan_policy=skip_step", devices=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = final_by_step(metrics(tmp_path / "skip"))
    assert recs[3]["finite"] is False and recs[8]["skipped_steps"] == 1


def test_rollback_restores_and_skips_the_offending_batch(tmp_path):
    base = run_cli(tmp_path, "ref", *COMMON, devices=1)
    assert base.returncode == 0, base.stderr[-2000:]
    proc = run_cli(tmp_path, "rb", *COMMON, "fault_schedule=step=5,nan=1", "nan_policy=rollback", devices=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    evs = events(tmp_path / "rb")
    assert [e["step"] for e in evs if e["event"] == "rollback"] == [5]
    attempts = [e for e in evs if e["event"] == "attempt_start"]
    assert attempts[-1]["source"] == "checkpoint:4"
    ref, got = final_by_step(metrics(tmp_path / "ref")), final_by_step(metrics(tmp_path / "rb"))
    # Steps 1-4 unchanged; from step 5 on, each step sees the batch one later (batch 5 was skipped).
    assert [got[s]["batch_fingerprint"] for s in range(1, 5)] == [ref[s]["batch_fingerprint"] for s in range(1, 5)]
    assert [got[s]["batch_fingerprint"] for s in range(5, 8)] == [ref[s]["batch_fingerprint"] for s in range(6, 9)]
    assert all(r["finite"] for r in got.values())


def test_profiler_traces_the_window_and_survives_a_slice_failure(tmp_path):
    proc = run_cli(
        tmp_path,
        "prof",
        "steps=10",
        "num_slices=3",
        "elastic_enabled=true",
        "profiler=xplane",
        "skip_first_n_steps_for_profiler=2",
        "profiler_steps=4",
        "elastic_poll_interval_seconds=0.05",
        "fault_schedule=step=4,slice=1",
        "snapshot_period=1",
        devices=3,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    evs = events(tmp_path / "prof")
    prof = [(e["event"], e.get("complete")) for e in evs if e["event"].startswith("profiler_")]
    assert prof == [
        ("profiler_start", None),
        ("profiler_stop", False),
        ("profiler_start", None),
        ("profiler_stop", True),
    ]
    traces = list((tmp_path / "prof" / "profile").rglob("*.xplane.pb"))
    assert len(traces) >= 2
