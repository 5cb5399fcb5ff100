"""Training throughput benchmark: tokens/s, step time, MFU, and process start to first step.

    python benchmarks/train_throughput.py model=qwen3-tiny steps=30 [key=value ...] [--devices N [N ...]]
        [--global-batch B] [--hugepages on|off ...]

Runs the real CLI in a subprocess (so start-up is measured as a user sees it), reads metrics.jsonl
and reports medians over the steps after the first `--skip` (compile and warm-up). It also measures
this machine's float32 matmul peak (a jitted 2048x2048 matmul) and reports MFU against it, since
CPUs have no spec-sheet peak. Several `--devices` counts are measured one after the other in the same
invocation, so they compare like with like; `--global-batch` keeps the global batch the same for each
(per_device_batch_size = B / devices). `--hugepages on off` measures each device count with the trainer's
host malloc on huge pages and without (trainer/hostmem.py; off runs it with TRAINER_HUGEPAGE_MALLOC=0),
one column per setting, and refuses a run whose start event says otherwise. `--maxtext-python PY` also
trains the same model, shape and batch with MaxText's own trainer on the same devices (an interpreter with
MaxText installed and this one's jax; see maxtext_cpu.py), its host malloc on huge pages exactly when this
trainer's CLI puts its own there (whatever the caller's GLIBC_TUNABLES), and reports the speed-up over it.
It writes the record benchmarks/records/train_throughput-<model>.json, train_throughput-<model>-vs-maxtext.json
with `--maxtext-python`, or train_throughput-hugepages.json with `--hugepages` (benchmarks/records.py), from
which the README's tables are rendered. TRAINER_SMOKE=1 runs it all at minimal sizes (see cli_runs) and
records nothing.
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
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import (
    HUGEPAGES,
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    check_hugepages,
    hugepage_env,
    smoke_cap,
    smoke_env,  # noqa: E402
    smoke_overrides,
    step_records,
)
from records import REPO, write_record  # noqa: E402

sys.path.insert(0, str(REPO))


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


def run_trainer(
    overrides: list[str], devices: int, workdir: Path, hugepages: str | None = None
) -> tuple[list[dict], float]:
    """(step records, process start to first step) of one CLI run; `hugepages` on/off sets and checks the
    host malloc's huge pages (None: as the environment has it)."""
    env = dict(os.environ)
    if devices > 1:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    smoke_env(env)
    if hugepages is not None:
        hugepage_env(env, hugepages)
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
    if hugepages is not None:
        check_hugepages(workdir / "bench", hugepages)
    workdir.mkdir(parents=True, exist_ok=True)
    return records, records[0]["time"] - t_start


def measure(overrides: list[str], devices: int, skip: int, hugepages: str | None = None) -> dict:
    """One configuration: a cold-cache start, then a warm-cache run whose steps after `skip` are measured."""
    with tempfile.TemporaryDirectory() as tmp:
        # Twice with a fresh compilation cache: the first start compiles (cold), the second reuses it.
        cache = [f"jax_cache_dir={tmp}/jax_cache"]
        _, cold_first_step_s = run_trainer(overrides + cache, devices, Path(tmp) / "cold", hugepages)
        records, first_step_s = run_trainer(overrides + cache, devices, Path(tmp) / "warm", hugepages)
    steady = records[skip:] or records
    return {
        "overrides": overrides,
        "devices": devices,
        **({} if hugepages is None else {"hugepages": hugepages}),
        "steps_measured": len(steady),
        "median_step_time_s": round(statistics.median(r["step_time_s"] for r in steady), 4),
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady), 1),
        "model_gflops_per_device": round(statistics.median(r["tflops_per_device"] for r in steady) * 1e3, 2),
        "process_start_to_first_step_s_cold_cache": round(cold_first_step_s, 2),
        "process_start_to_first_step_s_warm_cache": round(first_step_s, 2),
        "global_batch_size": records[-1]["global_batch_size"],
        "final_loss": round(records[-1]["loss"], 4),
    }


def _devices(r: dict) -> str:
    return f"{r['devices']} device{'s' if r['devices'] > 1 else ''}"


def _headers(runs: list[dict]) -> tuple[str, list[str]]:
    """(corner, column labels): a column per device count, or per huge-pages setting (and device count when
    several are measured; a single one goes in the corner)."""
    if not any("hugepages" in r for r in runs):
        return "", [_devices(r) for r in runs]
    several = len({r["devices"] for r in runs}) > 1
    pages = [f"huge pages {r['hugepages']}" for r in runs]
    if several:
        return "", [f"{_devices(r)}, {p}" for r, p in zip(runs, pages)]
    return _devices(runs[0]), pages


def table(runs: list[dict], peak: float | None) -> str:
    """Markdown: one column per run (device count, huge-pages setting)."""

    def row(name, cell):
        return f"| {name} | " + " | ".join(cell(r) for r in runs) + " |"

    corner, labels = _headers(runs)
    lines = [
        (f"| {corner} | " if corner else "| | ") + " | ".join(labels) + " |",
        "|---|" + "---|" * len(runs),
        row("global batch (sequences)", lambda r: str(r["global_batch_size"])),
        row("median step time", lambda r: f"{r['median_step_time_s']:.3f} s"),
        row("tokens/s", lambda r: f"{r['median_tokens_per_s']:,.0f}"),
        row("model GFLOP/s per device", lambda r: f"{r['model_gflops_per_device']:.1f}"),
        row(
            "process start → first step (cold / warm compile cache)",
            lambda r: (
                f"{r['process_start_to_first_step_s_cold_cache']:.1f} s / "
                f"{r['process_start_to_first_step_s_warm_cache']:.1f} s"
            ),
        ),
    ]
    if any("maxtext_median_step_time_s" in r for r in runs):
        lines += [
            row(
                f"{runs[0]['maxtext']}: median step time, same model and batch, fsdp over the devices, host "
                f"malloc on huge pages {'as' if runs[0].get('maxtext_hugepages') else 'off, as'} this trainer's",
                lambda r: f"{r['maxtext_median_step_time_s']:.3f} s",
            ),
            row("this trainer's speed-up over MaxText", lambda r: f"**{r['speedup_vs_maxtext']:.2f}×**"),
        ]
    if peak is not None:
        lines.append(row("float32 matmul peak of the machine", lambda r: f"{peak:.1f} GFLOP/s"))
    return "\n".join(lines)


