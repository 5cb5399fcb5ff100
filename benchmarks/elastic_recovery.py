"""Elastic recovery cost on 3 virtual CPU slices, next to a full process restart.

    python benchmarks/elastic_recovery.py [--model qwen3-tiny] [--max-target-length 128] [--hugepages on|off]

Measures, from the events each run writes (medians over several failures, since one recovery on a
shared machine is a noisy sample):
- pause-and-resume with an immediate replacement (down_s=0), three failures in one run: kill -> first
  completed step after recovery, against (restore + one steady step) of the same recovery;
- replica-resize onto the 2 surviving slices, first time and a second time after scale-up (executable
  cached in the process), in steady step times. The run starts with an empty compilation cache of its
  own (a new job's first resize: nothing on disk to load), compiles the 3 survivor sets ahead in the
  background, and loses its first slice once they are compiled: the record says when the last of them
  was ready (seconds into training) and whether a compile was still running at the failure (on
  CPU devices a compile shares the cores with the step, so a resize in that window is slower);
- a full restart: the process killed with SIGKILL and started again from the same checkpoint, twice
  in a chain, kill -> first completed step of the new process;
- snapshot overhead at snapshot_period=10: the extra step time each snapshot causes inside the run
  (cli_runs.excess_step_time; snapshots at a checkpoint step are left out, the save would count) over
  10 steps, and the cruder ratio of mean step times to a run without (both runs save checkpoints);
- where the time of each pause-and-resume recovery and each full restart went, phase by phase, from the
  events between the kill and the first step after it (table `phases`).

Every trainer process runs with its host malloc on huge pages (`--hugepages on`, the default) or without
(`off`: TRAINER_HUGEPAGE_MALLOC=0, see trainer/hostmem.py); a run whose start event says otherwise is
refused. It writes the record benchmarks/records/elastic_recovery.json, or elastic_recovery-nohugepages.json
with `--hugepages off` (benchmarks/records.py): tables `recovery` and `phases`.

The emulated slice dies at a step boundary (trainer.elastic.faults): the step in flight finishes, the
next one fails. On real hardware the step in flight is lost too and detection adds its own latency
(Pathways: seconds); both are outside what this measures, which is the cost of the recovery itself.

TRAINER_SMOKE=1 runs it all at minimal sizes (see cli_runs): 12 steps, the failures early, one kill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_runs import (
    HUGEPAGES,
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    check_hugepages,
    env_with_devices,  # noqa: E402
    excess_step_time,
    hugepage_env,
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


# The phases of one recovery, in order: (key, row label). Each is the time between two events, so they add
# up to the total; a phase that one kind of recovery does not have is left out of its column.
PHASES = (
    ("detect", "detection: kill → the error reaches the train function"),
    ("teardown", "tearing the failed attempt down"),
    ("wait", "waiting for healthy slices"),
    ("process_start", "a new process: interpreter, imports, configuration (kill → its `start` event)"),
    (
        "plan",
        "mesh, data iterators and the compiled step (pause-and-resume: cached in the process; restart: "
        "loaded from the compile cache)",
    ),
    ("open_checkpointer", "opening the checkpoint manager"),
    ("restore", "restoring the train state"),
    ("first_step", "the first step"),
    ("total", "**kill → first completed step**"),
)


def _first(events: list[dict], *names: str) -> dict | None:
    return next((e for e in events if e["event"] in names), None)


def recovery_phases(events: list[dict]) -> list[dict]:
    """Per in-process recovery (a slice_killed, then its slice_down_detected): seconds of each phase from
    the kill to the first step after it, and the restore's source. Recoveries missing an event are left out."""
    out, killed = [], None
    for i, e in enumerate(events):
        if e["event"] == catalogue.SLICE_KILLED:
            killed = e["time"]
        if e["event"] != catalogue.SLICE_DOWN_DETECTED:
            continue
        later = events[i + 1 :]
        window = later[: next((j for j, x in enumerate(later) if x["event"] == e["event"]), len(later))]
        waited = _first(window, catalogue.WAIT_END)
        plan = _first(window, catalogue.COMPILE_CACHED, catalogue.COMPILE_DONE)
        begun, restored = _first(window, catalogue.RESTORE_START), _first(window, catalogue.RESTORE_END)
        stepped = _first(window, catalogue.FIRST_STEP_AFTER_RECOVERY)
        if killed is None or None in (waited, plan, begun, restored, stepped):
            killed = None
            continue
        torn_down = e["time"] + e["teardown_s"]
        seconds = {
            "detect": e["time"] - killed,
            "teardown": e["teardown_s"],
            "wait": waited["time"] - torn_down,
            "plan": plan["time"] - waited["time"],
            "open_checkpointer": begun["time"] - plan["time"],
            "restore": restored["time"] - begun["time"],
            "first_step": stepped["time"] - restored["time"],
            "total": stepped["time"] - killed,
        }
        out.append({"seconds": {k: round(v, 4) for k, v in seconds.items()}, "source": restored["source"]})
        killed = None
    return out


