"""DPO through the real CLI on the bundled preference sample: reward accuracy on held-out pairs rises above
chance, and a run that loses a slice and recovers (pause-and-resume, or replica-resize with
`elastic_resize_bitwise=true`) ends bitwise equal to an uninterrupted one, with the same pairs in the same
order."""

from __future__ import annotations

import math

import pytest
from cli_harness import (
    assert_same_data_order,
    assert_same_params,
    checkpoint_state,
    elastic_args,
    events,
    metrics,
    run_cli,
)

from trainer.io.jsonl import read_jsonl
from trainer.program import preference

DPO = [
    "objective=dpo",
    "dataset_type=arrayrecord",
    "vocab_size=8192",  # the bundled tokenizer's
    "max_target_length=384",  # every pair of the sample fits: no reply is cut
    "grain_worker_count=0",
    "per_device_batch_size=2",
]
TRAIN = "grain_train_files=data/preference_sample/pref-00000-of-00002.arrayrecord"
HELD_OUT = "grain_eval_files=data/preference_sample/pref-00001-of-00002.arrayrecord"


def test_reward_accuracy_on_held_out_pairs_rises_above_chance(tmp_path):
    proc = run_cli(
        tmp_path,
        "acc",
        *DPO,
        TRAIN,
        HELD_OUT,
        "base_emb_dim=128",
        "base_mlp_dim=256",
        "steps=48",
        "learning_rate=3e-3",
        "dpo_beta=0.1",
        "eval_interval=48",
        "eval_steps=-1",  # all 160 held-out pairs
        "eval_per_device_batch_size=16",
        devices=1,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_jsonl(tmp_path / "acc" / "metrics.jsonl") if r.get("kind") == "eval"]
    final = evals[-1]
    assert final["eval_pairs"] == 160
    assert final["eval_rewards/accuracies"] > 0.55, final  # chance is 0.5; an untrained policy scores 0
    assert final["eval_rewards/margins"] > 0
    train = [r for r in metrics(tmp_path / "acc") if r.get("kind") != "eval"]
    assert set(preference.METRICS) <= set(train[-1]) and train[-1]["step"] == 48


STEPS = 8
ELASTIC = [*DPO, TRAIN, *elastic_args(STEPS), "snapshot_period=2", "elastic_resize_bitwise=true"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-baseline")
    proc = run_cli(root, "base", *ELASTIC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "base"


def test_a_dpo_run_that_loses_a_slice_and_resumes_is_bitwise_an_uninterrupted_one(baseline, tmp_path):
    proc = run_cli(tmp_path, "pr", *ELASTIC, "fault_schedule=step=5,slice=1,down_s=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "pr"
    attempts = [e for e in events(run) if e["event"] == "attempt_start"]
    assert len(attempts) == 2 and attempts[1]["source"] == "snapshot:4"
    assert_same_data_order(run, baseline, STEPS)
    assert_same_params(run, baseline)


def test_a_dpo_replica_resize_keeps_whole_pairs_the_data_order_and_the_bits(baseline, tmp_path):
    proc = run_cli(
        tmp_path, "rr", *ELASTIC, "elastic_min_slice_count=2", "fault_schedule=step=5,slice=2,down_steps=2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "rr"
    attempts = [e for e in events(run) if e["event"] == "attempt_start"]
    assert [a["slices"] for a in attempts[:2]] == [[0, 1, 2], [0, 1]]
    assert {a["global_batch_size"] for a in attempts} == {12}, "6 pairs, 12 rows, on 3 slices and on 2"
    assert_same_data_order(run, baseline, STEPS)
    assert_same_params(run, baseline)  # elastic_resize_bitwise: the pairs summed in one order on 3 and 2


def test_dpo_under_lora_starts_at_its_reference_the_base_and_saves_adapters_only(tmp_path):
    """Under LoRA the reference is the base itself: with B = 0 the first step's policy is the reference
    exactly (log-ratios 0, loss log 2), training moves the rewards apart, and the checkpoint holds the
    adapters and their optimizer state, no reference copy."""
    import jax

    proc = run_cli(
        tmp_path,
        "lora",
        *DPO,
        TRAIN,
        "lora_rank=8",
        "steps=12",
        "learning_rate=1e-2",
        "log_period=1",
        "checkpoint_period=12",
        devices=1,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "lora"
    train = [r for r in metrics(run) if r.get("kind") != "eval"]
    first, last = train[0], train[-1]
    assert first["step"] == 1 and last["step"] == 12
    assert first["rewards/chosen"] == 0 and first["rewards/rejected"] == 0, first
    assert abs(first["loss"] - math.log(2)) < 1e-6, first
    assert any(r["rewards/chosen"] != 0 for r in train[1:]), "the adapters never moved the policy"
    tree = checkpoint_state(run / "checkpoints" / "12")
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(tree["params"])]
    assert names and all(n.endswith(("['lora_A']", "['lora_B']")) for n in names), names
