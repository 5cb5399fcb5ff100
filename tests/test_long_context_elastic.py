"""Elastic at long context: the context axis stays inside a slice, so a replica-resize with the sequence
split works as without it. A run at 8192 tokens with context parallelism 2 on 2 slices loses a slice,
trains on the survivor with the global batch kept (twice the micro-steps), takes the slice back, and
ends with the uninterrupted run's data order, losses and parameters, bit for bit.

Bit for bit: every run sets `elastic_resize_bitwise=true`, so the step sums the global batch as fixed
groups of rows in one order on 2 slices and on 1 (`trainer/program/step.py`, `ordered_sums`)."""

from __future__ import annotations

import pytest
from cli_harness import assert_same_data_order, assert_same_params, events, final_by_step, metrics, run_cli

# The module's fixture runs two 8192-token CLI runs (each bounded at 900 s) before the first test's body.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * 900 + 300)]

STEPS = 6
LONG = [
    f"steps={STEPS}",
    "max_target_length=8192",
    "ici_context_parallelism=2",
    "attention=flash",
    "sa_block_q=512",
    "sa_block_kv=512",
    "per_device_batch_size=1",
    "num_slices=2",
    "elastic_enabled=true",
    "elastic_resize_bitwise=true",
    "checkpoint_period=4",
    "snapshot_period=1",
    "elastic_poll_interval_seconds=0.05",
    "elastic_timeout_seconds=120",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the uninterrupted run's directory, the resized run's)."""
    root = tmp_path_factory.mktemp("long")
    base = run_cli(root, "base", *LONG, devices=4, timeout=900)
    assert base.returncode == 0, base.stderr[-3000:]
    resized = run_cli(
        root,
        "resized",
        *LONG,
        "elastic_min_slice_count=1",
        "fault_schedule=step=3,slice=1,down_steps=2",
        devices=4,
        timeout=900,
    )
    assert resized.returncode == 0, resized.stderr[-3000:]
    return root / "base", root / "resized"


def test_a_replica_resize_at_8192_tokens_with_context_parallelism_2_is_bitwise_the_uninterrupted_run(runs):
    base, run = runs
    attempts = [e for e in events(run) if e["event"] == "attempt_start"]
    assert [a["slices"] for a in attempts] == [[0, 1], [0], [0, 1]], "lost slice 1, trained on 0, took 1 back"
    assert {a["global_batch_size"] for a in attempts} == {attempts[0]["global_batch_size"]}
    got, want = final_by_step(metrics(run)), final_by_step(metrics(base))
    assert any(r["devices"] == 2 for r in got.values()), "some steps ran on the survivor slice alone"
    assert_same_data_order(run, base, STEPS)
    assert [float(got[s]["loss"]).hex() for s in got] == [float(want[s]["loss"]).hex() for s in got]
    assert_same_params(run, base)