def restart_phases(events: list[dict], killed_at: float, first_step_at: float) -> dict | None:
    """The phases of one full restart: the new process's events after the kill at `killed_at`, up to its
    first step completed at `first_step_at`. None when an event is missing."""
    after = [e for e in events if e["time"] > killed_at]
    start = _first(after, catalogue.START)
    later = after[after.index(start) + 1 :] if start is not None else []
    plan = _first(later, catalogue.COMPILE_CACHED, catalogue.COMPILE_DONE)
    begun, restored = _first(later, catalogue.RESTORE_START), _first(later, catalogue.RESTORE_END)
    if None in (start, plan, begun, restored):
        return None
    seconds = {
        "process_start": start["time"] - killed_at,
        "plan": plan["time"] - start["time"],
        "open_checkpointer": begun["time"] - plan["time"],
        "restore": restored["time"] - begun["time"],
        "first_step": first_step_at - restored["time"],
        "total": first_step_at - killed_at,
    }
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()}, "source": restored["source"]}


def full_restarts(root: Path, common: list[str], kill_at: list[int]) -> tuple[list[float], list[dict]]:
    """SIGKILL the job once it has logged each of `kill_at` step records, restarting it every time with
    the same command (it resumes from its newest checkpoint): (kill -> first step of the new process, the
    phases of each restart)."""
    cmd = trainer_cmd(root, "restart", [*common, "elastic_enabled=false"])
    env = env_with_devices(3)
    run_dir = root / "restart"
    metrics = run_dir / "metrics.jsonl"
    out, phases = [], []
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
        first_step_at = step_records(run_dir)[before]["time"]
        out.append(first_step_at - killed_at)
        # The new process may still be writing its events: they are all written before its first step's.
        found = restart_phases(read_jsonl(run_dir / "events.jsonl"), killed_at, first_step_at)
        if found is not None:
            phases.append(found)
    proc.kill()
    proc.wait()
    return out, phases


def _s(xs) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def _durations(xs: list[float]) -> str:
    """Several durations in one unit: s from a second up, else ms."""
    top = max(xs)
    if top >= 1:
        return f"{_s(xs)} s"
    return ", ".join(f"{1e3 * x:.0f}" if top >= 0.1 else f"{1e3 * x:.1f}" for x in xs) + " ms"


def _sources(found: list[dict]) -> str:
    return "/".join(sorted({str(f["source"]).split(":")[0] for f in found}))


def phases_table(out: dict) -> str:
    """Markdown: a row per phase of a recovery, a column per kind, each event's value in a cell."""
    pr, restarts = out["phases"]["pause_resume"], out["phases"]["full_restart"]
    kinds = [
        (f"pause-and-resume, immediate replacement: {len(pr)} failure{'s' * (len(pr) != 1)}", pr),
        (f"full process restart, warm compile cache: {len(restarts)} kill{'s' * (len(restarts) != 1)}", restarts),
    ]
    head = [f"{_setup(out)}: one recovery by phase (each recovery's value)"] + [name for name, _ in kinds]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * len(kinds)]
    for key, label in PHASES:
        cells = []
        for _, found in kinds:
            xs = [f["seconds"][key] for f in found if key in f["seconds"]]
            cell = _durations(xs) if xs else "—"
            if xs and key == "restore":
                cell += f" (from {_sources(found)})"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _setup(out: dict) -> str:
    return f"{out['model']}, sequence {out['max_target_length']}, 3 virtual slices, huge pages {out['hugepages']}"


