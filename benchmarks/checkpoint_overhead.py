"""Checkpoint cost: loop time blocked per save, step-time overhead at a period, restore speed vs disk.

    python benchmarks/checkpoint_overhead.py [--model qwen3-tiny] [--steps 60] [--period 10]

Runs the CLI with and without checkpointing (async Orbax) and compares MEAN step time (saves are
rare spikes; the mean is what they cost). Then resumes the checkpointed run for one more step to time
the restore, and measures this disk's sequential write (with fsync) and read bandwidth on a file of
the checkpoint's size, the same way, for comparison.
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
from cli_runs import mean, median, read_jsonl, run, step_times  # noqa: E402


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
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--period", type=int, default=10)
    p.add_argument("extra", nargs="*", help="more key=value for the trainer")
    args = p.parse_args()
    common = [f"model={args.model}", f"steps={args.steps}", "log_period=1000", *args.extra]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain = run(root, "plain", [*common, "enable_checkpointing=false"])
        ckpt = run(root, "ckpt", [*common, f"checkpoint_period={args.period}"])
        base_t, ck_t = step_times(plain), step_times(ckpt)
        events = read_jsonl(ckpt / "events.jsonl")
        blocked = [e["seconds"] for e in events if e["event"] == "checkpoint_save_blocked"]
        saved = [e for e in events if e["event"] == "checkpoint_save_committed"]
        run(root, "ckpt", [*common, f"checkpoint_period={args.period}", f"steps={args.steps + 1}",
                           f"learning_rate_schedule_steps={args.steps}"])
        restore = [e for e in read_jsonl(ckpt / "events.jsonl") if e["event"] == "restore_end"][-1]
        nbytes = restore["bytes"]
        write_mb, read_mb = disk_bandwidth(root, nbytes)
    out = {
        "model": args.model, "checkpoint_period": args.period, "saves": len(saved),
        "mean_step_time_s_without": round(mean(base_t), 4), "mean_step_time_s_with": round(mean(ck_t), 4),
        "step_time_overhead": round(mean(ck_t) / mean(base_t) - 1, 4),
        "median_loop_blocked_per_save_s": round(median(blocked), 4) if blocked else None,
        "checkpoint_bytes": nbytes,
        "median_async_save_s": round(median([e["seconds"] for e in saved]), 3) if saved else None,
        "restore_s": restore["seconds"], "restore_mb_per_s": round(nbytes / restore["seconds"] / 1e6, 1),
        "disk_write_mb_per_s_fsync": round(write_mb, 1), "disk_read_mb_per_s": round(read_mb, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
