"""Training throughput benchmark: tokens/s, step time, MFU, and process start to first step.

    python benchmarks/train_throughput.py model=qwen3-tiny steps=30 [key=value ...] [--devices N]

Runs the real CLI in a subprocess (so start-up is measured as a user sees it), reads metrics.jsonl
and reports medians over the steps after the first `--skip` (compile and warm-up). It also measures
this machine's float32 matmul peak (a jitted 2048x2048 matmul) and reports MFU against it, since
CPUs have no spec-sheet peak. TRAINER_SMOKE=1 runs it all at minimal sizes (see cli_runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import (
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    smoke_cap,
    smoke_env,  # noqa: E402
    smoke_overrides,
    step_records,
)


def matmul_peak_gflops(n: int = 2048, repeats: int = 20) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def run_trainer(overrides: list[str], devices: int, workdir: Path) -> tuple[list[dict], float]:
    env = dict(os.environ)
    if devices > 1:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    smoke_env(env)
    cmd = [
        sys.executable,
        "-m",
        "trainer.train",
        "base.yml",
        *overrides,
        f"base_output_directory={workdir}",
        "run_name=bench",
        "enable_checkpointing=false",
        "enable_tensorboard=false",
    ]
    t_start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"trainer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = step_records(workdir / "bench")
    workdir.mkdir(parents=True, exist_ok=True)
    return records, records[0]["time"] - t_start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", default=["model=qwen3-tiny", "steps=30"])
    p.add_argument("--devices", type=int, default=1, help="CPU devices (XLA host platform device count)")
    p.add_argument("--skip", type=int, default=5, help="steps excluded from the medians (compile, warm-up)")
    p.add_argument("--no-peak", action="store_true", help="skip the matmul peak measurement")
    args = p.parse_args()
    args.overrides = smoke_overrides(args.overrides, steps=4, **SMOKE_SHAPE)
    args.skip = smoke_cap(args.skip, 1)
    peak_n, peak_repeats = smoke_cap(2048, 256), smoke_cap(20, 5)
    announce_smoke(f"4 steps, --skip 1, {SMOKE_SHAPE_TEXT}, a {peak_n}x{peak_n} matmul for the peak")
    with tempfile.TemporaryDirectory() as tmp:
        # Twice with a fresh compilation cache: the first start compiles (cold), the second reuses it.
        cache = [f"jax_cache_dir={tmp}/jax_cache"]
        _, cold_first_step_s = run_trainer(args.overrides + cache, args.devices, Path(tmp) / "cold")
        records, first_step_s = run_trainer(args.overrides + cache, args.devices, Path(tmp) / "warm")
    steady = records[args.skip :] or records
    step_time = statistics.median(r["step_time_s"] for r in steady)
    tokens_s = statistics.median(r["tokens_per_s"] for r in steady)
    tflops_dev = statistics.median(r["tflops_per_device"] for r in steady)
    out = {
        "overrides": args.overrides,
        "devices": args.devices,
        "steps_measured": len(steady),
        "median_step_time_s": round(step_time, 4),
        "median_tokens_per_s": round(tokens_s, 1),
        "model_gflops_per_device": round(tflops_dev * 1e3, 2),
        "process_start_to_first_step_s_cold_cache": round(cold_first_step_s, 2),
        "process_start_to_first_step_s_warm_cache": round(first_step_s, 2),
        "global_batch_size": records[-1]["global_batch_size"],
        "final_loss": round(records[-1]["loss"], 4),
    }
    if not args.no_peak:
        peak = matmul_peak_gflops(peak_n, peak_repeats)
        out["matmul_peak_gflops"] = round(peak, 1)
        # Virtual CPU devices share the same cores: compare the machine's total model FLOP/s to its peak.
        out["mfu_vs_matmul_peak"] = round(tflops_dev * 1e3 * args.devices / peak, 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
