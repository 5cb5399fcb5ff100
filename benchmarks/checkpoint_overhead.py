"""Checkpoint cost: loop time blocked per save, step-time overhead at a period, restore speed vs disk.

    python benchmarks/checkpoint_overhead.py [--model qwen3-tiny] [--period 100] [--steps N] [--ab]
                                             [--tier persistent|local] [key=value ...]

Runs the CLI with async Orbax checkpoints every `--period` steps (default 100: the reference run's
checkpoint_period) and reports:
- the time the step loop is blocked inside each save (`checkpoint_save_blocked`), and how much of it
  was waiting for the step still running on the device (which a save must copy, so it waits for it);
- the extra step time each save causes, measured inside the run (see cli_runs.excess_step_time),
  and the step-time overhead at the period: that extra time over `period` baseline steps;
- with `--ab`, also a second run without checkpoints and the ratio of mean step times, the cruder
  cross-check (run-to-run noise here is a few percent);
- the restore time of the newest checkpoint (the run resumed for one more step) next to this disk's
  sequential write (fsync) and read bandwidth, measured on a file of the checkpoint's size.
`--tier local` measures the local checkpoint tier instead (local_checkpoint_directory on this machine's
disk, saving every `--period` steps, persistent checkpoints off so the restore reads the local tier).
Extra `key=value` arguments go to the trainer (e.g. checkpoint_compression=false). TRAINER_SMOKE=1 runs
it all at minimal sizes (see cli_runs).
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
from cli_runs import (
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    excess_step_time,
    mean,  # noqa: E402
    median,
    read_jsonl,
    run,
    smoke_cap,
    smoke_median,
    smoke_overrides,
    step_times,
)

from trainer.observe import catalogue  # noqa: E402


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--period", type=int, default=100)
    p.add_argument("--steps", type=int, default=0, help="default: 3 periods + 5 steps (3 measured saves)")
    p.add_argument("--ab", action="store_true", help="also run without checkpoints and compare mean step times")
    p.add_argument("--tier", choices=["persistent", "local"], default="persistent", help="the tier to measure")
    p.add_argument("extra", nargs="*", help="more key=value for the trainer")
    args = p.parse_args()
    args.period = smoke_cap(args.period, 2)
    steps = smoke_cap(args.steps or 3 * args.period + 5, 8)
    common = smoke_overrides(
        [f"model={args.model}", f"steps={steps}", "log_period=1000", *args.extra], **SMOKE_SHAPE
    )
    announce_smoke(f"checkpoint period {args.period}, {steps} steps, {SMOKE_SHAPE_TEXT}")
    local = args.tier == "local"  # the local tier has save events of its own
    if local:
        blocked_event, start, end = (
            catalogue.LOCAL_CHECKPOINT_SAVE_BLOCKED,
            catalogue.LOCAL_CHECKPOINT_SAVE_START,
            catalogue.LOCAL_CHECKPOINT_SAVE_COMMITTED,
        )
    else:
        blocked_event, start, end = (
            catalogue.CHECKPOINT_SAVE_BLOCKED,
            catalogue.CHECKPOINT_SAVE_START,
            catalogue.CHECKPOINT_SAVE_COMMITTED,
        )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.tier == "local":
            tier = [f"local_checkpoint_directory={root / 'node_local'}", f"local_checkpoint_period={args.period}"]
            ckpt_args = [*common, "enable_checkpointing=false", *tier]
        else:
            ckpt_args = [*common, f"checkpoint_period={args.period}", "max_num_checkpoints_to_keep=2"]
        ckpt = run(root, "ckpt", ckpt_args)
        events = read_jsonl(ckpt / "events.jsonl")
        blocked = [e for e in events if e["event"] == blocked_event]
        saved = [e for e in events if e["event"] == end]
        excess, base = excess_step_time(ckpt, start, end)
        waited = [e.get("waited_for_step_s", 0.0) for e in blocked]  # the local tier does not wait apart
        per_save = smoke_median(excess)
        out = {
            "model": args.model,
            "tier": args.tier,
            "checkpoint_period": args.period,
            "steps": steps,
            "extra": args.extra,
            "saves": len(saved),
            "baseline_step_time_s": round(base, 4),
            "median_loop_blocked_per_save_s": round(median([e["seconds"] for e in blocked]), 4),
            "median_of_which_waiting_for_the_step_s": round(median(waited), 4),
            "median_async_save_s": round(median([e["seconds"] for e in saved]), 3),
            "extra_step_time_per_save_s": [round(x, 3) for x in excess],
            "step_time_overhead_at_period": None
            if per_save is None
            else round(per_save / (args.period * base), 4),
        }
        if args.ab:
            plain = run(root, "plain", [*common, "enable_checkpointing=false"])
            out["ab_mean_step_time_s_without"] = round(mean(step_times(plain)), 4)
            out["ab_mean_step_time_s_with"] = round(mean(step_times(ckpt)), 4)
            out["ab_step_time_overhead"] = round(mean(step_times(ckpt)) / mean(step_times(plain)) - 1, 4)
        run(root, "ckpt", [*ckpt_args, f"steps={steps + 1}", f"learning_rate_schedule_steps={steps}"])
        restore = [e for e in read_jsonl(ckpt / "events.jsonl") if e["event"] == catalogue.RESTORE_END][-1]
        assert restore["source"].startswith("local:" if local else "checkpoint:"), restore
        nbytes = restore["bytes"]
        write_mb, read_mb = disk_bandwidth(root, nbytes)
    out.update(
        {
            "checkpoint_bytes": nbytes,
            "restore_s": restore["seconds"],
            "restore_mb_per_s": round(nbytes / restore["seconds"] / 1e6, 1),
            "disk_write_mb_per_s_fsync": round(write_mb, 1),
            "disk_read_mb_per_s": round(read_mb, 1),
        }
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
