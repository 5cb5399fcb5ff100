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


def excess_step_time(run_dir: Path, start_event: str, end_event: str, *, skip: int = 3,
                     not_with: str | None = None) -> tuple[list[float], float]:
    """(extra step time each periodic job cost, baseline step time), measured inside one run.

    A job (a checkpoint save, a snapshot) starts at step s (`start_event` with that step) and ends when
    `end_event` of the same step is emitted. The steps it can slow are s up to the first step that
    completed after it ended, plus one; its cost is their step time above the median of every other
    step. Comparing one run against another instead would drown a 1% effect in the few-percent
    run-to-run noise of a shared machine. Jobs with no step after them (the final save) are left out,
    and so are those starting at a step where a `not_with` event (another job) started too.
    """
    records = read_jsonl(run_dir / "metrics.jsonl")
    times = {r["step"]: r["step_time_s"] for r in records[skip:]}  # the last record of a replayed step wins
    done_at = {r["step"]: r["time"] for r in records[skip:]}
    events = read_jsonl(run_dir / "events.jsonl")
    ends = {e["step"]: e["time"] for e in events if e["event"] == end_event}
    busy = {e.get("step") for e in events if not_with is not None and e["event"] == not_with}
    windows = []
    for e in events:
        s = e.get("step")
        if e["event"] != start_event or s not in ends or s not in times or s in busy:
            continue
        after = [t for t in sorted(times) if t >= s and done_at[t] >= ends[s]]
        if not after or after[0] + 1 not in times:
            continue
        windows.append(range(s, after[0] + 2))
    inside = {t for w in windows for t in w}
    base = median([v for t, v in times.items() if t not in inside])
    return [sum(times[t] - base for t in w) for w in windows], base
