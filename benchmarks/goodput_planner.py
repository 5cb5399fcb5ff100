"""The goodput planner against real runs: predicted vs measured goodput under Poisson-injected failures.

    python benchmarks/goodput_planner.py [--rate 0.35] [--steps 8000] [--snapshot-periods 10 100] [--seed 1]

Each setting is one elastic run (pause-and-resume, 2 virtual slices on 2 CPU devices) of a small model
with `fault_schedule=rate=R,seed=S`: slice failures at exponential gaps of mean 1/R seconds of wall time.
The planner (`trainer.plan`) is then fed that run's measured costs (trainer.plan.costs) and the injected
rate, and predicts its goodput; the report's accounting (trainer.observe.goodput) measures it. The table
shows both, whole run and after startup, and whether the planner ranks the settings as the runs do. The
settings differ only in snapshot_period; the persistent tier saves only the final step. A short run first
fills a compilation cache that every run shares, so no setting pays a compile the other does not.
Exit 1 when a prediction is off by more than --tolerance points or the ranking is wrong.

It writes the record benchmarks/records/goodput_planner.json (benchmarks/records.py), whether or not the
predictions pass: table `validation` (goodput per setting, measured and predicted, and the ranks) and
table `badput` (seconds by cause, measured and predicted), from which docs/running_at_scale.md renders
them. TRAINER_SMOKE=1 runs the same path at minimal sizes (a handful of failures: figures mean nothing)
and records nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import announce_smoke, run, smoke  # noqa: E402
from records import write_record  # noqa: E402

SHAPE = [
    "model=qwen3-tiny",
    "base_num_decoder_layers=1",
    "base_emb_dim=64",
    "base_num_query_heads=2",
    "base_num_kv_heads=1",
    "head_dim=32",
    "base_mlp_dim=128",
    "vocab_size=512",
    "max_target_length=32",
    "per_device_batch_size=1",
]


def measured_row(period: int, costs, facts, closed, sim) -> dict:
    """One setting's figures: the run's measured goodput and costs, the planner's predictions from them."""
    return {
        "snapshot_period": period,
        "step_s": round(costs.step_s, 5),
        "wall_s": round(facts.wall_s, 2),
        "failures": facts.failures,
        "expected_failures": round(closed.failures, 2),
        "goodput_measured": round(facts.goodput, 4),
        "goodput_predicted": round(closed.goodput, 4),
        "goodput_monte_carlo": round(sim.goodput, 4),
        # Leaving out process start to the first step: the part of the run the failures act on.
        "after_startup_measured": round(facts.goodput * facts.wall_s / (facts.wall_s - costs.startup_s), 4),
        "after_startup_predicted": round(closed.productive_s / (closed.wall_s - costs.startup_s), 4),
        "badput_measured_s": {c: round(s, 2) for c, s in facts.badput_s.items()},
        "badput_predicted_s": {c: round(s, 2) for c, s in closed.badput_s.items()},
        "costs": {k: round(v, 5) for k, v in dataclasses.asdict(costs).items()},
    }


