"""Demo: `kill -9` one process of a multi-process (jax.distributed) trainer job and watch the rest carry on.

    python scripts/multiprocess_demo.py [--mode replica-resize|pause-resume] [--kill-process 1]
                                        [--kill-at-step 12] [--restart-delay 3] [--no-respawn]

Runs a tiny Qwen3 on 3 processes x 1 CPU device through scripts/launch_local.py, sends SIGKILL to
one trainer process once its metrics show --kill-at-step, lets the launcher start a replacement after
--restart-delay seconds (unless --no-respawn), and prints the timeline (kill, detection, training on
the survivors, respawn, rejoin), the steps lost and the PIDs of every process. Killing process 0 (the
coordination service host) ends the job; the demo then says so and shows the exit codes.

The functions here (launch, kill_at_step, collect, timeline) also drive tests/test_multiprocess.py.
TRAINER_SMOKE=1 (as for the benchmarks, benchmarks/cli_runs.py) runs it all at minimal sizes; the run may then
end before the replacement has rejoined, and the launcher stops it after a short grace.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from trainer.observe import catalogue  # noqa: E402

# Small enough to compile in seconds on a shared CPU; the elastic machinery is what is shown. Rows of 128
# tokens give a step enough work that the survivors are still training when a replacement has started.
TINY = [
    "model=qwen3-tiny",
    "base_num_decoder_layers=2",
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=16",
    "base_mlp_dim=128",
    "vocab_size=512",
    "max_target_length=128",
    "per_device_batch_size=2",
    "remat_policy=none",
    "enable_tensorboard=false",
    "log_period=1",
]
# A lost process is detected once its heartbeat is overdue (heartbeat_timeout_seconds); a receive stuck on
# the dead peer fails after the collective timeout at worst. The collective timeout must exceed any
# legitimate wait inside one collective on a loaded CI machine (step skew); it only delays detection when
# a receive hangs on the dead peer.
FAST_FT = ["heartbeat_timeout_seconds=2", "collective_timeout_seconds=20", "elastic_poll_interval_seconds=0.05"]
# TRAINER_SMOKE=1: the demo at minimal sizes (benchmarks/cli_runs.py reads it for the benchmarks).
SMOKE = os.environ.get("TRAINER_SMOKE", "") not in ("", "0")
SMOKE_XLA_FLAGS = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]


def trainer_args(
    run_root: Path,
    run_name: str,
    *,
    steps: int,
    processes: int = 3,
    min_slices: int = 2,
    extra: tuple[str, ...] = (),
) -> list[str]:
    return [
        "base.yml",
        *TINY,
        *FAST_FT,
        f"steps={steps}",
        f"num_slices={processes}",
        "elastic_enabled=true",
        f"elastic_min_slice_count={min_slices}",
        "snapshot_period=2",
        "checkpoint_period=10",
        "elastic_timeout_seconds=120",
        f"base_output_directory={run_root}",
        f"run_name={run_name}",
        *extra,
    ]


class Job:
    """scripts/launch_local.py running in the background, its output in a file, its events readable."""

    def __init__(
        self,
        run_root: Path,
        run_name: str,
        args: list[str],
        *,
        processes: int = 3,
        restart_delay: float = 3.0,
        max_restarts: int = 1,
        max_job_restarts: int = 0,
        grace: float = 30.0,
    ):
        self.run_dir = run_root / run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = run_root / f"{run_name}.launcher.log"
        self.events_path = run_root / f"{run_name}.launcher.jsonl"
        cmd = [
            sys.executable,
            str(REPO / "scripts" / "launch_local.py"),
            f"--num-processes={processes}",
            f"--restart-delay={restart_delay}",
            f"--max-restarts={max_restarts}",
            f"--max-job-restarts={max_job_restarts}",
            f"--grace={grace:g}",
            f"--events={self.events_path}",
            "--",
            *args,
        ]
        self._log = open(self.log_path, "ab")
        # Its own process group: stop() reaches the launcher and every trainer it started.
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def launcher_events(self) -> list[dict]:
        return read_jsonl(self.events_path)

    def pid_of(self, process: int) -> int | None:
        spawns = [
            e for e in self.launcher_events() if e["event"] == catalogue.LAUNCHER_SPAWN and e["process"] == process
        ]
        return spawns[-1]["pid"] if spawns else None

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill the launcher's whole process group (trainers included) and reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of a killed writer
    return out


def log_dir(run_dir: Path, process: int) -> Path:
    return run_dir if process == 0 else run_dir / f"process_{process}"


def last_step(run_dir: Path, process: int) -> int:
    recs = read_jsonl(log_dir(run_dir, process) / "metrics.jsonl")
    return max((r["step"] for r in recs), default=0)


def wait_until(job: Job, condition, what: str, *, timeout: float):
    """Poll `condition()` until it returns something truthy (returned); fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if job.proc.poll() is not None:
            raise RuntimeError(f"job ended (rc={job.proc.returncode}) before {what}:\n{job.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} in {timeout} s")
        time.sleep(0.01)
    return found


