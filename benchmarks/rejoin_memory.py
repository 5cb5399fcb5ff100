"""Host memory and time of a rejoin when each slice's train state is sharded over several processes.

    python benchmarks/rejoin_memory.py [--slices 2] [--processes-per-slice 3] [--steps 40] [--kill-at 12]
                                       [--restart-delay 40] [key=value ...]

Runs a multi-process job under scripts/launch_local.py (one CPU device per process, `processes_per_slice`
processes per slice, so each process holds 1/processes_per_slice of its slice's state), replica-resize
(`elastic_min_slice_count=1`). Once process `processes_per_slice` (the first of slice 1) has finished step
--kill-at it gets SIGKILL; slice 0 goes on alone, the launcher starts a replacement after --restart-delay
(long enough that slice 0 trains alone first), and it rejoins: slice 0 snapshots, every process re-forms,
and slice 1's processes receive their shards of slice 0's snapshot (`snapshot_shared`).

A sampler reads every trainer process's resident memory (VmRSS) every 20 ms. Printed per process:
- steady: the peak over the steps before the kill (training, snapshots every 2 steps);
- rejoin: the peak from the kill until 3 steps after the whole job trains again;
- their ratio (the design bound is 1.5), and the replacement's rejoin peak next to the steady peak of its
  slice's survivor.
And the time from the kill to the next completed step, split by phase, for the survivors of slice 0
(detection, re-forming, restore, first step) and for the rejoin (replacement start, its membership,
restore by transfer, first step on all processes). TRAINER_SMOKE=1 runs it all at minimal sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import announce_smoke, smoke, smoke_env  # noqa: E402

from scripts.multiprocess_demo import Job, collect, kill_at_step, trainer_args  # noqa: E402
from trainer.observe import catalogue  # noqa: E402

# qwen3-tiny widened to an 86 MiB train state, 3x a process's shard with 3 processes per slice. A state
# several times a CPU process's base resident memory would not train on CPU devices in a benchmark's
# time, so the printed peaks include that base.
MODEL = [
    "base_num_decoder_layers=4",
    "base_emb_dim=256",
    "base_mlp_dim=1024",
    "vocab_size=16384",
    "max_target_length=64",
    "per_device_batch_size=1",
]


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """(time, process, pid, rss) of every trainer process the launcher started, every `period` s."""

    def __init__(self, job: Job, processes: int, period: float = 0.02):
        super().__init__(daemon=True)
        self.job, self.processes, self.period = job, processes, period
        self.samples: list[tuple[float, int, int, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = time.time()
            for p in range(self.processes):
                pid = self.job.pid_of(p)
                rss = rss_bytes(pid) if pid else None
                if rss:
                    self.samples.append((now, p, pid, rss))
            time.sleep(self.period)

    def peak(self, process: int, start: float, end: float, pid: int | None = None) -> int | None:
        xs = [r for t, p, q, r in self.samples if p == process and start <= t <= end and (pid is None or q == pid)]
        return max(xs) if xs else None


def first(events: list[dict], name: catalogue.Event, after: float, **match) -> dict | None:
    for e in events:
        if e["event"] == name and e["time"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def step_time(metrics: list[dict], step: int, after: float = 0.0) -> float | None:
    recs = [r["time"] for r in metrics if r["step"] == step and r["time"] >= after]
    return min(recs) if recs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slices", type=int, default=2)
    p.add_argument("--processes-per-slice", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=12)
    p.add_argument("--restart-delay", type=float, default=40.0)
    p.add_argument("--run-root", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    model = list(MODEL)
    if smoke():
        args.steps, args.kill_at, args.restart_delay = 16, 4, 1.0
        args.slices, args.processes_per_slice = 2, 2
        model = []  # the demo's 2-layer model
        smoke_env(os.environ)
    per_slice, processes = args.processes_per_slice, args.slices * args.processes_per_slice
    announce_smoke(
        f"2 slices x 2 processes, {args.steps} steps, kill after step {args.kill_at}, the demo's 2-layer "
        "model compiled without XLA optimisation"
    )
    root = args.run_root or Path(tempfile.mkdtemp(prefix="rejoin_memory_"))
    extra = (*model, f"processes_per_slice={per_slice}", f"jax_cache_dir={root / 'jax_cache'}", *args.overrides)
    job = Job(
        root,
        "rejoin",
        trainer_args(root, "rejoin", steps=args.steps, processes=args.slices, min_slices=1, extra=extra),
        processes=processes,
        restart_delay=args.restart_delay,
        max_restarts=1,
    )
    print(f"run directory: {job.run_dir}\nlauncher output: {job.log_path}", flush=True)
    sampler = Sampler(job, processes)
    sampler.start()
    victim = per_slice  # the first process of slice 1
    try:
        kill = kill_at_step(job, victim, args.kill_at, timeout=args.timeout)
        rc = job.wait(timeout=args.timeout)
    finally:
        sampler.done.set()
        job.stop()
    if rc != 0:
        print(job.output()[-3000:])
        sys.exit(f"the job failed (rc={rc})")
    data = collect(job.run_dir, processes)
    t0 = kill["time"]
    ev0 = data[0]["events"]
    start0 = min(e["time"] for e in ev0 if e["event"] == catalogue.ATTEMPT_START)
    respawn = [
        e for e in job.launcher_events() if e["event"] == catalogue.LAUNCHER_SPAWN and e["process"] == victim
    ][-1]
    up = first(ev0, catalogue.SCALE_UP_REQUESTED, respawn["time"])  # None: it was back before slice 0 re-formed
    shared = first(ev0, catalogue.SNAPSHOT_SHARED, respawn["time"])
    if shared is None:
        sys.exit("the replacement did not rejoin before the run ended: raise --steps")
    grown = [r for r in data[0]["metrics"] if r["time"] > shared["time"] and r["devices"] == processes]
    settle = grown[min(3, len(grown) - 1)]["time"] if grown else time.time()

    state_bytes = first(ev0, catalogue.RESTORE_END, 0)["bytes"]
    print(
        f"\n{args.slices} slices x {per_slice} processes, train state {state_bytes / 2**20:.0f} MiB "
        f"({state_bytes / per_slice / 2**20:.0f} MiB per process); kill -9 process {victim} after step "
        f"{kill['step']}; snapshot shared at step {shared['step']} from processes {shared['source_processes']}"
    )
    print(f"{'process':<22} {'steady peak':>12} {'rejoin peak':>12} {'ratio':>6}  (resident memory, VmRSS)")
    for proc in range(processes):
        pid0 = sorted({r["pid"] for r in data[proc]["metrics"]})[0]
        steady = sampler.peak(proc, start0, t0, pid=pid0)
        if proc == victim:
            pid = respawn["pid"]
            joined = sampler.peak(proc, respawn["time"], settle, pid=pid)
            peer = sampler.peak(proc + 1, start0, t0) if per_slice > 1 else steady
            print(
                f"{f'{proc} (replacement)':<22} {peer / 2**20 if peer else float('nan'):>10.0f}Mi "
                f"{joined / 2**20 if joined else float('nan'):>10.0f}Mi "
                f"{joined / peer if joined and peer else float('nan'):>6.2f}  (steady: its slice's survivor)"
            )
            continue
        peak = sampler.peak(proc, t0, settle)
        ratio = peak / steady if peak and steady else float("nan")
        print(
            f"{proc:<22} {steady / 2**20 if steady else float('nan'):>10.0f}Mi "
            f"{peak / 2**20 if peak else float('nan'):>10.0f}Mi {ratio:>6.2f}"
        )

    det = first(ev0, catalogue.SLICE_DOWN_DETECTED, t0)
    wait = first(ev0, catalogue.WAIT_END, det["time"]) if det else None
    restore = first(ev0, catalogue.RESTORE_END, det["time"]) if det else None
    restore_start = first(ev0, catalogue.RESTORE_START, det["time"]) if det else None
    resumed = first(ev0, catalogue.FIRST_STEP_AFTER_RECOVERY, det["time"]) if det else None
    phases = {
        "detection (kill -> failure seen)": det and det["time"] - t0,
        "re-forming (-> formation agreed)": wait and det and wait["time"] - det["time"],
        "compile, barrier (-> restore start)": restore_start and wait and restore_start["time"] - wait["time"],
        "restore": restore and restore["seconds"],
        "first step": resumed and restore and resumed["time"] - restore["time"],
        "kill -> next step on slice 0": resumed and resumed["time"] - t0,
    }
    print("\nslice 0 after the kill:")
    for k, v in phases.items():
        print(f"  {k:<36} {v:8.2f} s" if v is not None else f"  {k:<36}      n/a")
    formed = first(ev0, catalogue.WAIT_END, up["time"] if up else respawn["time"])
    rejoin_restore = first(ev0, catalogue.RESTORE_END, up["time"] if up else respawn["time"])
    rejoin_restore_start = first(ev0, catalogue.RESTORE_START, up["time"] if up else respawn["time"])
    all_step = grown[0]["time"] if grown else None
    rejoin = {
        "replacement started (after kill)": respawn["time"] - t0,
        "seen by slice 0 (-> scale up)": up and up["time"] - respawn["time"],
        "re-forming (-> formation agreed)": formed and formed["time"] - (up or respawn)["time"],
        "compile, barrier (-> restore start)": rejoin_restore_start
        and formed
        and rejoin_restore_start["time"] - formed["time"],
        "transfer of shards (snapshot_shared)": shared["seconds"],
        "restore total": rejoin_restore and rejoin_restore["seconds"],
        "first step on all processes": all_step and rejoin_restore and all_step - rejoin_restore["time"],
        "kill -> first step on all processes": all_step and all_step - t0,
    }
    print("rejoin:")
    for k, v in rejoin.items():
        print(f"  {k:<36} {v:8.2f} s" if v is not None else f"  {k:<36}      n/a")
    print(json.dumps({"phases": phases, "rejoin": rejoin, "state_bytes": state_bytes}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
