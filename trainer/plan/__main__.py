"""CLI: `python -m trainer.plan [RUN_DIR] --slices N --mtbf-per-slice 2h [cost flags] [--plot PATH]`.

Prints the expected goodput of pause-and-resume, replica-resize and full restart, the save periods
(checkpoint_period, local_checkpoint_period, snapshot_period) that minimise the expected wall time, and
the badput by cause in the report's categories; writes a plot of goodput against cluster size.

Costs come from RUN_DIR (measured from its events.jsonl and metrics.jsonl, see trainer.plan.costs) or from
flags; a flag beats a measured value, so a small local run can be replayed with a cluster's reschedule
time. The failure model: the cluster's slices, MTBF per slice (or per chip), and the share of failures
that kill the process rather than only a slice. Durations take s, m, h or d (`2h`, `90m`, `3600`).

Exit codes: 0 plan printed and plot written; 2 (one line `python -m trainer.plan: error: ...`) a bad
flag, no run directory there, or an unwritable plot path.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys

from trainer.config.schema import ElasticConfig
from trainer.elastic.retry_budget import RetryBudget
from trainer.errors import UserInputError, tool_main
from trainer.plan import model
from trainer.plan.auto import measurable_tiers, snapshot_floor
from trainer.plan.model import MODES, TIERS, Costs, Failures, Periods

PROG = "python -m trainer.plan"
_AUTO_OVERHEAD = ElasticConfig.auto_snapshot_max_overhead
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
COST_FLAGS = [f.name for f in dataclasses.fields(Costs)]
KEYS = {"checkpoint": "checkpoint_period", "local": "local_checkpoint_period", "snapshot": "snapshot_period"}


def duration(text: str) -> float:
    """'2h' -> 7200.0; a plain number is seconds."""
    t = text.strip().lower()
    scale = UNITS.get(t[-1:], None)
    try:
        value = float(t[:-1] if scale else t) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 45s, 30m, 2h, 7d)") from None
    if not 0 < value <= math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be > 0")
    return value


def _parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", help="a run directory to measure costs from (optional)")
    g = p.add_argument_group("failure model")
    g.add_argument("--slices", type=int, help="slices in the cluster (default: the run's num_slices)")
    g.add_argument("--chips-per-slice", type=int, help="chips per slice (default: the run's devices per slice)")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--mtbf-per-slice", type=duration, help="mean time between failures of one slice")
    rate.add_argument("--mtbf-per-chip", type=duration, help="mean time between failures of one chip")
    g.add_argument(
        "--process-kill-share",
        type=float,
        default=0.0,
        help="share of failures that kill the process (host snapshots lost), not only a slice (default 0)",
    )
    g.add_argument("--steps", type=int, help="run length in steps (default: the run's steps, else 100000)")
    g.add_argument(
        "--elastic-max-retries",
        type=int,
        default=RetryBudget.max_retries,
        help="the trainer gives up (exit 3) past this many failures within --elastic-retry-window-steps "
        f"steps of progress (default {RetryBudget.max_retries}, the trainer's)",
    )
    g.add_argument(
        "--elastic-retry-window-steps",
        type=int,
        default=RetryBudget.window_steps,
        help=f"the window of --elastic-max-retries (default {RetryBudget.window_steps}, the trainer's)",
    )
    for key in KEYS.values():
        g.add_argument("--" + key.replace("_", "-"), type=int, metavar="STEPS", help=f"evaluate this {key} too")
    c = p.add_argument_group("costs in seconds (override what RUN_DIR measured)")
    for name in COST_FLAGS:
        c.add_argument("--" + name.replace("_", "-"), type=float, metavar="S")
    c.add_argument("--state-gib", type=float, help="train state size; with a tier's GiB/s, sets its write/restore")
    for tier in TIERS:
        c.add_argument(f"--{tier}-gibps", type=float, metavar="GIB_S", help=f"{tier} bandwidth, GiB/s")
    c.add_argument(
        "--auto-snapshot-max-overhead",
        type=float,
        default=_AUTO_OVERHEAD,
        metavar="SHARE",
        help="the trainer's auto_snapshot_max_overhead: prints the snapshot period auto chooses "
        f"(default {_AUTO_OVERHEAD:g}, the trainer's)",
    )
    c.add_argument(
        "--keep",
        default="",
        help="tiers whose period stays as the run (or its flag) has it while the others are recommended, "
        "comma-separated: what a run with some periods given and the others auto plans",
    )
    c.add_argument(
        "--tiers",
        default="checkpoint,local,snapshot",
        help="the save tiers the trainer may use, comma-separated (default checkpoint,local,snapshot; each "
        "only where its costs are known: measured, or given as flags)",
    )
    s = p.add_argument_group("silent data corruption (sdc_check_period)")
    s.add_argument(
        "--sdc-mtbf-per-chip", type=duration, help="mean time until a chip starts computing wrong numbers"
    )
    s.add_argument(
        "--sdc-check-s", type=float, metavar="S", help="one replay check (default: RUN_DIR's, else 2 steps)"
    )
    o = p.add_argument_group("output")
    o.add_argument("--monte-carlo", type=int, default=0, metavar="TRIALS", help="also replay TRIALS runs")
    o.add_argument("--max-chips", type=int, default=65536, help="the plot's largest cluster (default 65536)")
    o.add_argument("--plot", help="PNG path (default RUN_DIR/plan.png, else plan.png)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    return tool_main(PROG, lambda: plan(args))


def _inputs(args):
    """(costs, facts or None) from the run directory and the flags."""
    facts = None
    costs = Costs(step_s=0.0)
    if args.run_dir:
        from trainer.observe.runlog import load_run
        from trainer.plan.costs import measure

        costs, facts = measure(load_run(args.run_dir))
    given = {n: getattr(args, n) for n in COST_FLAGS if getattr(args, n) is not None}
    if args.state_gib is not None:
        for tier in TIERS:
            gibps = getattr(args, f"{tier}_gibps")
            if gibps:
                given.setdefault(f"{tier}_write_s", args.state_gib / gibps)
                given.setdefault(f"{tier}_restore_s", args.state_gib / gibps)
    costs = dataclasses.replace(costs, **given)
    if costs.step_s <= 0:
        raise UserInputError("no step time: give a RUN_DIR to measure it from, or --step-s SECONDS")
    return costs, facts


def plan(args) -> int:
    costs, facts = _inputs(args)
    slices = args.slices or (facts.slices if facts else None)
    if not slices or slices < 1:
        raise UserInputError("--slices N is needed (how many slices the cluster has), N >= 1")
    per_slice = args.chips_per_slice or (facts.devices_per_slice if facts else 1)
    if args.mtbf_per_chip:
        mtbf = args.mtbf_per_chip / per_slice
    elif args.mtbf_per_slice:
        mtbf = args.mtbf_per_slice
    else:
        raise UserInputError("give the failure rate: --mtbf-per-slice DURATION or --mtbf-per-chip DURATION")
    if not 0 <= args.process_kill_share <= 1:
        raise UserInputError(f"--process-kill-share {args.process_kill_share}: must be in [0, 1]")
    steps = args.steps or (facts.steps if facts else 100_000)
    # A tier whose costs are all unknown (zero) is not recommended: it would look free.
    listed = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    if "checkpoint" not in listed or set(listed) - set(TIERS):
        raise UserInputError(f"--tiers {args.tiers}: list some of {','.join(TIERS)}, checkpoint included")
    available = measurable_tiers(costs, listed)
    keep = tuple(t.strip() for t in args.keep.split(",") if t.strip())
    if set(keep) - set(TIERS):
        raise UserInputError(f"--keep {args.keep}: list some of {','.join(TIERS)}")
    failures = Failures(slices, mtbf, args.process_kill_share)
    plot_path = args.plot or (os.path.join(args.run_dir, "plan.png") if args.run_dir else "plan.png")
    _check_writable(plot_path)

    print(_costs_text(costs, args.run_dir))
    print(
        f"failure model: {slices} slices x {per_slice} chips, MTBF {_dur(mtbf)} per slice -> one failure every "
        f"{_dur(1 / failures.rate_s)}; {args.process_kill_share:.0%} kill the process; run of {steps} steps"
    )
    if args.elastic_max_retries < 0 or args.elastic_retry_window_steps < 1:
        raise UserInputError("--elastic-max-retries must be >= 0 and --elastic-retry-window-steps >= 1")
    budget = RetryBudget(args.elastic_max_retries, args.elastic_retry_window_steps)
    given = [getattr(args, KEYS[t]) for t in TIERS]
    run = (facts.snapshot_period, facts.local_checkpoint_period, facts.checkpoint_period) if facts else (0, 0, 0)
    snap, local_p, ckpt = (v if v is not None else r for v, r in zip(given, run, strict=True))
    current = Periods(ckpt or steps, local_p, snap)
    fixed = {t: current.of(t) for t in keep}
    recommended = {
        m: model.recommend(costs, failures, steps, m, available=available, budget=budget, fixed=fixed)
        for m in MODES
    }
    if facts or any(v is not None for v in given):
        modes = MODES
        if facts:
            modes = ("pause_resume" if facts.min_slices in (-1, facts.slices) else "replica_resize",)
        print(f"at {_periods(current)}:")
        for mode in modes:
            now = model.expected(costs, failures, current, steps, mode, budget)
            print(
                f"  {mode:<16} expected goodput {now.goodput:.1%} (useful {now.useful_goodput:.1%}), "
                f"{now.failures:.1f} failures, wall {_dur(now.wall_s)}, gives up: {_chance(now.gave_up)}"
            )
        if facts and facts.goodput is not None:
            measured = f"goodput {facts.goodput:.1%}, {facts.failures} failures, wall {_dur(facts.wall_s)}"
            print(f"  (measured: {measured})")
    print(_table(recommended, costs, failures, steps, args.monte_carlo, budget))
    floor = snapshot_floor(costs, args.auto_snapshot_max_overhead)
    if "snapshot" in available and "snapshot" not in keep and floor is not None:
        chosen = [min(recommended[m][0].snapshot or steps, floor) for m in MODES if m != "full_restart"]
        print(
            f"auto snapshot_period (auto_snapshot_max_overhead={args.auto_snapshot_max_overhead:g}: at least "
            f"every {floor} steps): " + ", ".join(f"{m} {p}" for m, p in zip(MODES, chosen, strict=False))
        )
    if args.sdc_mtbf_per_chip:
        print(_sdc_text(costs.step_s, _sdc_check_s(args, costs), slices * per_slice / args.sdc_mtbf_per_chip))
    _plot(plot_path, costs, failures, per_slice, steps, available, args.max_chips)
    print(f"plot written to {plot_path}")
    return 0


def _sdc_check_s(args, costs: Costs) -> float:
    """One replay check's seconds: given, else the run's median `sdc_check_s`, else two steps' worth."""
    if args.sdc_check_s is not None:
        return args.sdc_check_s
    if args.run_dir:
        from trainer.observe.runlog import load_run

        checks = [r["sdc_check_s"] for r in load_run(args.run_dir).records if r.get("sdc_check_s")]
        if checks:
            return statistics.median(checks)
    return 2.0 * costs.step_s


