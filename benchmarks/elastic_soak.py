"""Hundreds of recoveries in one process: do memory, threads, open files or recovery time grow?

    python benchmarks/elastic_soak.py [--failures 200] [--rate 1.0]

Runs one elastic trainer process on 2 virtual CPU slices (a small model, snapshots auto, a checkpoint
only at the end), with Poisson slice failures at `--rate` per second of wall time and immediate
replacements (pause-and-resume), until it has recovered `--failures` times; then stops it with SIGTERM.
While it runs, the process's resident memory, threads and open files are sampled from /proc every 0.2 s.
Reported per recovery k (the k-th `first_step_after_recovery`): the recovery time (failure detected ->
first completed step) and the RSS, threads and open files sampled right after it; and the least-squares
slope of each against k, per 100 recoveries, over the second half of the recoveries (the first ones
still warm caches: compiled layouts, allocator pools). Flat means the slope is within the noise.

TRAINER_SMOKE=1: 4 recoveries, no record.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_runs import announce_smoke, env_with_devices, read_jsonl, smoke, trainer_cmd  # noqa: E402
from records import write_record  # noqa: E402

from trainer.observe import catalogue  # noqa: E402

SHAPE = [
    "base_num_decoder_layers=2", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2",
    "head_dim=16", "base_mlp_dim=128", "vocab_size=512", "max_target_length=32", "per_device_batch_size=2",
]  # fmt: skip


def _proc(pid: int) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        return {
            "time": time.time(),
            "rss_mb": rss_kb / 1024,
            "threads": len(os.listdir(f"/proc/{pid}/task")),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
        }
    except (OSError, StopIteration):
        return None


def slope_per_100(ys: list[float]) -> float:
    """Least-squares slope of ys against their index, per 100 steps of the index."""
    n = len(ys)
    if n < 2:
        return 0.0
    xs = range(n)
    mx, my = (n - 1) / 2, statistics.fmean(ys)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def soak(root: Path, failures: int, rate: float) -> list[dict]:
    overrides = [
        *SHAPE,
        "num_slices=2",
        "elastic_enabled=true",
        # The final step only: at one failure a second the auto period (rightly) checkpoints every few
        # seconds, which would measure the save path, not the recovery's.
        "checkpoint_period=100000000",
        "steps=100000000",
        "elastic_poll_interval_seconds=0.05",
        f"elastic_max_retries={10 * failures}",
        f"fault_schedule=rate={rate},seed=1,down_s=0",
    ]
    run_dir = root / "soak"
    log = open(root / "soak.log", "w")  # a pipe nobody reads while it runs would fill and block its logging
    proc = subprocess.Popen(
        trainer_cmd(root, "soak", overrides), stdout=subprocess.DEVNULL, stderr=log, env=env_with_devices(2)
    )
    samples: list[dict] = []
    events_file = run_dir / "events.jsonl"
    try:
        while proc.poll() is None:
            if (s := _proc(proc.pid)) is not None:
                samples.append(s)
            recovered = 0
            if events_file.exists():
                recovered = sum(
                    1 for e in read_jsonl(events_file) if e["event"] == catalogue.FIRST_STEP_AFTER_RECOVERY
                )
            if recovered >= failures:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.2)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    if proc.returncode not in (0, 42):
        sys.exit(f"the soak run failed ({proc.returncode}):\n{(root / 'soak.log').read_text()[-3000:]}")
    rows = []
    for k, e in enumerate(
        (e for e in read_jsonl(events_file) if e["event"] == catalogue.FIRST_STEP_AFTER_RECOVERY), 1
    ):
        after = next((s for s in samples if s["time"] >= e["time"]), None)
        if after is None or k > failures:
            break
        rows.append(
            {
                "recovery": k,
                "seconds": e["seconds_since_detection"],
                **{x: after[x] for x in ("rss_mb", "threads", "fds")},
            }
        )
    return rows


def summary(rows: list[dict]) -> dict:
    half = rows[len(rows) // 2 :]
    out = {"recoveries": len(rows)}
    for key, unit in (("seconds", "s"), ("rss_mb", "MB"), ("threads", ""), ("fds", "")):
        ys = [r[key] for r in half]
        out[key] = {
            "first": rows[0][key] if rows else None,
            "median_second_half": statistics.median(ys) if ys else None,
            "last": rows[-1][key] if rows else None,
            "slope_per_100": round(slope_per_100(ys), 4),
            "unit": unit,
        }
    return out


def table(s: dict) -> str:
    names = {"seconds": "recovery time", "rss_mb": "resident memory", "threads": "threads", "fds": "open files"}
    lines = [
        f"| over {s['recoveries']} recoveries | after the 1st | median, 2nd half | after the last "
        "| slope per 100 recoveries, 2nd half |",
        "|---|---|---|---|---|",
    ]
    for key, name in names.items():
        v, unit = s[key], s[key]["unit"]
        fmt = (
            (lambda x: f"{x:.3f} s")
            if key == "seconds"
            else (lambda x: f"{x:,.0f} MB")
            if unit == "MB"
            else (lambda x: f"{x:g}")
        )
        slope = (
            f"{v['slope_per_100']:+.3f} s"
            if key == "seconds"
            else f"{v['slope_per_100']:+.1f}{' MB' if unit == 'MB' else ''}"
        )
        lines.append(
            f"| {name} | {fmt(v['first'])} | {fmt(v['median_second_half'])} | {fmt(v['last'])} | {slope} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--failures", type=int, default=200)
    p.add_argument("--rate", type=float, default=1.0, help="injected slice failures per second of wall time")
    args = p.parse_args(argv)
    failures = args.failures
    if smoke():
        failures = min(failures, 4)
        announce_smoke(f"{failures} recoveries")
    with tempfile.TemporaryDirectory() as tmp:
        rows = soak(Path(tmp), failures, args.rate)
    if not rows:
        sys.exit("no recovery completed")
    s = summary(rows)
    print(json.dumps(s, indent=2))
    every = max(1, len(rows) // 10)
    print("recovery  seconds  rss_mb  threads  fds")
    for r in rows[::every]:
        print(f"{r['recovery']:>8}  {r['seconds']:7.3f}  {r['rss_mb']:6.0f}  {r['threads']:7}  {r['fds']:3}")
    print(table(s))
    write_record(
        "elastic_soak", "elastic_soak", argv, tables={"slopes": table(s)}, figures={"summary": s, "rows": rows}
    )


if __name__ == "__main__":
    main()
