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
TRAINER_SMOKE=1 runs the same path at minimal sizes (a handful of failures: figures mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import announce_smoke, run, smoke  # noqa: E402

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=0.35, help="injected failures per second (default 0.35)")
    p.add_argument("--steps", type=int, default=8000)
    p.add_argument("--snapshot-periods", type=int, nargs=2, default=[10, 100])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tolerance", type=float, default=5.0, help="allowed error, percentage points")
    p.add_argument("--monte-carlo", type=int, default=200, metavar="TRIALS")
    p.add_argument("--keep", metavar="DIR", help="write the runs under DIR (default: a temporary directory)")
    args = p.parse_args()
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
            rows.append((period, costs, facts, closed, sim))

    print(
        f"\n{steps} steps, failures injected at {args.rate}/s (seed {args.seed}); goodput in %, "
        f"'after startup' leaves out process start to first step"
    )
    head = ("snapshot_period", "failures", "expected", "measured", "predicted", "Monte Carlo", "error")
    print("| " + " | ".join(head) + " | after startup: measured | predicted |")
    print("|" + "---|" * (len(head) + 2))
    ok = True
    for period, costs, facts, closed, sim in rows:
        error = 100 * (closed.goodput - facts.goodput)
        ok &= abs(error) <= args.tolerance
        train_measured = facts.goodput * facts.wall_s / (facts.wall_s - costs.startup_s)
        train_predicted = closed.productive_s / (closed.wall_s - costs.startup_s)
        print(
            f"| {period} | {facts.failures} | {closed.failures:.1f} | {100 * facts.goodput:.1f} | "
            f"{100 * closed.goodput:.1f} | {100 * sim.goodput:.1f} | {error:+.1f} | {100 * train_measured:.1f} | "
            f"{100 * train_predicted:.1f} |"
        )
    for period, costs, *_ in rows:
        print(
            f"costs measured at snapshot_period={period}: step {costs.step_s:.4f} s, snapshot "
            f"{costs.snapshot_save_s:.4f} s, restore {costs.snapshot_restore_s:.4f} s, "
            f"detect {costs.detect_s:.4f} s, first step +{costs.first_step_extra_s:.4f} s, "
            f"startup {costs.startup_s:.1f} s"
        )
    print("\nbadput by cause, seconds: measured / predicted")
    print("| snapshot_period | " + " | ".join(CAUSES) + " |")
    print("|" + "---|" * (len(CAUSES) + 1))
    for period, _, facts, closed, _ in rows:
        cells = [f"{facts.badput_s.get(c, 0.0):.1f} / {closed.badput_s.get(c, 0.0):.1f}" for c in CAUSES]
        print(f"| {period} | " + " | ".join(cells) + " |")
    measured_order = sorted(rows, key=lambda r: r[2].goodput)
    predicted_order = sorted(rows, key=lambda r: r[3].goodput)
    ranked = [r[0] for r in measured_order] == [r[0] for r in predicted_order]
    best = measured_order[-1][0], predicted_order[-1][0]
    print(f"ranking: measured best snapshot_period={best[0]}, predicted best {best[1]}")
    verdict = f"within {args.tolerance:g} points: {'yes' if ok else 'NO'}"
    print(f"{verdict}; ranking agrees: {'yes' if ranked else 'NO'}")
    return 0 if smoke() or (ok and ranked) else 1


if __name__ == "__main__":
    sys.exit(main())