def _sdc_text(step_s: float, check_s: float, rate_s: float) -> str:
    period = model.sdc_check_period(step_s, check_s, rate_s)
    checks, lost = model.sdc_check_cost(step_s, check_s, period, rate_s)
    return (
        f"silent data corruption: a bad chip every {_dur(1 / rate_s)}, a check {check_s:.3g} s -> "
        f"sdc_check_period={period} (checks {checks:.2%} of step time, rolled-back steps {lost:.2%})"
    )


def _chance(p: float) -> str:
    return "never" if p < 1e-6 else f"{p:.2%}"


def _table(recommended, costs, failures, steps, trials, budget) -> str:
    from trainer.observe.goodput import CAUSES

    w = 16
    head = f"{'':<28}" + "".join(f"{m:>{w}}" for m in MODES)
    lines = ["recommended periods and expected goodput (periods minimise the expected wall time):", head]
    for tier in TIERS:
        cells = [recommended[m][0].of(tier) or "off" for m in MODES]
        lines.append(f"  {KEYS[tier]:<26}" + "".join(f"{str(c):>{w}}" for c in cells))
    outcomes = {m: recommended[m][1] for m in MODES}
    rows = [
        ("goodput (as reported)", lambda o: f"{o.goodput:.1%}"),
        ("useful goodput", lambda o: f"{o.useful_goodput:.1%}"),
        ("failures", lambda o: f"{o.failures:.1f}"),
        (f"gives up (>{budget.max_retries} in {budget.window_steps})", lambda o: _chance(o.gave_up)),
        ("wall time", lambda o: _dur(o.wall_s)),
    ]
    for name, cell in rows:
        lines.append(f"  {name:<26}" + "".join(f"{cell(outcomes[m]):>{w}}" for m in MODES))
    if trials:
        sims = {
            m: model.simulate(costs, failures, recommended[m][0], steps, m, trials=trials, budget=budget)
            for m in MODES
        }
        lines.append(f"  {'goodput, Monte Carlo':<26}" + "".join(f"{sims[m].goodput:>{w}.1%}" for m in MODES))
        lines.append(f"  {'gave up, Monte Carlo':<26}" + "".join(f"{sims[m].gave_up:>{w}.1%}" for m in MODES))
    lines.append("  badput by cause (share of wall time):")
    for cause in CAUSES:
        cells = [outcomes[m].badput_s.get(cause, 0.0) / outcomes[m].wall_s for m in MODES]
        lines.append(f"    {cause:<24}" + "".join(f"{c:>{w}.1%}" for c in cells))
    rate = failures.rate_s
    yd = [
        f"{KEYS[t]} {model.young_daly_steps(getattr(costs, f'{t}_save_s'), 1 / rate, costs.step_s):.0f}"
        for t in TIERS
        if getattr(costs, f"{t}_save_s") > 0
    ]
    if yd:
        lines.append("  Young/Daly sqrt(2 x save cost x MTBF), in steps: " + ", ".join(yd))
    return "\n".join(lines)


