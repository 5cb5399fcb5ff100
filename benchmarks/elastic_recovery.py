"""Elastic recovery cost on 3 virtual CPU slices, next to a full process restart.

    python benchmarks/elastic_recovery.py [--model qwen3-tiny] [--max-target-length 128]

Measures, from the events each run writes (medians over several failures, since one recovery on a
shared 2-core machine is a noisy sample):
- pause-and-resume with an immediate replacement (down_s=0), three failures in one run: kill -> first
  completed step after recovery, against (restore + one steady step) of the same recovery;
- replica-resize onto the 2 surviving slices, first time (compiles the 2-slice mesh) and a second
  time after scale-up (executable cached), in steady step times;
- a full restart: the process killed with SIGKILL and started again from the same checkpoint, twice
  in a chain, kill -> first completed step of the new process;
- snapshot overhead at snapshot_period=10: the extra step time each snapshot causes inside the run
  (cli_runs.excess_step_time; snapshots at a checkpoint step are left out, the save would count) over
  10 steps, and the cruder ratio of mean step times to a run without (both runs save checkpoints).

The emulated slice dies at a step boundary (trainer.elastic.faults): the step in flight finishes, the
next one fails. On real hardware the step in flight is lost too and detection adds its own latency
(Pathways: seconds); both are outside what this measures, which is the cost of the recovery itself.

TRAINER_SMOKE=1 runs it all at minimal sizes (see cli_runs): 12 steps, the failures early, one kill.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_runs import (
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    env_with_devices,  # noqa: E402
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
    trainer_cmd,
)
from records import write_record  # noqa: E402

from trainer.observe import catalogue  # noqa: E402
from trainer.observe.timeline import recovery_timelines  # noqa: E402


def steady_step_time(run_dir: Path) -> float:
    return median(step_times(run_dir, skip=3))


def full_restarts(root: Path, common: list[str], kill_at: list[int]) -> list[float]:
    """SIGKILL the job once it has logged each of `kill_at` step records, restarting it every time with
    the same command (it resumes from its newest checkpoint): kill -> first step of the new process."""
    cmd = trainer_cmd(root, "restart", [*common, "elastic_enabled=false"])
    env = env_with_devices(3)
    run_dir = root / "restart"
    metrics = run_dir / "metrics.jsonl"
    out = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for target in kill_at:
        while proc.poll() is None and not (metrics.exists() and len(step_records(run_dir)) >= target):
            time.sleep(0.01)
        killed_at = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        before = len(step_records(run_dir))
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while len(step_records(run_dir)) <= before:
            if proc.poll() is not None:
                sys.exit("the restarted trainer exited before its first step")
            time.sleep(0.01)
        out.append(step_records(run_dir)[before]["time"] - killed_at)
    proc.kill()
    proc.wait()
    return out


def _s(xs) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def table(out: dict) -> str:
    """The README's table of one run's figures, with their targets."""
    pr, rr = out["pause_resume"], out["replica_resize"]
    restore = pr["restore_s"]
    sources = sorted({str(x).split(":")[0] for x in pr["restore_source"]})
    lines = [
        f"| {out['model']}, sequence {out['max_target_length']}, 3 virtual slices, steady step "
        f"{out['steady_step_time_s']:.2f} s | measured | target |",
        "|---|---|---|",
        "| pause-and-resume, immediate replacement: kill → next completed step | "
        f"{_s(pr['kill_to_next_step_s'])} s; "
        f"median **{pr['median_ratio']:.2f}×** (restore {min(restore):.2f}-{max(restore):.2f} s from "
        f"{'/'.join(sources)} + one step) | ≤ 1.5× |",
        f"| full process restart from the same checkpoint (warm compile cache): kill → first step | "
        f"{_s(out['full_restart_kill_to_next_step_s'])} s: in-process recovery is "
        f"**{out['pause_resume_speedup_vs_full_restart']}×** faster | ≥ 5× |",
    ]
    if len(rr) >= 2:
        first, cached = rr[0], rr[1]
        lines += [
            f"| replica-resize onto {len(first['slices_after'] or [])} slices, first time (compiled ahead, in the "
            f"background) | {first['kill_to_next_step_s']:.2f} s = {first['in_step_times']:.2f} step times: "
            f"**{out['resize_first_over_cached']:.2f}×** the cached one | ≤ 1.5× the cached one |",
            f"| replica-resize, executable cached in the process | {cached['kill_to_next_step_s']:.2f} s = "
            f"**{cached['in_step_times']:.2f}** step times | ≤ 3 |",
        ]
    inside, ab = out["snapshot_overhead_at_period_10"], out["snapshot_overhead_ab_mean_step_time"]
    lines.append(
        "| snapshot overhead at snapshot_period=10 (inside the run; mean step time against a run without) | "
        f"**{'n/a' if inside is None else f'{inside:.1%}'}**; {ab:+.1%} | ≤ 5% |"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--max-target-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    # Smoke mode: the same runs and failures, placed early in 12 steps, and one restart instead of two.
    args.steps = smoke_cap(args.steps, 12)
    args.max_target_length = smoke_cap(args.max_target_length, SMOKE_SHAPE["max_target_length"])
    ckpt_period, snap_period = smoke_cap(20, 4), smoke_cap(10, 2)
    pr_steps = (3, 6, 9) if smoke() else (15, 35, 55)
    rr_faults = (
        "step=3,slice=2,down_s=1; step=8,slice=2,down_s=60"
        if smoke()
        else "step=15,slice=2,down_s=3; step=40,slice=2,down_s=60"
    )
    kill_at = [5] if smoke() else [25, 45]
    announce_smoke(
        f"{args.steps} steps, failures at steps {', '.join(map(str, pr_steps))}, resizes at 3 and 8, "
        f"one full restart, checkpoint period {ckpt_period}, snapshot period {snap_period}, "
        f"{SMOKE_SHAPE_TEXT}"
    )
    common = smoke_overrides(
        [
            f"model={args.model}",
            f"max_target_length={args.max_target_length}",
            f"steps={args.steps}",
            "num_slices=3",
            "elastic_enabled=true",
            f"checkpoint_period={ckpt_period}",
            "log_period=1000",
            "elastic_poll_interval_seconds=0.05",
        ],
        **SMOKE_SHAPE,
    )
    out: dict = {"model": args.model, "max_target_length": args.max_target_length}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain = run(root, "plain", common, devices=3)
        step = steady_step_time(plain)
        out["steady_step_time_s"] = round(step, 4)

        faults = "; ".join(f"step={s},slice={1 + i % 2},down_s=0" for i, s in enumerate(pr_steps))
        pr = run(root, "pr", [*common, f"snapshot_period={snap_period}", f"fault_schedule={faults}"], devices=3)
        ts = recovery_timelines(read_jsonl(pr / "events.jsonl"))
        kill_to_step = [t["relative_s"]["first_step"] for t in ts]
        ratios = [t["relative_s"]["first_step"] / (t["restore_s"] + step) for t in ts]
        out["pause_resume"] = {
            "kill_to_next_step_s": kill_to_step,
            "restore_s": [t["restore_s"] for t in ts],
            "restore_source": [t["restore_source"] for t in ts],
            "ratio_to_restore_plus_one_step": [round(r, 2) for r in ratios],
            "median_ratio": round(median(ratios), 2),
            "steps_rewound": [t["steps_rewound"] for t in ts],
        }

        rr = run(
            root,
            "rr",
            [
                *common,
                "elastic_min_slice_count=2",
                f"snapshot_period={snap_period}",
                f"fault_schedule={rr_faults}",
            ],
            devices=3,
        )
        ts = recovery_timelines(read_jsonl(rr / "events.jsonl"))
        out["replica_resize"] = [
            {
                "kill_to_next_step_s": x["relative_s"]["first_step"],
                "in_step_times": round(x["relative_s"]["first_step"] / step, 2),
                "slices_after": x.get("slices_after"),
            }
            for x in ts
        ]
        if len(ts) >= 2:
            out["resize_first_over_cached"] = round(
                ts[0]["relative_s"]["first_step"] / ts[1]["relative_s"]["first_step"], 2
            )

        restarts = full_restarts(root, [c for c in common if c != "elastic_enabled=true"], kill_at=kill_at)
        out["full_restart_kill_to_next_step_s"] = [round(r, 3) for r in restarts]
        out["pause_resume_speedup_vs_full_restart"] = round(median(restarts) / median(kill_to_step), 1)

        snap = run(root, "snap", [*common, f"snapshot_period={snap_period}"], devices=3)
        excess, base = excess_step_time(
            snap, catalogue.SNAPSHOT_TAKEN, catalogue.SNAPSHOT_TAKEN, not_with=catalogue.CHECKPOINT_SAVE_START
        )
        out["snapshot_extra_step_time_s"] = [round(x, 3) for x in excess]
        per_snapshot = smoke_median(excess)
        out["snapshot_overhead_at_period_10"] = (
            None if per_snapshot is None else round(per_snapshot / (snap_period * base), 4)
        )
        out["snapshot_overhead_ab_mean_step_time"] = round(mean(step_times(snap)) / mean(step_times(plain)) - 1, 4)
    print(json.dumps(out, indent=2))
    print(table(out))
    write_record("elastic_recovery", "elastic_recovery", argv, tables={"recovery": table(out)}, figures=out)


if __name__ == "__main__":
    main()
