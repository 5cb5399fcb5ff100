"""Demo: kill a slice of a running job from outside and watch it recover in the same process.

    python scripts/elastic_demo.py [--mode pause-resume|replica-resize] [--down-s 3]

Trains the qwen3-tiny preset on 3 virtual CPU slices with elastic_enabled=true, kills slice 1 with
`python -m trainer.chaos kill-slice` once step --kill-at-step is done, and prints the recovery
timeline (kill, detection, slices ready, restore, first step), the steps lost and the PIDs seen.
TRAINER_SMOKE=1 (as for the benchmarks, benchmarks/cli_runs.py) runs it all at minimal sizes.
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
from trainer.observe import catalogue  # noqa: E402
from trainer.observe.events import read_events  # noqa: E402
from trainer.observe.records import step_rows  # noqa: E402
from trainer.observe.timeline import format_timeline, recovery_timelines  # noqa: E402

# TRAINER_SMOKE=1: the same demo at minimal sizes (benchmarks/cli_runs.py reads it for the benchmarks).
SMOKE = os.environ.get("TRAINER_SMOKE", "") not in ("", "0")
SMOKE_ARGS = [
    "base_num_decoder_layers=2",
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=16",
    "base_mlp_dim=128",
    "vocab_size=512",
    "max_target_length=32",
    "snapshot_period=2",
    "checkpoint_period=5",
    "log_period=1",
]  # logging every step prints the kill step's line
SMOKE_XLA_FLAGS = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def with_smoke_args(cmd: list[str]) -> list[str]:
    """`cmd` with SMOKE_ARGS' values in place of its own for the same keys, and the rest after model=."""
    smoke = dict(arg.split("=", 1) for arg in SMOKE_ARGS)
    out = []
    for arg in cmd:
        key = arg.split("=", 1)[0]
        out.append(f"{key}={smoke.pop(key)}" if key in smoke else arg)
    at = out.index("model=qwen3-tiny") + 1
    return out[:at] + [f"{k}={v}" for k, v in smoke.items()] + out[at:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("pause-resume", "replica-resize"), default="pause-resume")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at-step", type=int, default=20)
    p.add_argument("--down-s", type=float, default=3.0, help="how long the killed slice stays down")
    p.add_argument("--run-root", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="extra key=value for the trainer")
    args = p.parse_args()
    if SMOKE:  # whatever the arguments say
        args.steps, args.kill_at_step = min(args.steps, 20), min(args.kill_at_step, 4)
        args.down_s = min(args.down_s, 1.0)
        print(
            f"smoke mode (TRAINER_SMOKE=1): {args.steps} steps, kill after step {args.kill_at_step}, down "
            f"{args.down_s:g} s, a 2-layer 64-wide model, vocabulary 512, rows of 32 tokens, compiled without "
            "XLA optimisation; figures are not measurements",
            flush=True,
        )
    root = args.run_root or Path(tempfile.mkdtemp(prefix="elastic_demo_"))
    run_dir = root / "demo"
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3" + (SMOKE_XLA_FLAGS if SMOKE else "")
    )
    cmd = [
        sys.executable,
        "-m",
        "trainer.train",
        "base.yml",
        "model=qwen3-tiny",
        "max_target_length=128",
        f"steps={args.steps}",
        "num_slices=3",
        "elastic_enabled=true",
        "snapshot_period=5",
        "checkpoint_period=20",
        "log_period=5",
        "elastic_poll_interval_seconds=0.2",
        f"elastic_min_slice_count={-1 if args.mode == 'pause-resume' else 2}",
        f"base_output_directory={root}",
        "run_name=demo",
        *args.overrides,
    ]
    if SMOKE:
        cmd = with_smoke_args(cmd)
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(f"trainer pid {proc.pid}")
    killed = False
    for line in proc.stdout:
        sys.stdout.write("  | " + line)
        if not killed and f"step={args.kill_at_step} " in line and "loss=" in line:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "trainer.chaos",
                    "kill-slice",
                    "--run-dir",
                    str(run_dir),
                    "--slice",
                    "1",
                    "--down-s",
                    str(args.down_s),
                ],
                check=True,
            )
            killed = True
    rc = proc.wait()
    events = read_events(run_dir / "events.jsonl")
    metrics = step_rows(json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines())
    print(
        f"\ntrainer exit code {rc}; PIDs that wrote metrics: {sorted({m['pid'] for m in metrics})} "
        f"(launched {proc.pid})"
    )
    for i, t in enumerate(recovery_timelines(events), 1):
        print(f"recovery {i} ({args.mode}):")
        print(format_timeline(t))
    summary = [e for e in events if e["event"] == catalogue.ELASTIC_SUMMARY]
    goodput = [e for e in events if e["event"] == catalogue.GOODPUT]
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