def _costs_text(costs: Costs, run_dir) -> str:
    where = f"measured from {run_dir}; flags override" if run_dir else "given"
    cells = [f"{f.name[:-2]} {getattr(costs, f.name):.4g}" for f in dataclasses.fields(Costs)]
    rows = [", ".join(cells[i : i + 6]) for i in range(0, len(cells), 6)]
    return f"costs in seconds ({where}):\n  " + "\n  ".join(rows)


def _periods(p: Periods) -> str:
    return ", ".join(f"{KEYS[t]}={p.of(t)}" for t in TIERS)


def _dur(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _check_writable(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UserInputError(f"--plot {path}: {parent} is not a writable directory; name a path in one")
    if not path.lower().endswith(".png"):
        raise UserInputError(f"--plot {path}: the plot is a PNG; name a .png file")


def cluster_sweep(costs, failures, per_slice, steps, available, max_chips, points=9):
    """(chips, {mode: goodput at its recommended periods}) for clusters of one slice up to max_chips."""
    most = max(1, max_chips // per_slice)
    sizes = sorted({max(1, round(most ** (i / (points - 1)))) for i in range(points)} | {failures.slices})
    out = []
    for n in sizes:
        f = dataclasses.replace(failures, slices=n)
        out.append(
            (n * per_slice, {m: model.recommend(costs, f, steps, m, available=available)[1] for m in MODES})
        )
    return out


def _plot(path, costs, failures, per_slice, steps, available, max_chips) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = cluster_sweep(costs, failures, per_slice, steps, available, max_chips)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in MODES:
        ax.plot([c for c, _ in sweep], [o[mode].useful_goodput * 100 for _, o in sweep], marker="o", label=mode)
    ax.axvline(failures.slices * per_slice, color="grey", linestyle=":", label="this cluster")
    ax.set_xscale("log")
    ax.set_xlabel(f"chips ({per_slice} per slice; MTBF {_dur(failures.mtbf_per_slice_s)} per slice)")
    ax.set_ylabel("expected useful goodput, % (recommended periods)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
