"""Shared by the benchmarks: run the trainer CLI in a subprocess and read what it wrote."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def env_with_devices(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def trainer_cmd(root: Path, name: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainer.train", "base.yml", *overrides, f"base_output_directory={root}",
            f"run_name={name}", "enable_tensorboard=false"]


def run(root: Path, name: str, overrides: list[str], devices: int = 1) -> Path:
    proc = subprocess.run(trainer_cmd(root, name, overrides), capture_output=True, text=True,
                          env=env_with_devices(devices))
    if proc.returncode != 0:
        sys.exit(f"trainer run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return root / name


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def step_times(run_dir: Path, skip: int = 3) -> list[float]:
    return [r["step_time_s"] for r in read_jsonl(run_dir / "metrics.jsonl")[skip:]]


def median(xs) -> float:
    return statistics.median(xs)


def mean(xs) -> float:
    return statistics.fmean(xs)
