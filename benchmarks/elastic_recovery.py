"""Elastic recovery cost on 3 virtual CPU slices, next to a full process restart.

    python benchmarks/elastic_recovery.py [--model qwen3-tiny] [--max-target-length 128]

Measures, from the events each run writes:
- pause-and-resume with an immediate replacement (down_s=0): kill -> first completed step after
  recovery, against (restore + one step) of the same recovery;
- replica-resize onto the 2 surviving slices, first time (compiles the 2-slice mesh) and a second
  time after scale-up (executable cached), in step times;
- a full restart: the process killed with SIGKILL and started again from the same checkpoint, kill ->
  first completed step of the new process;
- snapshot overhead: mean step time with snapshot_period=10 against none.
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
from cli_runs import env_with_devices, mean, median, read_jsonl, run, step_times, trainer_cmd  # noqa: E402
from trainer.observe.timeline import recovery_timelines  # noqa: E402


def steady_step_time(run_dir: Path) -> float:
    return median(step_times(run_dir, skip=3))


def full_restart(root: Path, common: list[str], kill_after: int) -> float:
    """SIGKILL the process after `kill_after` steps, rerun the same command: kill -> first new step."""
    cmd = trainer_cmd(root, "restart", [*common, "elastic_enabled=false"])
    env = env_with_devices(3)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = root / "restart" / "metrics.jsonl"
    while proc.poll() is None:
        if metrics.exists() and len(read_jsonl(metrics)) >= kill_after:
            break
        time.sleep(0.01)
    killed_at = time.time()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(read_jsonl(metrics))
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    first_new = read_jsonl(metrics)[before]
    return first_new["time"] - killed_at


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--max-target-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    common = [f"model={args.model}", f"max_target_length={args.max_target_length}", f"steps={args.steps}",
              "num_slices=3", "elastic_enabled=true", "checkpoint_period=20", "log_period=1000",
              "elastic_poll_interval_seconds=0.05"]
    out: dict = {"model": args.model, "max_target_length": args.max_target_length}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain = run(root, "plain", common, devices=3)
        step = steady_step_time(plain)
        out["steady_step_time_s"] = round(step, 4)

        pr = run(root, "pr", [*common, "snapshot_period=10", "fault_schedule=step=25,slice=1,down_s=0"], devices=3)
        t = recovery_timelines(read_jsonl(pr / "events.jsonl"))[0]
        kill_to_step = t["relative_s"]["first_step"]
        restore_plus_step = t["restore_s"] + step
        out["pause_resume"] = {"kill_to_next_step_s": kill_to_step, "restore_s": t["restore_s"],
                               "restore_source": t["restore_source"],
                               "ratio_to_restore_plus_one_step": round(kill_to_step / restore_plus_step, 2),
                               "steps_rewound": t["steps_rewound"]}

        rr = run(root, "rr", [*common, "elastic_min_slice_count=2", "snapshot_period=10",
                              "fault_schedule=step=15,slice=2,down_s=3; step=40,slice=2,down_s=60"], devices=3)
        ts = recovery_timelines(read_jsonl(rr / "events.jsonl"))
        out["replica_resize"] = [{"kill_to_next_step_s": x["relative_s"]["first_step"],
                                  "in_step_times": round(x["relative_s"]["first_step"] / step, 2),
                                  "slices_after": x.get("slices_after")} for x in ts]

        restart_s = full_restart(root, [c for c in common if c != "elastic_enabled=true"], kill_after=25)
        out["full_restart_kill_to_next_step_s"] = round(restart_s, 3)
        out["pause_resume_speedup_vs_full_restart"] = round(restart_s / kill_to_step, 1)

        snap = run(root, "snap", [*common, "snapshot_period=10"], devices=3)
        out["snapshot_overhead_at_period_10"] = round(mean(step_times(snap)) / mean(step_times(plain)) - 1, 4)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
