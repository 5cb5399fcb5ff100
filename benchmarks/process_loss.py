"""Steps lost when the training process dies (kill -9), with and without the local checkpoint tier.

    python benchmarks/process_loss.py [--model qwen3-tiny] [--kills 4] [--checkpoint-period 100]
                                      [--local-period 10] [--seed 0] [key=value ...]

For each setting (persistent tier only; persistent + local tier) one run is killed with SIGKILL at
`--kills` seeded random steps and restarted each time with the same command, then finishes. Each restart's
`restart_resumed` event says where it resumed from and how many steps it trains again (the run's last
recorded step minus the restored one); its `restore_end` event how long reading that state took. Prints,
per setting: steps lost per kill (each, mean, max), the restore time per source tier, and the restart time
(process start to the first step recorded after the restore), then the table of them (one column per
setting) it writes to the record benchmarks/records/process_loss.json, from which the README's table is
rendered. TRAINER_SMOKE=1 runs it all at minimal sizes and records nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import (  # noqa: E402
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    env_with_devices,
    mean,
    median,
    read_jsonl,
    run,
    smoke_cap,
    smoke_overrides,
    trainer_cmd,
)
from records import write_record  # noqa: E402

from trainer.observe import catalogue  # noqa: E402


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((r.get("step", 0) for r in read_jsonl(path) if "loss" in r), default=0) if path.exists() else 0


def kill_at(root: Path, name: str, overrides: list[str], step: int) -> None:
    """Start the run (or its resume) and SIGKILL it once its metrics show `step`."""
    proc = subprocess.Popen(
        trainer_cmd(root, name, overrides),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env_with_devices(1),
    )
    deadline = time.time() + 900  # a hang guard
    while proc.poll() is None and _last_step(root / name) < step and time.time() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        sys.exit(f"run {name} ended (rc={proc.returncode}) before step {step}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def measure(root: Path, name: str, overrides: list[str], kill_steps: list[int]) -> dict:
    for step in kill_steps:
        kill_at(root, name, overrides, step)
    run(root, name, overrides)
    events = read_jsonl(root / name / "events.jsonl")
    records = [r for r in read_jsonl(root / name / "metrics.jsonl") if "loss" in r]
    resumed = [e for e in events if e["event"] == catalogue.RESTART_RESUMED]
    restores: dict[str, list[float]] = {}
    restarts = []
    for r in resumed:
        start = max(e["time"] for e in events if e["event"] == catalogue.START and e["time"] <= r["time"])
        end = next(e for e in events if e["event"] == catalogue.RESTORE_END and e["time"] >= start)
        restores.setdefault(end["source"].split(":")[0], []).append(end["seconds"])
        first = next((m["time"] for m in records if m["time"] >= r["time"]), None)
        if first is not None:
            restarts.append(first - start)
    lost = [r["steps_lost"] for r in resumed]
    return {
        "kills_at_steps": kill_steps,
        "resumed_from": [r["source"] for r in resumed],
        "steps_lost_per_kill": lost,
        "mean_steps_lost": round(mean(lost), 2) if lost else None,
        "max_steps_lost": max(lost) if lost else None,
        "median_restore_s_by_source": {k: round(median(v), 3) for k, v in sorted(restores.items())},
        "median_start_to_first_step_s": round(median(restarts), 2) if restarts else None,
    }


def _last_value(overrides: list[str], key: str) -> str:
    """The value the trainer takes for `key`: its last `key=value` among `overrides`."""
    return next(a.split("=", 1)[1] for a in reversed(overrides) if a.startswith(f"{key}="))


SETTINGS = {"persistent_only": "persistent tier only", "with_local_tier": "persistent + local tier"}


def _restores(m: dict) -> str:
    """Median restore time per source tier, e.g. `0.20 s (local)`."""
    found = m["median_restore_s_by_source"]
    return ", ".join(f"{s:.2f} s ({source})" for source, s in found.items()) or "none"


def _lost(m: dict) -> str:
    lost = m["steps_lost_per_kill"]
    return (
        f"{', '.join(map(str, lost))} (mean {m['mean_steps_lost']}, max {m['max_steps_lost']})" if lost else "none"
    )


def _start(m: dict) -> str:
    s = m["median_start_to_first_step_s"]
    return "n/a" if s is None else f"{s:.1f} s"


def table(out: dict) -> str:
    """Markdown: one column per setting."""
    cols = [out[key] for key in SETTINGS]
    kills = ", ".join(map(str, cols[0]["kills_at_steps"]))

    def row(name, cell):
        return f"| {name} | " + " | ".join(cell(m) for m in cols) + " |"

    return "\n".join(
        [
            f"| {out['model']}, sequence {out['max_target_length']}, {out['steps']} steps, persistent period "
            f"{out['checkpoint_period']}, local period {out['local_period']} | "
            + " | ".join(SETTINGS.values())
            + " |",
            "|---|" + "---|" * len(cols),
            row("restore (read + place on devices), median per source", _restores),
            row(f"steps lost per kill -9 at steps {kills}", _lost),
            row("restarted process: start → first step, median", _start),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--checkpoint-period", type=int, default=100)
    p.add_argument("--local-period", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("extra", nargs="*", help="more key=value for the trainer")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    ckpt_period = smoke_cap(args.checkpoint_period, 6)
    local_period = smoke_cap(args.local_period, 2)
    kills = smoke_cap(args.kills, 1)
    steps = 3 * ckpt_period
    rng = random.Random(args.seed)
    # Kill steps spread over the run, the same for both settings; each after the previous restart's resume.
    kill_steps = sorted(rng.sample(range(local_period + 1, steps - 1), kills))
    common = smoke_overrides(
        [
            f"model={args.model}",
            "max_target_length=256",
            f"steps={steps}",
            f"checkpoint_period={ckpt_period}",
        ]
        + ["log_period=1000", "checkpoint_compression=false", *args.extra],
        **SMOKE_SHAPE,
    )
    length = int(_last_value(common, "max_target_length"))  # smoke's cap, or what `extra` gave
    shortened = f"checkpoint period {ckpt_period}, local period {local_period}, {steps} steps"
    announce_smoke(f"{shortened}, {SMOKE_SHAPE_TEXT}")
    out = {
        "model": args.model,
        "max_target_length": length,
        "steps": steps,
        "checkpoint_period": ckpt_period,
        "local_period": local_period,
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out["persistent_only"] = measure(root, "persistent", common, kill_steps)
        tier = [f"local_checkpoint_directory={root / 'node_local'}", f"local_checkpoint_period={local_period}"]
        out["with_local_tier"] = measure(root, "local", [*common, *tier], kill_steps)
    print(json.dumps(out, indent=2))
    print(table(out))
    write_record("process_loss", "process_loss", argv, tables={"loss": table(out)}, figures=out)


if __name__ == "__main__":
    main()
