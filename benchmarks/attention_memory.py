"""Attention memory and speed: one qwen3-tiny train step per (attention, sequence length) on one device.

    python benchmarks/attention_memory.py [--lengths 1024 4096 16384] [--attention dot_product flash]
                                          [--steps 3] [--speed-lengths 1024] [key=value ...]

Each case runs in its own process (so its peak RSS is its own). Per case it reports:
- `compiled MiB`: the compiled step's `memory_analysis()`: arguments + outputs + temporaries - aliased
  (donated state) - what XLA's buffer assignment says the step needs at its peak, found before running;
- `temp MiB`: the temporaries alone (activations, scores, workspace);
- `RSS MiB`: the process's peak resident memory (ru_maxrss) after compiling and running, which
  includes the Python/JAX runtime (~0.5 GB);
- `step s`: the median wall time of `--steps` steps after one warm-up step.
A case whose compiled peak exceeds `--max-run-gib` (default: half the machine's memory), or whose length
is not in `--run-lengths`, is compiled but not run: its memory is the compiler's figure (its RSS that of
compiling) and its time is "not run". The batch is one sequence of
synthetic packed documents (per_device_batch_size=1), remat_policy=full, float32 (bfloat16 matmuls are
emulated, and slow, on most CPUs). Step times of separate processes on shared cores drift with the load,
so the speed comparison (`--speed-lengths`, default 1024) also compiles both in one process and
alternates their steps.
It prints each case as it ends, then writes the record benchmarks/records/attention_memory.json with two
tables, from which the README's are rendered: `memory` (the cases) and `comparison` (per length,
dot_product's compiled memory over flash's, and the alternating step times and their ratio). A case that
fails is named and nothing is recorded. TRAINER_SMOKE=1 runs the same path at minimal sizes, prints the
tables and records nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import SMOKE_SHAPE, SMOKE_SHAPE_TEXT, announce_smoke, smoke, smoke_env  # noqa: E402
from records import write_record  # noqa: E402

MIB = 2**20


def _total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _compile(attention: str, length: int, steps: int, overrides: list[str]):
    """(compiled step, train state, batches, its row of the table without timings)."""
    import jax

    from trainer import model
    from trainer.config import load_config
    from trainer.data.synthetic import SyntheticIterator
    from trainer.parallel.mesh import build_mesh
    from trainer.program.optim import learning_rate_schedule, make_optimizer
    from trainer.program.state import init_state, state_shardings
    from trainer.program.step import make_train_step

    args = ["model=qwen3-tiny", "per_device_batch_size=1", "remat_policy=full", "dtype=float32", "run_name=b"]
    cfg = load_config("base.yml", [*args, *overrides, f"max_target_length={length}", f"attention={attention}"])
    mesh = build_mesh(cfg.mesh, [jax.devices()[:1]])
    opt = make_optimizer(
        cfg.optim, model.param_logical_axes(cfg.model), schedule=learning_rate_schedule(cfg.optim, steps=100)
    )
    shardings, _ = state_shardings(cfg.model, cfg.mesh.logical_axis_rules, mesh, opt)
    state = init_state(cfg.model, opt, shardings, seed=0)
    stream = SyntheticIterator(vocab_size=cfg.model.vocab_size, seq_len=length, global_batch_size=1, seed=0)
    batches = [jax.device_put(stream.batch_at(i)) for i in range(steps + 1)]
    step = jax.jit(make_train_step(cfg.model, opt, z_loss_multiplier=0.0, micro_steps=1), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    row = {
        "attention": attention,
        "length": length,
        "compiled_mib": peak / MIB,
        "temp_mib": mem.temp_size_in_bytes / MIB,
        "compile_s": compile_s,
        "step_s": None,
    }
    return compiled, state, batches, row


def _timed_step(compiled, state, batch):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    float(metrics["loss"])  # waits for the step
    return state, time.perf_counter() - t0


def measure(attention: str, length: int, steps: int, max_run_bytes: int, overrides: list[str]) -> dict:
    """Compile (and, if it fits, run) one train step; the row of the table as a dict."""
    compiled, state, batches, row = _compile(attention, length, steps, overrides)
    if row["compiled_mib"] * MIB > max_run_bytes:
        return row | {"rss_mib": _rss_mib()}
    times = []
    for batch in batches:
        state, seconds = _timed_step(compiled, state, batch)
        times.append(seconds)
    return row | {"step_s": statistics.median(times[1:]), "rss_mib": _rss_mib()}


def compare_speed(length: int, steps: int, overrides: list[str]) -> dict:
    """dot_product and flash compiled in one process and stepped alternately, so that the load of shared
    cores drifts over both alike; median step times and their ratio."""
    runs = {name: list(_compile(name, length, steps, overrides)[:3]) for name in ("dot_product", "flash")}
    times = {name: [] for name in runs}
    for i in range(steps + 1):
        for name, run in runs.items():
            run[1], seconds = _timed_step(run[0], run[1], run[2][i])
            if i:  # the first step of each warms up
                times[name].append(seconds)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"length": length, "steps": steps, **med, "ratio": med["flash"] / med["dot_product"]}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB  # Linux: KiB


def _subprocess(flags: list[str], overrides: list[str]) -> dict:
    """This script with `flags` in a fresh process (its own peak RSS); its last stdout line as JSON."""
    env = smoke_env(dict(os.environ))
    if not smoke():
        env.pop("XLA_FLAGS", None)  # one CPU device, whatever the caller set
    out = subprocess.run([sys.executable, __file__, *flags, *overrides], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _one_case(attention: str, length: int, args, overrides: list[str]) -> dict:
    run = args.run_lengths is None or length in args.run_lengths
    max_run_gib = args.max_run_gib if run else 0.0
    flags = ["--one", attention, str(length), "--steps", str(args.steps), "--max-run-gib", str(max_run_gib)]
    return {"attention": attention, "length": length} | _subprocess(flags, overrides)


def _cell(value, fmt: str) -> str:
    return "not run" if value is None else format(value, fmt)


def memory_table(rows: list[dict]) -> str:
    """Markdown: one row per (attention, sequence) case."""
    lines = [
        "| attention | sequence | compiled MiB | temp MiB | peak RSS MiB | step s | compile s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['attention']} | {r['length']} | {r['compiled_mib']:.0f} | {r['temp_mib']:.0f} | "
            f"{r['rss_mib']:.0f} | {_cell(r['step_s'], '.3f')} | {r['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def comparison_table(rows: list[dict], speed: list[dict]) -> str:
    """Markdown: per sequence length, dot_product's compiled memory over flash's, and the alternating step
    times (both compiled in one process, stepped in turn) and their ratio."""
    by = {(r["attention"], r["length"]): r for r in rows}
    timed = {r["length"]: r for r in speed}
    lines = [
        "| sequence | compiled memory, dot_product ÷ flash | alternating steps, each | dot_product step s "
        "| flash step s | step time, flash ÷ dot_product |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for length in sorted({r["length"] for r in rows} | set(timed)):
        dp, fl = by.get(("dot_product", length)), by.get(("flash", length))
        memory = f"{dp['compiled_mib'] / fl['compiled_mib']:.2f}×" if dp and fl else "not compiled"
        t = timed.get(length)
        times = (
            [str(t["steps"]), f"{t['dot_product']:.3f}", f"{t['flash']:.3f}", f"**{t['ratio']:.2f}×**"]
            if t
            else ["not run"] * 4
        )
        lines.append(f"| {length} | {memory} | " + " | ".join(times) + " |")
    return "\n".join(lines)


def _failures(rows: list[dict], speed: list[dict]) -> list[str]:
    return [
        f"{r.get('attention', 'alternating steps')} at {r['length']}: {' '.join(r['error'])}"
        for r in [*rows, *speed]
        if "error" in r
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--attention", nargs="+", default=["dot_product", "flash"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--run-lengths",
        type=int,
        nargs="*",
        help="lengths whose steps run (default: all); others only compile",
    )
    parser.add_argument("--max-run-gib", type=float, default=_total_memory_bytes() / 2**30 / 2)
    parser.add_argument(
        "--speed-lengths", type=int, nargs="*", default=[1024], help="lengths of the alternating speed test"
    )
    parser.add_argument("--speed-steps", type=int, default=6)
    parser.add_argument("--one", nargs=2, metavar=("ATTENTION", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--speed-one", type=int, help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args, overrides = parser.parse_known_args(argv)
    if args.one:
        row = measure(args.one[0], int(args.one[1]), args.steps, int(args.max_run_gib * 2**30), overrides)
        print(json.dumps(row))
        return
    if args.speed_one:
        print(json.dumps(compare_speed(args.speed_one, args.speed_steps, overrides)))
        return
    if smoke():
        announce_smoke(f"{SMOKE_SHAPE_TEXT}, sequence 128 in tiles of 32, 1 step")
        args.lengths, args.steps, args.speed_lengths, args.speed_steps = [128], 1, [128], 1
        args.run_lengths = None  # every case runs its steps
        overrides = [f"{k}={v}" for k, v in SMOKE_SHAPE.items() if k != "max_target_length"] + overrides
        overrides += ["sa_block_q=32", "sa_block_kv=32"]
    rows = []
    for length in args.lengths:
        for attention in args.attention:
            rows.append(_one_case(attention, length, args, overrides))
            print(json.dumps(rows[-1]), flush=True)
    speed = []
    for length in args.speed_lengths:
        flags = ["--speed-one", str(length), "--speed-steps", str(args.speed_steps)]
        speed.append({"length": length} | _subprocess(flags, overrides))
        print(json.dumps(speed[-1]), flush=True)
    failed = _failures(rows, speed)
    if failed:
        sys.exit("not recording attention_memory: a case failed:\n" + "\n".join(failed))
    tables = {"memory": memory_table(rows), "comparison": comparison_table(rows, speed)}
    print("\n\n".join(tables.values()))
    figures = {"cases": rows, "alternating": speed}
    write_record("attention_memory", "attention_memory", argv, tables=tables, figures=figures)


if __name__ == "__main__":
    main()