def table(out: dict) -> str:
    """The README's table of one run's figures, with their targets."""
    pr, rr = out["pause_resume"], out["replica_resize"]
    restore = pr["restore_s"]
    sources = sorted({str(x).split(":")[0] for x in pr["restore_source"]})
    lines = [
        f"| {_setup(out)}, steady step {out['steady_step_time_s']:.2f} s | measured | target |",
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
            f"**{out['resize_first_over_cached']:.2f}×** the cached one{_ahead(out)} | ≤ 1.5× the cached one |",
            f"| replica-resize, executable cached in the process | {cached['kill_to_next_step_s']:.2f} s = "
            f"**{cached['in_step_times']:.2f}** step times | ≤ 3 |",
        ]
    inside, ab = out["snapshot_overhead_at_period_10"], out["snapshot_overhead_ab_mean_step_time"]
    copy = out["snapshot_copy"]
    copied = (
        f" (each copies {copy['replicas']} × {copy['bytes'] / 1e6:.0f} MB to host memory in "
        f"{min(copy['seconds']):.2f}-{max(copy['seconds']):.2f} s)"
        if copy["seconds"]
        else ""
    )
    lines.append(
        "| snapshot overhead at snapshot_period=10 (inside the run; mean step time against a run without) | "
        f"**{'n/a' if inside is None else f'{inside:.1%}'}**; {ab:+.1%}{copied} | ≤ 5% |"
    )
    return "\n".join(lines)


def compile_ahead_window(events: list[dict]) -> dict:
    """When the survivor sets compiled ahead were ready: seconds from the start of training (the first
    attempt's start, after which they compile) to the last `compile_ahead`, and whether one was still
    compiling at the first failure (its event came after)."""
    started = next((e["time"] for e in events if e["event"] == catalogue.ATTEMPT_START), None)
    ahead = [e["time"] for e in events if e["event"] == catalogue.COMPILE_AHEAD]
    killed = next((e["time"] for e in events if e["event"] == catalogue.SLICE_KILLED), None)
    if started is None or not ahead:
        return {"ready_after_start_s": None, "compiling_at_first_failure": None}
    return {
        "ready_after_start_s": round(max(ahead) - started, 1),
        "compiling_at_first_failure": killed is not None and max(ahead) > killed,
    }


def _ahead(out: dict) -> str:
    ahead = out.get("compile_ahead_s") or []
    if not ahead:
        return ""
    window = out.get("compile_ahead_window") or {}
    ready = window.get("ready_after_start_s")
    when = "" if ready is None else f", all ready {ready:.0f} s into training"
    if window.get("compiling_at_first_failure"):
        when += "; the failure came while one still compiled"
    return f" (compiled ahead from an empty cache in {min(ahead):.1f}-{max(ahead):.1f} s per slice set{when})"