def record_id(model: str, hugepages: list[str] | None, maxtext: bool = False) -> str:
    """train_throughput-<model> (-vs-maxtext with MaxText's runs), or train_throughput-hugepages for the
    huge-pages comparison."""
    if hugepages:
        return "train_throughput-hugepages"
    return f"train_throughput-{model}" + ("-vs-maxtext" if maxtext else "")


def measure_maxtext(python: str, overrides: list[str], devices: int, skip: int) -> dict:
    """MaxText on the same devices, model, shape, batch and number of steps as this trainer's `overrides`."""
    from maxtext_cpu import maxtext_overrides, maxtext_version, median_after, run_maxtext

    from trainer import hostmem
    from trainer.config import load_config

    cfg = load_config("base.yml", overrides)
    args = maxtext_overrides(
        cfg.model,
        max_target_length=cfg.data.max_target_length,
        per_device_batch_size=cfg.data.per_device_batch_size,
        steps=cfg.train.steps,
        devices=devices,
    )
    hugepages = hostmem.cli_takes_hugepages()
    with tempfile.TemporaryDirectory() as tmp:
        times = run_maxtext(python, args, devices, Path(tmp), env=maxtext_environ(os.environ, hugepages))
    return {
        "maxtext": maxtext_version(python),
        "maxtext_overrides": args,
        "maxtext_hugepages": hugepages,
        "maxtext_median_step_time_s": round(median_after(times, skip), 4),
    }


def maxtext_environ(environ: Mapping[str, str], hugepages: bool) -> dict:
    """`environ` with glibc's huge-page malloc tunable set to `hugepages` (any setting of it replaced):
    MaxText's runs get huge pages exactly when this trainer's CLI takes them (`hostmem.cli_takes_hugepages`),
    so the two trainers compare like with like whatever the caller's environment holds."""
    tunables = [
        t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")
    ]
    tunables.append(f"glibc.malloc.hugetlb={int(hugepages)}")
    return {**environ, "GLIBC_TUNABLES": ":".join(tunables)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", default=["model=qwen3-tiny", "steps=30"])
    p.add_argument("--devices", type=int, nargs="+", default=[1], help="CPU device counts, measured in turn")
    p.add_argument("--global-batch", type=int, help="keep this global batch: per_device_batch_size = B / devices")
    p.add_argument("--skip", type=int, default=5, help="steps excluded from the medians (compile, warm-up)")
    p.add_argument("--no-peak", action="store_true", help="skip the matmul peak measurement")
    p.add_argument(
        "--hugepages",
        nargs="+",
        choices=HUGEPAGES,
        help="measure with the host malloc on huge pages (on) and without (off), in turn (default: as the "
        "environment has it)",
    )
    p.add_argument("--maxtext-python", help="also train with MaxText, installed in this interpreter")
    argv = sys.argv[1:]
    args = p.parse_args()
    args.overrides = smoke_overrides(args.overrides, steps=4, **SMOKE_SHAPE)
    args.skip = smoke_cap(args.skip, 1)
    peak_n, peak_repeats = smoke_cap(2048, 256), smoke_cap(20, 5)
    announce_smoke(f"4 steps, --skip 1, {SMOKE_SHAPE_TEXT}, a {peak_n}x{peak_n} matmul for the peak")
    runs = []
    for devices in args.devices:
        overrides = list(args.overrides)
        if args.global_batch:
            if args.global_batch % devices:
                sys.exit(f"--global-batch {args.global_batch} does not split over {devices} devices")
            overrides.append(f"per_device_batch_size={args.global_batch // devices}")
        for hugepages in args.hugepages or [None]:
            runs.append(measure(overrides, devices, args.skip, hugepages))
            if args.maxtext_python:
                runs[-1].update(measure_maxtext(args.maxtext_python, overrides, devices, args.skip))
                runs[-1]["speedup_vs_maxtext"] = round(
                    runs[-1]["maxtext_median_step_time_s"] / runs[-1]["median_step_time_s"], 2
                )
    peak = None if args.no_peak else matmul_peak_gflops(peak_n, peak_repeats)
    for r in runs:
        if peak is not None:
            # Virtual CPU devices share the same cores: compare the machine's total model FLOP/s to its peak.
            r["matmul_peak_gflops"] = round(peak, 1)
            r["mfu_vs_matmul_peak"] = round(r["model_gflops_per_device"] * r["devices"] / peak, 3)
    print(json.dumps(runs if len(runs) > 1 else runs[0], indent=2))
    model = next((o.split("=", 1)[1] for o in reversed(args.overrides) if o.startswith("model=")), "qwen3-tiny")
    print(table(runs, peak))
    write_record(
        record_id(model, args.hugepages, bool(args.maxtext_python)),
        "train_throughput",
        argv,
        tables={"steps": table(runs, peak)},
        figures=runs,
    )


if __name__ == "__main__":
    main()
