"""Llama 3 through the real CLI: the recovery paths are the model's, whatever its family.

`model=llama3-tiny` trains, and a second run with more steps resumes from the first one's checkpoint
to the same parameters as one uninterrupted run; an injected slice failure on two virtual slices
recovers in the process to the parameters of a run without it (bitwise: pause and resume replays the
same steps on the same mesh with the same executable).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli_harness import assert_same_data_order, assert_same_params, cli_env, events, final_params, metrics, run_cli

LLAMA = [
    "model=llama3-tiny",
    "max_target_length=64",
    "enable_tensorboard=false",
    "learning_rate_schedule_steps=12",
]


def _train(root: Path, run_name: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer.train", "base.yml", *LLAMA, f"base_output_directory={root}"]
    proc = subprocess.run(
        [*cmd, f"run_name={run_name}", *overrides], capture_output=True, text=True, timeout=600, env=cli_env(1)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_llama3_tiny_trains_and_a_run_with_more_steps_resumes_to_the_uninterrupted_runs_params(tmp_path):
    first = _train(tmp_path, "ll", "steps=8")
    assert first.stdout.strip().splitlines()[-1].startswith("STATUS: finished step=8 trained=8")
    again = _train(tmp_path, "ll", "steps=12")
    assert again.stdout.strip().splitlines()[-1].startswith("STATUS: finished step=12 trained=4")
    attempts = [e for e in events(tmp_path / "ll") if e["event"] == "attempt_start"]
    assert [a["source"] for a in attempts][-1] == "checkpoint:8"
    losses = [r["loss"] for r in metrics(tmp_path / "ll")]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5  # the synthetic stream is learnable
    params = final_params(tmp_path / "ll")
    assert not any("q_norm" in k or "k_norm" in k for k in params) and not any("lm_head" in k for k in params)

    _train(tmp_path, "whole", "steps=12")
    assert_same_data_order(tmp_path / "ll", tmp_path / "whole", 12)
    assert_same_params(tmp_path / "ll", tmp_path / "whole")


def test_a_lost_slice_of_a_llama_run_recovers_in_process_to_the_uninterrupted_params(tmp_path):
    common = ["model=llama3-tiny", "steps=8", "num_slices=2", "elastic_enabled=true", "checkpoint_period=4"]
    common += ["elastic_poll_interval_seconds=0.05", "elastic_timeout_seconds=60", "snapshot_period=2"]
    base = run_cli(tmp_path, "base", *common, devices=2)
    assert base.returncode == 0, base.stderr[-3000:]
    faulty = run_cli(tmp_path, "pr", *common, "fault_schedule=step=5,slice=1,down_s=1", devices=2)
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    assert "Slice down event detected. Retrying." in faulty.stderr
    attempts = [e for e in events(tmp_path / "pr") if e["event"] == "attempt_start"]
    assert len(attempts) == 2 and attempts[1]["source"] == "snapshot:4"
    assert len({r["pid"] for r in metrics(tmp_path / "pr")}) == 1
    assert_same_data_order(tmp_path / "pr", tmp_path / "base", 8)
    assert_same_params(tmp_path / "pr", tmp_path / "base")
