"""End to end: the real CLI in a subprocess trains the tiny preset and leaves a complete run directory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import load_config, load_resolved

REQUIRED = {
    "step",
    "loss",
    "learning_rate",
    "grad_norm",
    "step_time_s",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
    "global_batch_size",
    "pid",
    "time",
    "batch_fingerprint",
}


def run_cli(tmp_path: Path, *overrides: str, env=None, timeout=300):
    cmd = [
        sys.executable,
        "-m",
        "trainer.train",
        "base.yml",
        "model=qwen3-tiny",
        f"base_output_directory={tmp_path}",
        "run_name=e2e",
        *overrides,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    proc = run_cli(tmp, "steps=20", "max_target_length=64", "log_period=5", "enable_checkpointing=false")
    return proc, tmp / "e2e"


def test_cli_trains_the_tiny_preset_and_exits_0_with_a_status_line(finished_run):
    proc, _ = finished_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("STATUS: finished step=20")
    assert "step=20 loss=" in proc.stderr  # the periodic metrics line


def test_loss_falls_on_the_synthetic_stream(finished_run):
    _, run_dir = finished_run
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 2.0, (first, last)


def test_metrics_jsonl_has_one_complete_record_per_step(finished_run):
    _, run_dir = finished_run
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    for r in records:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["mfu"] is None  # CPU without peak_tflops_per_device
        assert r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0
    assert len({r["batch_fingerprint"] for r in records}) == 20, "every step must see a different batch"


def test_run_directory_holds_config_events_and_tensorboard(finished_run):
    _, run_dir = finished_run
    cfg = load_resolved(run_dir / "config.yml")
    assert cfg == load_config(
        "base.yml",
        [
            "model=qwen3-tiny",
            f"base_output_directory={run_dir.parent}",
            "run_name=e2e",
            "steps=20",
            "max_target_length=64",
            "log_period=5",
            "enable_checkpointing=false",
        ],
    )
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "start" and "compile_done" in names and names[-1] == "finish"
    assert events[-1]["status"] == "finished" and all("time" in e for e in events)
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())


def test_same_seed_same_losses_and_data_order(finished_run, tmp_path):
    _, run_dir = finished_run
    proc = run_cli(
        tmp_path,
        "steps=5",
        "max_target_length=64",
        "enable_checkpointing=false",
        "enable_tensorboard=false",
        "learning_rate_schedule_steps=20",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = [json.loads(l) for l in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    first = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()][:5]
    assert [r["batch_fingerprint"] for r in again] == [r["batch_fingerprint"] for r in first]
    assert [r["loss"] for r in again] == [r["loss"] for r in first]


def test_recorded_learning_rate_is_the_schedule_value_each_update_used(finished_run):
    from trainer.program.optim import learning_rate_schedule

    _, run_dir = finished_run
    cfg = load_resolved(run_dir / "config.yml")
    schedule = learning_rate_schedule(cfg.optim, steps=cfg.train.steps)
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # optax counts updates from 0: step s's update used the schedule at s - 1 (0 during the first).
    assert [r["learning_rate"] for r in records] == pytest.approx(
        [float(schedule(r["step"] - 1)) for r in records]
    )
    assert records[0]["learning_rate"] == 0.0 and max(r["learning_rate"] for r in records) > 0