def record_id(hugepages: str) -> str:
    """elastic_recovery, or elastic_recovery-nohugepages for the run without huge pages."""
    return "elastic_recovery" if hugepages == "on" else "elastic_recovery-nohugepages"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--max-target-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--hugepages", choices=HUGEPAGES, default="on", help="every trainer's host malloc on huge pages or not"
    )
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    hugepage_env(os.environ, args.hugepages)  # every trainer process inherits it
    # Smoke mode: the same runs and failures, placed early in 12 steps, and one restart instead of two.
    args.steps = smoke_cap(args.steps, 12)
    args.max_target_length = smoke_cap(args.max_target_length, SMOKE_SHAPE["max_target_length"])
    ckpt_period, snap_period = smoke_cap(20, 4), smoke_cap(10, 2)
    pr_steps = (3, 6, 9) if smoke() else (15, 35, 55)
    # Replica-resize: the first failure comes after the survivor sets have compiled ahead from an empty
    # cache (on CPU devices those compiles share the cores with the steps), so the run is longer.
    rr_steps = args.steps if smoke() else args.steps + 40
    rr_faults = (
        "step=3,slice=2,down_s=1; step=8,slice=2,down_s=60"
        if smoke()
        else "step=60,slice=2,down_s=3; step=85,slice=2,down_s=60"
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
    out: dict = {"model": args.model, "max_target_length": args.max_target_length, "hugepages": args.hugepages}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain = run(root, "plain", common, devices=3)
        check_hugepages(plain, args.hugepages)  # before the rest: a machine that cannot set it stops here
        step = steady_step_time(plain)
        out["steady_step_time_s"] = round(step, 4)

        faults = "; ".join(f"step={s},slice={1 + i % 2},down_s=0" for i, s in enumerate(pr_steps))
        pr = run(root, "pr", [*common, f"snapshot_period={snap_period}", f"fault_schedule={faults}"], devices=3)
        ts = recovery_timelines(read_jsonl(pr / "events.jsonl"))
        out["phases"] = {"pause_resume": recovery_phases(read_jsonl(pr / "events.jsonl"))}
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
                *[c for c in common if not c.startswith("steps=")],
                f"steps={rr_steps}",
                "elastic_min_slice_count=2",
                f"snapshot_period={snap_period}",
                f"fault_schedule={rr_faults}",
                f"jax_cache_dir={root / 'rr_jax_cache'}",
            ],
            devices=3,
        )
        rr_events = read_jsonl(rr / "events.jsonl")
        ts = recovery_timelines(rr_events)
        out["compile_ahead_s"] = [e["seconds"] for e in rr_events if e["event"] == catalogue.COMPILE_AHEAD]
        out["compile_ahead_window"] = compile_ahead_window(rr_events)
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

        restarts, out["phases"]["full_restart"] = full_restarts(
            root, [c for c in common if c != "elastic_enabled=true"], kill_at=kill_at
        )
        out["full_restart_kill_to_next_step_s"] = [round(r, 3) for r in restarts]
        out["pause_resume_speedup_vs_full_restart"] = round(median(restarts) / median(kill_to_step), 1)

        snap = run(root, "snap", [*common, f"snapshot_period={snap_period}"], devices=3)
        excess, base = excess_step_time(
            snap, catalogue.SNAPSHOT_TAKEN, catalogue.SNAPSHOT_TAKEN, not_with=catalogue.CHECKPOINT_SAVE_START
        )
        out["snapshot_extra_step_time_s"] = [round(x, 3) for x in excess]
        snap_events = read_jsonl(snap / "events.jsonl")
        checkpointed = {e["step"] for e in snap_events if e["event"] == catalogue.CHECKPOINT_SAVE_START}
        # The copies of the snapshots the overhead is measured at: not those at a checkpoint step.
        taken = [
            e for e in snap_events if e["event"] == catalogue.SNAPSHOT_TAKEN and e["step"] not in checkpointed
        ]
        out["snapshot_copy"] = {
            "bytes": taken[0]["bytes"] if taken else 0,
            "replicas": taken[0].get("replicas", 1) if taken else 0,
            "seconds": [e["seconds"] for e in taken],
        }
        per_snapshot = smoke_median(excess)
        out["snapshot_overhead_at_period_10"] = (
            None if per_snapshot is None else round(per_snapshot / (snap_period * base), 4)
        )
        out["snapshot_overhead_ab_mean_step_time"] = round(mean(step_times(snap)) / mean(step_times(plain)) - 1, 4)
        for name in ("pr", "rr", "restart", "snap"):
            check_hugepages(root / name, args.hugepages)
    tables = {"recovery": table(out), "phases": phases_table(out)}
    print(json.dumps(out, indent=2))
    print(tables["recovery"])
    print()
    print(tables["phases"])
    write_record(record_id(args.hugepages), "elastic_recovery", argv, tables=tables, figures=out)


if __name__ == "__main__":
    main()