def judge(rows: list[dict], tolerance: float) -> dict:
    """Each row's error (points) and ranks (1: best goodput), measured and predicted; whether all pass."""
    for key in ("measured", "predicted"):
        order = sorted(rows, key=lambda r: -r[f"goodput_{key}"])
        for rank, r in enumerate(order, 1):
            r[f"rank_{key}"] = rank
    for r in rows:
        r["error_points"] = round(100 * (r["goodput_predicted"] - r["goodput_measured"]), 2)
    return {
        "within_tolerance": all(abs(r["error_points"]) <= tolerance for r in rows),
        "ranking_agrees": all(r["rank_measured"] == r["rank_predicted"] for r in rows),
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def validation_table(out: dict) -> str:
    """Markdown: one row per snapshot_period, goodput in %, predicted against measured."""
    head = [
        f"snapshot_period ({out['steps']} steps, failures at {out['rate']:g}/s, seed {out['seed']})",
        "step",
        "failures",
        "expected",
        "goodput %: measured",
        "predicted",
        "Monte Carlo",
        "error, points",
        "after startup: measured",
        "predicted",
        "rank: measured / predicted",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in out["rows"]:
        cells = [
            str(r["snapshot_period"]),
            f"{1e3 * r['step_s']:.1f} ms",
            str(r["failures"]),
            f"{r['expected_failures']:.1f}",
            _pct(r["goodput_measured"]),
            _pct(r["goodput_predicted"]),
            _pct(r["goodput_monte_carlo"]),
            f"{r['error_points']:+.1f}",
            _pct(r["after_startup_measured"]),
            _pct(r["after_startup_predicted"]),
            f"{r['rank_measured']} / {r['rank_predicted']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def badput_table(out: dict, causes) -> str:
    """Markdown: one row per snapshot_period, seconds lost by cause, measured / predicted; causes that cost
    nothing in any run or prediction are left out."""
    rows = out["rows"]
    shown = [
        c
        for c in causes
        if any(r["badput_measured_s"].get(c, 0.0) or r["badput_predicted_s"].get(c, 0.0) for r in rows)
    ]
    lines = [
        "| snapshot_period (seconds: measured / predicted) | " + " | ".join(shown) + " |",
        "|" + "---|" * (len(shown) + 1),
    ]
    for r in rows:
        measured, predicted = r["badput_measured_s"], r["badput_predicted_s"]
        cells = [f"{measured.get(c, 0.0):.1f} / {predicted.get(c, 0.0):.1f}" for c in shown]
        lines.append(f"| {r['snapshot_period']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def costs_lines(out: dict) -> list[str]:
    return [
        f"costs measured at snapshot_period={r['snapshot_period']}: step {c['step_s']:.4f} s, snapshot "
        f"{c['snapshot_save_s']:.4f} s, restore {c['snapshot_restore_s']:.4f} s, detect {c['detect_s']:.4f} s, "
        f"first step +{c['first_step_extra_s']:.4f} s, startup {c['startup_s']:.1f} s"
        for r in out["rows"]
        for c in [r["costs"]]
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=0.35, help="injected failures per second (default 0.35)")
    p.add_argument("--steps", type=int, default=8000)
    p.add_argument("--snapshot-periods", type=int, nargs=2, default=[10, 100])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tolerance", type=float, default=5.0, help="allowed error, percentage points")
    p.add_argument("--monte-carlo", type=int, default=200, metavar="TRIALS")
    p.add_argument("--keep", metavar="DIR", help="write the runs under DIR (default: a temporary directory)")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    announce_smoke("60 steps per run")
    steps = 60 if smoke() else args.steps

    from trainer.observe.goodput import CAUSES
    from trainer.observe.runlog import load_run
    from trainer.plan import model
    from trainer.plan.costs import measure

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        cache = f"jax_cache_dir={Path(tmp) / 'jax_cache'}"
        print("warming the compilation cache ...", flush=True)
        run(Path(tmp), "warmup", [*SHAPE, cache, "steps=3", "num_slices=2", "elastic_enabled=true"], devices=2)
        for period in args.snapshot_periods:
            overrides = [
                *SHAPE,
                cache,
                f"steps={steps}",
                "num_slices=2",
                "elastic_enabled=true",
                f"fault_schedule=rate={args.rate},seed={args.seed}",
                f"snapshot_period={period}",
                f"checkpoint_period={steps}",
                "elastic_max_retries=100000",
                "log_period=1000",
            ]
            print(f"running snapshot_period={period} ...", flush=True)
            costs, facts = measure(load_run(run(Path(tmp), f"snap{period}", overrides, devices=2)))
            failures = model.Failures(slices=2, mtbf_per_slice_s=2 / args.rate)
            periods = model.Periods(checkpoint=steps, snapshot=period)
            closed = model.expected(costs, failures, periods, steps, "pause_resume")
            sim = model.simulate(costs, failures, periods, steps, "pause_resume", trials=args.monte_carlo)
            rows.append(measured_row(period, costs, facts, closed, sim))

    out = {
        "steps": steps,
        "rate": args.rate,
        "seed": args.seed,
        "tolerance_points": args.tolerance,
        "monte_carlo_trials": args.monte_carlo,
        "rows": rows,
    }
    out |= judge(rows, args.tolerance)
    tables = {"validation": validation_table(out), "badput": badput_table(out, CAUSES)}
    print(json.dumps(out, indent=2))
    print("\ngoodput in %; 'after startup' leaves out process start to first step")
    print(tables["validation"])
    print("\nbadput by cause, seconds: measured / predicted")
    print(tables["badput"])
    print("\n".join(["", *costs_lines(out)]))
    verdict = f"within {args.tolerance:g} points: {'yes' if out['within_tolerance'] else 'NO'}"
    print(f"{verdict}; ranking agrees: {'yes' if out['ranking_agrees'] else 'NO'}")
    write_record("goodput_planner", "goodput_planner", argv, tables=tables, figures=out)
    return 0 if smoke() or (out["within_tolerance"] and out["ranking_agrees"]) else 1


if __name__ == "__main__":
    sys.exit(main())