def kill_at_step(job: Job, process: int, step: int, *, timeout: float) -> dict:
    """SIGKILL `process` once its metrics show `step` done; returns {pid, time, step}."""
    wait_until(
        job, lambda: last_step(job.run_dir, process) >= step, f"step {step} on process {process}", timeout=timeout
    )
    pid = job.pid_of(process)
    os.kill(pid, signal.SIGKILL)
    killed = {"pid": pid, "time": time.time(), "step": last_step(job.run_dir, process), "process": process}
    (job.run_dir.parent / f"{job.run_dir.name}.kill.json").write_text(json.dumps(killed))
    return killed


def collect(run_dir: Path, processes: int = 3) -> dict:
    """Events and metrics of every process, keyed by process id."""
    return {
        i: {
            "events": read_jsonl(log_dir(run_dir, i) / "events.jsonl"),
            # step rows only (eval rows, with eval_interval set, say "kind": "eval"; trainer.observe.records)
            "metrics": [r for r in read_jsonl(log_dir(run_dir, i) / "metrics.jsonl") if r.get("kind") != "eval"],
        }
        for i in range(processes)
    }


def _first(events: list[dict], name: catalogue.Event, after: float, **match) -> dict | None:
    for e in events:
        if e["event"] == name and e["time"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def timeline(run_dir: Path, kill: dict, launcher_events: list[dict], processes: int = 3) -> dict:
    """The recovery as seen by every process, in seconds after the kill."""
    data = collect(run_dir, processes)
    victim, t0 = kill["process"], kill["time"]
    survivors = [i for i in range(processes) if i != victim]
    out: dict = {
        "killed_process": victim,
        "killed_pid": kill["pid"],
        "killed_after_step": kill["step"],
        "survivors": {},
        "pids": {},
    }
    for i in range(processes):
        out["pids"][i] = sorted({r["pid"] for r in data[i]["metrics"]})
    for i in survivors:
        ev = data[i]["events"]
        det = _first(ev, catalogue.SLICE_DOWN_DETECTED, t0)
        s = {"detected": det and det["time"] - t0, "last_step_before": det and det["last_step"]}
        if det:
            resumed = _first(ev, catalogue.FIRST_STEP_AFTER_RECOVERY, det["time"])
            s["continued"] = resumed and resumed["time"] - t0
            s["continued_step"] = resumed and resumed["step"]
            s["continued_slices"] = resumed and resumed["slices"]
            s["detection_to_next_step"] = resumed and resumed["seconds_since_detection"]
            up = _first(ev, catalogue.SCALE_UP_REQUESTED, det["time"])
            s["rejoin_seen"] = up and up["time"] - t0
            s["rejoin_step"] = up and up["step"]
            if up:  # the first step on every process again, from this process's metrics
                grown = [r for r in data[i]["metrics"] if r["time"] > up["time"] and r["devices"] == processes]
                s["first_step_all"] = grown[0]["time"] - t0 if grown else None
                s["first_step_all_number"] = grown[0]["step"] if grown else None
        summary = [e for e in ev if e["event"] == catalogue.ELASTIC_SUMMARY]
        s["steps_lost"] = summary[-1]["steps_lost"] if summary else None
        out["survivors"][i] = s
    died = _first(launcher_events, catalogue.LAUNCHER_EXIT, t0, process=victim)
    respawn = _first(launcher_events, catalogue.LAUNCHER_SPAWN, t0, process=victim)
    out["launcher_saw_exit"] = died and died["time"] - t0
    out["respawned"] = respawn and respawn["time"] - t0
    out["respawned_pid"] = respawn and respawn["pid"]
    if respawn:
        ev = [e for e in data[victim]["events"] if e.get("pid") == respawn["pid"]]
        joined = _first(ev, catalogue.WAIT_END, 0)
        attempt = _first(ev, catalogue.ATTEMPT_START, 0)
        recs = [r for r in data[victim]["metrics"] if r["pid"] == respawn["pid"]]
        out["rejoiner"] = {
            "joined": joined and joined["time"] - t0,
            "start_step": attempt and attempt["start_step"],
            "restored_from": attempt and attempt["source"],
            "first_step": recs[0]["time"] - t0 if recs else None,
            "first_step_number": recs[0]["step"] if recs else None,
        }
    return out


def format_timeline(t: dict) -> str:
    """The timeline in time order, then steps lost and PIDs."""
    rows: list[tuple[float, str]] = [
        (
            0.0,
            f"kill -9 process {t['killed_process']} (pid {t['killed_pid']}); its "
            f"metrics showed step {t['killed_after_step']}",
        )
    ]

    def add(at, text):
        if at is not None:
            rows.append((at, text))

    add(t["launcher_saw_exit"], "launcher sees it exit")
    for i, s in t["survivors"].items():
        add(
            s["detected"],
            f"process {i}: failure detected in the train function (last step {s['last_step_before']})",
        )
        add(
            s.get("continued"),
            f"process {i}: step {s.get('continued_step')} done on slices "
            f"{s.get('continued_slices')} (detection -> next step {s.get('detection_to_next_step')} s)",
        )
        add(
            s.get("rejoin_seen"),
            f"process {i}: sees the replacement after step {s.get('rejoin_step')}: snapshot, scale up",
        )
        add(
            s.get("first_step_all"),
            f"process {i}: step {s.get('first_step_all_number')} done on all processes again",
        )
    if t.get("respawned") is not None:
        r = t.get("rejoiner", {})
        add(t["respawned"], f"launcher starts the replacement (pid {t['respawned_pid']})")
        add(r.get("joined"), "replacement agrees membership with the survivors")
        add(
            r.get("first_step"),
            f"replacement: first step {r.get('first_step_number')} (restored "
            f"{r.get('restored_from')}, start step {r.get('start_step')})",
        )
    lines = [f"t={at:+8.2f}s  {text}" for at, text in sorted(rows, key=lambda row: row[0])]
    lines.append("steps lost: " + ", ".join(f"process {i}: {s['steps_lost']}" for i, s in t["survivors"].items()))
    lines.append("PIDs per process: " + ", ".join(f"{i}: {p}" for i, p in t["pids"].items()))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("replica-resize", "pause-resume"), default="replica-resize")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--kill-at-step", type=int, default=13)
    p.add_argument("--kill-process", type=int, default=1)
    p.add_argument("--restart-delay", type=float, default=5.0)
    p.add_argument("--no-respawn", action="store_true")
    p.add_argument("--run-root", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("overrides", nargs="*", help="extra key=value for the trainer")
    args = p.parse_args()
    grace = 30.0
    if SMOKE:  # whatever the arguments say; the launcher gives a replacement still joining 5 s, not 30
        args.steps, args.kill_at_step = min(args.steps, 10), min(args.kill_at_step, 3)
        args.restart_delay, grace = min(args.restart_delay, 1.0), 5.0
        flags = os.environ.get("XLA_FLAGS", "").split()
        os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in SMOKE_XLA_FLAGS if f not in flags])
        print(
            f"smoke mode (TRAINER_SMOKE=1): {args.steps} steps, kill after step {args.kill_at_step}, "
            f"restart delay {args.restart_delay:g} s, launcher grace {grace:g} s, compiled without XLA "
            "optimisation; figures are not measurements",
            flush=True,
        )
    root = args.run_root or Path(tempfile.mkdtemp(prefix="multiprocess_demo_"))
    min_slices = 2 if args.mode == "replica-resize" else -1
    job = Job(
        root,
        "demo",
        trainer_args(root, "demo", steps=args.steps, min_slices=min_slices, extra=tuple(args.overrides)),
        restart_delay=args.restart_delay,
        max_restarts=0 if args.no_respawn else 1,
        grace=grace,
    )
    print(f"run directory: {job.run_dir}\nlauncher output: {job.log_path}", flush=True)
    try:
        kill = kill_at_step(job, args.kill_process, args.kill_at_step, timeout=args.timeout)
        print(
            f"killed process {args.kill_process} (pid {kill['pid']}) with SIGKILL after step {kill['step']}",
            flush=True,
        )
        rc = job.wait(timeout=args.timeout)
    finally:
        job.stop()
    print(f"launcher exit code: {rc}")
    exits = [e for e in job.launcher_events() if e["event"] == catalogue.LAUNCHER_EXIT]
    print("process exits: " + ", ".join(f"p{e['process']} pid {e['pid']} rc={e['rc']}" for e in exits))
    if args.kill_process == 0:
        print(
            "process 0 hosted the coordination service: the whole job ended with it. Rerun the same command "
            "(or use launch_local.py --max-job-restarts) to resume from the newest committed checkpoint."
        )
        return 0
    t = timeline(job.run_dir, kill, job.launcher_events())
    print(format_timeline(t))
    print(json.dumps(t, default=str))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
