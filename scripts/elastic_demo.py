"""Demo: kill a slice of a running job from outside and watch it recover in the same process.

    python scripts/elastic_demo.py [--mode pause-resume|replica-resize] [--down-s 3]

Trains the qwen3-tiny preset on 3 virtual CPU slices with elastic_enabled=true, kills slice 1 with
`python -m trainer.chaos kill-slice` once step --kill-at-step is done, and prints the recovery
timeline (kill, detection, slices ready, restore, first step), the steps lost and the PIDs seen.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.observe.events import read_events  # noqa: E402
from trainer.observe.timeline import format_timeline, recovery_timelines  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("pause-resume", "replica-resize"), default="pause-resume")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at-step", type=int, default=20)
    p.add_argument("--down-s", type=float, default=3.0, help="how long the killed slice stays down")
    p.add_argument("--run-root", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="extra key=value for the trainer")
    args = p.parse_args()
    root = args.run_root or Path(tempfile.mkdtemp(prefix="elastic_demo_"))
    run_dir = root / "demo"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    cmd = [sys.executable, "-m", "trainer.train", "base.yml", "model=qwen3-tiny", "max_target_length=128",
           f"steps={args.steps}", "num_slices=3", "elastic_enabled=true", "snapshot_period=5",
           "checkpoint_period=20", "log_period=5", "elastic_poll_interval_seconds=0.2",
           f"elastic_min_slice_count={-1 if args.mode == 'pause-resume' else 2}",
           f"base_output_directory={root}", "run_name=demo", *args.overrides]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(f"trainer pid {proc.pid}")
    killed = False
    for line in proc.stdout:
        sys.stdout.write("  | " + line)
        if not killed and f"step={args.kill_at_step} " in line and "loss=" in line:
            subprocess.run([sys.executable, "-m", "trainer.chaos", "kill-slice", "--run-dir", str(run_dir),
                            "--slice", "1", "--down-s", str(args.down_s)], check=True)
            killed = True
    rc = proc.wait()
    events = read_events(run_dir / "events.jsonl")
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"\ntrainer exit code {rc}; PIDs that wrote metrics: {sorted({m['pid'] for m in metrics})} "
          f"(launched {proc.pid})")
    for i, t in enumerate(recovery_timelines(events), 1):
        print(f"recovery {i} ({args.mode}):")
        print(format_timeline(t))
    summary = [e for e in events if e["event"] == "elastic_summary"]
    goodput = [e for e in events if e["event"] == "goodput"]
    if summary:
        s = summary[-1]
        print(f"failures {s['failures']}, steps lost {s['steps_lost']}, downtime {s['downtime_s']} s")
    if goodput:
        g = goodput[-1]
        print(f"goodput {g['goodput']:.1%} of {g['wall_s']} s wall; badput {g['badput_s']}")
    print(f"run directory: {run_dir}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
