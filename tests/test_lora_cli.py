"""LoRA through the real CLI: checkpoints of adapters and their optimizer state only, a resume over another
base refused before compiling, and elastic recovery (a replica-resize onto survivors and back) ending
with the uninterrupted run's adapters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_harness import (
    assert_same_data_order,
    checkpoint_state,
    cli_env,
    elastic_args,
    events,
    final_params,
    run_cli,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _status(proc) -> str:
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_sft_lora_on_qwen3_tiny_saves_adapters_and_their_optimizer_state_only(tmp_path):
    """The issue's command (fewer steps): python -m trainer.train base.yml model=qwen3-tiny use_sft=true
    dataset_type=arrayrecord grain_train_files='data/fc_sample/*.arrayrecord' lora_rank=8 steps=20."""
    import jax

    from trainer.config import load_config
    from trainer.io.nbytes import tree_nbytes
    from trainer.model import abstract_params

    args = [
        "base.yml",
        "model=qwen3-tiny",
        "use_sft=true",
        "dataset_type=arrayrecord",
        "grain_train_files=data/fc_sample/*.arrayrecord",
        "lora_rank=8",
        "steps=2",
        "checkpoint_period=2",
        "enable_tensorboard=false",
        f"base_output_directory={tmp_path}",
        "run_name=sft",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=cli_env(1),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = tmp_path / "sft" / "checkpoints" / "2"
    tree = checkpoint_state(step)
    assert set(tree) == {"step", "params", "opt_state"}
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(tree["params"])]
    assert len(names) == 2 * 7 and all(n.endswith(("['lora_A']", "['lora_B']")) for n in names), names
    adapter_shapes = {np.shape(a) for a in jax.tree.leaves(tree["params"])}
    assert {np.shape(a) for a in jax.tree.leaves(tree["opt_state"]) if np.ndim(a)} == adapter_shapes
    model = load_config("base.yml", ["model=qwen3-tiny"]).model
    assert tree_nbytes(tree) < tree_nbytes(abstract_params(model)) / 5  # no base weight in it
    metadata = json.loads((step / "metadata" / "metadata").read_text())
    assert metadata["lora_base"] == {"init_weights_seed": 0}


STEPS = 8
COMMON = [
    "dtype=float32",
    "lora_rank=4",
    "lora_target_modules=[q_proj,v_proj,down_proj]",
    "learning_rate=1e-2",
    *elastic_args(STEPS),
]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_baseline")
    proc = run_cli(root, "base", *COMMON)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "base"


def test_replica_resize_and_back_ends_with_the_uninterrupted_runs_adapters(baseline, tmp_path):
    proc = run_cli(
        tmp_path,
        "rr",
        *COMMON,
        "elastic_min_slice_count=2",
        "snapshot_period=2",
        "fault_schedule=step=5,slice=2,down_steps=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "rr"
    attempts = [e for e in events(run) if e["event"] == "attempt_start"]
    assert [a["slices"] for a in attempts] == [[0, 1, 2], [0, 1], [0, 1, 2]]
    assert attempts[1]["source"].startswith("snapshot:")  # the adapters' snapshot, onto the 2-slice mesh
    assert_same_data_order(run, baseline, STEPS)
    got, want = final_params(run), final_params(baseline)
    assert got.keys() == want.keys() and all(k.endswith(("['lora_A']", "['lora_B']")) for k in got)
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_resume_over_another_base_exits_2_before_compiling_and_changes_nothing(baseline):
    before = _listing(baseline)
    longer = [a for a in COMMON if not a.startswith("steps=")] + [f"steps={STEPS + 2}"]
    proc = run_cli(baseline.parent, "base", *longer, "init_weights_seed=7")
    assert proc.returncode == 2 and _status(proc) == "STATUS: input_error", proc.stderr[-3000:]
    assert "its adapters were trained over base initialised from init_weights_seed=0" in proc.stderr
    assert "this run's base is initialised from init_weights_seed=7" in proc.stderr
    assert "compiled the train step" not in proc.stderr and " loss=" not in proc.stderr
    assert _listing(baseline) == before

    again = run_cli(baseline.parent, "base", *longer)
    assert again.returncode == 0, again.stderr[-3000:]
    starts = [e for e in events(baseline) if e["event"] == "attempt_start"]
    assert starts[-1]["source"] == f"checkpoint:{STEPS}" and starts[-1]["start_step"] == STEPS
