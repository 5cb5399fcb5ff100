"""Checkpoint cost: loop time blocked per save, step-time overhead at a period, restore speed vs disk.

    python benchmarks/checkpoint_overhead.py [--model qwen3-tiny [qwen3-mini ...]] [--period 100]
        [--save-every N] [--steps N] [--ab] [--tier persistent|local|local-wait ...] [key=value ...]

Runs the CLI with async checkpoints every `--save-every` steps (default: `--period`) for 3 measured saves
(3 N + 5 steps) and reports:
- the time the step loop is blocked inside each save (`checkpoint_save_blocked`), and how much of it
  was waiting for the step still running on the device (which a save must copy, so it waits for it);
- the extra step time each save causes, measured inside the run (see cli_runs.excess_step_time),
  and the step-time overhead at `--period` (default 100: the reference run's checkpoint_period): the
  median extra time per save over `period` baseline steps. A save's cost does not depend on the period
  as long as saves do not overlap, so saving more often than the period measures the same cost in a
  shorter run; the benchmark refuses a run whose saves overlapped (raise `--save-every`);
- with `--ab`, also a run without checkpoints and the ratio of mean step times, the cruder cross-check
  (it compares two runs, so run-to-run noise enters it);
- the restore time of the newest checkpoint (the run resumed for one more step) next to this disk's
  sequential write (fsync) and read bandwidth, measured on a file of the checkpoint's size.
`--tier` picks what is saved: `persistent` (Orbax checkpoints), `local` (the local checkpoint tier:
local_checkpoint_directory on this machine's disk, persistent checkpoints off so the restore reads the
local tier) or `local-wait` (the local tier with local_checkpoint_wait_for_write=true). Each `--model` and
`--tier` is measured one after the other in the same invocation, one column of the table each. It writes
the record benchmarks/records/checkpoint_overhead.json (persistent tier only) or checkpoint_overhead-tiers.json
(any other `--tier`), from which the README's tables are rendered. Extra `key=value` arguments go to the
trainer (e.g. checkpoint_compression=false). TRAINER_SMOKE=1 runs it all at minimal sizes (see cli_runs)
and records nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import (  # noqa: E402
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    excess_step_time,
    mean,
    median,
    read_jsonl,
    run,
    smoke,
    smoke_cap,
    smoke_median,
    smoke_overrides,
    step_records,
    step_times,
)
from records import write_record  # noqa: E402

from trainer.observe import catalogue  # noqa: E402

TIERS = {
    "persistent": "persistent tier only",
    "local": "local tier (default)",
    "local-wait": "local tier, `local_checkpoint_wait_for_write=true`",
}


def disk_bandwidth(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write MB/s with fsync, read MB/s) for one file of nbytes, in 4 MiB blocks."""
    path = directory / "bandwidth.bin"
    block = os.urandom(4 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(block)
            written += len(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(4 << 20):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return written / write_s / 1e6, written / read_s / 1e6


def tier_overrides(tier: str, root: Path, every: int) -> list[str]:
    """The trainer arguments that save `tier` every `every` steps."""
    if tier == "persistent":
        return [f"checkpoint_period={every}", "max_num_checkpoints_to_keep=2"]
    local = [f"local_checkpoint_directory={root / 'node_local'}", f"local_checkpoint_period={every}"]
    wait = ["local_checkpoint_wait_for_write=true"] if tier == "local-wait" else []
    return ["enable_checkpointing=false", *local, *wait]


def save_events(tier: str) -> tuple[str, str, str]:
    """(blocked, start, committed) events of `tier`'s saves: the local tier has its own."""
    c = catalogue
    if tier == "persistent":
        return c.CHECKPOINT_SAVE_BLOCKED, c.CHECKPOINT_SAVE_START, c.CHECKPOINT_SAVE_COMMITTED
    return c.LOCAL_CHECKPOINT_SAVE_BLOCKED, c.LOCAL_CHECKPOINT_SAVE_START, c.LOCAL_CHECKPOINT_SAVE_COMMITTED


def overlapping_saves(run_dir: Path, start: str, end: str) -> list[tuple[int, int]]:
    """Pairs of consecutive saves (a, b) where a's cost window (up to the step after the first step that
    completed once a had committed, as in excess_step_time) reaches b: their costs are then mixed, and
    the cost per save would depend on the period."""
    done_at = {r["step"]: r["time"] for r in step_records(run_dir)}
    events = read_jsonl(run_dir / "events.jsonl")
    ends = {e["step"]: e["time"] for e in events if e["event"] == end}
    starts = sorted(e["step"] for e in events if e["event"] == start)
    out = []
    for a, b in zip(starts, starts[1:]):
        after = [s for s in sorted(done_at) if s >= a and done_at[s] >= ends[a]] if a in ends else []
        if not after or after[0] + 1 >= b:
            out.append((a, b))
    return out


def measure(root: Path, model: str, tier: str, args, common: list[str], plain: dict) -> dict:
    """One column: a run saving `tier` every `args.save_every` steps, then its restore. `plain` caches the
    run without checkpoints per model (`--ab`)."""
    root = root / f"{model}-{tier}"
    root.mkdir()
    blocked_event, start, end = save_events(tier)
    ckpt_args = [*common, *tier_overrides(tier, root, args.save_every)]
    ckpt = run(root, "ckpt", ckpt_args)
    overlaps = overlapping_saves(ckpt, start, end)
    if overlaps:
        text = ", ".join(f"{a} and {b}" for a, b in overlaps)
        message = (
            f"{model}, {tier}: the saves of steps {text} overlapped, so the cost per save depends on the period"
        )
        if not smoke():
            sys.exit(f"{message}: give a larger --save-every (at most --period {args.period})")
        print(f"{message} (smoke run: no matter)", file=sys.stderr)
    events = read_jsonl(ckpt / "events.jsonl")
    blocked = [e for e in events if e["event"] == blocked_event]
    saved = [e for e in events if e["event"] == end]
    excess, base = excess_step_time(ckpt, start, end)
    per_save = smoke_median(excess)
    out = {
        "model": model,
        "tier": tier,
        "checkpoint_period": args.period,
        "save_every": args.save_every,
        "steps": args.steps,
        "extra": args.extra,
        "saves": len(saved),
        "baseline_step_time_s": round(base, 4),
        "median_loop_blocked_per_save_s": round(median([e["seconds"] for e in blocked]), 4),
        # The local tier's blocked time has no part waiting for the step: None, not 0.
        "median_of_which_waiting_for_the_step_s": (
            round(median([e["waited_for_step_s"] for e in blocked]), 4) if tier == "persistent" else None
        ),
        "median_async_save_s": round(median([e["seconds"] for e in saved]), 3),
        "extra_step_time_per_save_s": [round(x, 3) for x in excess],
        "step_time_overhead_at_period": None if per_save is None else round(per_save / (args.period * base), 4),
    }
    if args.ab:
        if model not in plain:
            plain[model] = run(root, "plain", [*common, "enable_checkpointing=false"])
        without, with_ = mean(step_times(plain[model])), mean(step_times(ckpt))
        out["ab_mean_step_time_s_without"] = round(without, 4)
        out["ab_mean_step_time_s_with"] = round(with_, 4)
        out["ab_step_time_overhead"] = round(with_ / without - 1, 4)
    run(root, "ckpt", [*ckpt_args, f"steps={args.steps + 1}", f"learning_rate_schedule_steps={args.steps}"])
    restore = [e for e in read_jsonl(ckpt / "events.jsonl") if e["event"] == catalogue.RESTORE_END][-1]
    assert restore["source"].startswith("checkpoint:" if tier == "persistent" else "local:"), restore
    nbytes = restore["bytes"]
    write_mb, read_mb = disk_bandwidth(root, nbytes)
    return out | {
        "checkpoint_bytes": nbytes,
        "restore_s": restore["seconds"],
        "restore_mb_per_s": round(nbytes / restore["seconds"] / 1e6, 1),
        "disk_write_mb_per_s_fsync": round(write_mb, 1),
        "disk_read_mb_per_s": round(read_mb, 1),
    }


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _blocked(c: dict) -> str:
    return f"{_ms(c['median_loop_blocked_per_save_s'])} ({_ms(c['median_of_which_waiting_for_the_step_s'])})"


def _overhead(c: dict) -> str:
    x = c["step_time_overhead_at_period"]
    return "**n/a**" if x is None else f"**{x:.1%}**"


def _restore(c: dict) -> str:
    return f"{c['restore_s']:.2f} s ({c['checkpoint_bytes'] / 1e6:.0f} MB at {c['restore_mb_per_s']:.0f} MB/s)"


def _disk(c: dict) -> str:
    write, read = c["disk_write_mb_per_s_fsync"], c["disk_read_mb_per_s"] / 1e3
    return f"write {write:.0f} MB/s (fsync), read {read:.1f} GB/s (page cache)"


def _rows(period: int, ab: bool) -> list[tuple[str, object]]:
    """(row label, cell of a column) of the table, top to bottom."""
    rows = [
        ("baseline step (median outside saves)", lambda c: f"{c['baseline_step_time_s']:.3f} s"),
        ("loop blocked per save (of which waiting for the step being saved)", _blocked),
        ("background write per save", lambda c: f"{c['median_async_save_s']:.2f} s"),
        (
            "extra step time per save, in the run",
            lambda c: (
                ", ".join(f"{x:.2f}" for x in c["extra_step_time_per_save_s"]) + " s"
                if c["extra_step_time_per_save_s"]
                else "none"
            ),
        ),
        (
            f"**step-time overhead at period {period}** (median extra step time per save ÷ {period} steps)",
            _overhead,
        ),
        ("restore (read + place on devices)", _restore),
        ("this disk, a file of the same size", _disk),
    ]
    if ab:
        rows.append(
            (
                "mean step time against a run without saves (A/B, cruder)",
                lambda c: f"{c['ab_step_time_overhead']:+.1%}",
            )
        )
    return rows


def _headers(cols: list[dict]) -> tuple[str, list[str]]:
    """(corner, column labels): what all columns share goes in the corner, what differs labels them."""
    vary_tier = len({c["tier"] for c in cols}) > 1
    vary_model = len({c["model"] for c in cols}) > 1 or not vary_tier  # one column: labelled by its model

    def parts(c, varying):
        return ([c["model"]] if vary_model == varying else []) + (
            [TIERS[c["tier"]]] if vary_tier == varying else []
        )

    first = cols[0]
    corner = [
        *parts(first, False),
        f"a save every {first['save_every']} steps, {first['steps']} steps",
        *first["extra"],
    ]
    return ", ".join(corner), [", ".join(parts(c, True)) for c in cols]


def table(cols: list[dict]) -> str:
    """Markdown: one column per (model, tier) measured, in the order measured."""
    corner, labels = _headers(cols)
    lines = [f"| {corner} | " + " | ".join(labels) + " |", "|---|" + "---|" * len(cols)]
    for name, cell in _rows(cols[0]["checkpoint_period"], "ab_step_time_overhead" in cols[0]):
        lines.append(f"| {name} | " + " | ".join(cell(c) for c in cols) + " |")
    return "\n".join(lines)


def record_id(tiers: list[str]) -> str:
    """checkpoint_overhead for the persistent tier alone (the models' table), else checkpoint_overhead-tiers."""
    return "checkpoint_overhead" if tiers == ["persistent"] else "checkpoint_overhead-tiers"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["qwen3-tiny"], help="models, measured in turn")
    p.add_argument("--period", type=int, default=100, help="the checkpoint period the overhead is given at")
    p.add_argument("--save-every", type=int, help="save every N steps (default: --period); 3 saves are measured")
    p.add_argument("--steps", type=int, default=0, help="default: 3 N + 5 steps (3 measured saves)")
    p.add_argument("--ab", action="store_true", help="also run without checkpoints and compare mean step times")
    p.add_argument(
        "--tier", nargs="+", choices=list(TIERS), default=["persistent"], help="tiers, measured in turn"
    )
    p.add_argument("extra", nargs="*", help="more key=value for the trainer")
    argv = sys.argv[1:]
    # key=value arguments go to the trainer wherever they stand (`--model a b` would otherwise take them).
    args = p.parse_args([a for a in argv if "=" not in a or a.startswith("-")])
    args.extra = [a for a in argv if "=" in a and not a.startswith("-")]
    args.period = smoke_cap(args.period, 2)
    args.save_every = smoke_cap(args.save_every or args.period, 2)
    args.steps = smoke_cap(args.steps or 3 * args.save_every + 5, 8)
    announce_smoke(
        f"checkpoint period {args.period}, a save every {args.save_every}, {args.steps} steps, {SMOKE_SHAPE_TEXT}"
    )
    cols, plain = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model:
            common = smoke_overrides(
                [f"model={model}", f"steps={args.steps}", "log_period=1000", *args.extra], **SMOKE_SHAPE
            )
            for tier in args.tier:
                cols.append(measure(Path(tmp), model, tier, args, common, plain))
    print(json.dumps(cols, indent=2))
    print(table(cols))
    write_record(record_id(args.tier), "checkpoint_overhead", argv, tables={"overhead": table(cols)}, figures=cols)


if __name__ == "__main__":
    main()
