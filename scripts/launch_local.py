"""Run a multi-process trainer job on localhost, restarting dead processes like a Kubernetes Job.

    python scripts/launch_local.py --num-processes 3 [--restart-delay 2] [--max-restarts 3] -- \\
        base.yml steps=100 num_slices=3 elastic_enabled=true elastic_min_slice_count=2 ...

Starts N `python -m trainer.train <trainer args>` processes with JAX_COORDINATOR_ADDRESS (a free
localhost port), JAX_NUM_PROCESSES and JAX_PROCESS_ID, one CPU device each by default, and prints
their output interleaved, each line prefixed with `[p<i>]`. Its own lines start with `[launcher]`.

The trainers run in the caller's working directory, as `python -m trainer.train` typed there would: a
relative config file (`my.yml`) and relative outputs (the default `base_output_directory: runs`) mean
the caller's directory, not this checkout. Named configs (`base.yml`) still come from the package's
configs/, and this checkout is put on PYTHONPATH so `trainer` imports without a pip install.

Restart policy (a Job's backoff limit; the delay models scheduling a replacement pod):
- a process other than 0 that dies (non-zero exit or a signal) is started again with the same
  process id after --restart-delay seconds, at most --max-restarts times over the job; it rejoins
  the survivors;
- process 0 hosts the coordination service: when it dies every other process dies with it, so the
  whole job is restarted (all processes, a new port) after the delay, at most --max-job-restarts
  times; the trainer resumes from its newest committed checkpoint;
- exit 1 (a process's own error, on every process), 2 (bad input) or 3 (gave up) from any process is
  final;
- exit 42 (preempted: a SIGTERM stopped it after saving) is not restarted: here a SIGTERM is the user
  stopping the job (a Kubernetes Job would replace a preempted pod);
- when process 0 exits 0 or 42 the job is done: the others get --grace seconds to exit, then are stopped.

The launcher exits with process 0's final code (128 + signal number for a signal). --events FILE
writes one JSON object per spawn, exit and restart decision (with wall-clock times and PIDs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FINAL_CODES = (1, 2, 3)  # failed (every process, with its cause), bad input, elastic gave up
PREEMPTED = 42  # stopped by SIGTERM after saving (trainer/errors.py): here, the job is being stopped
_POLL_S = 0.05


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the launcher dies (Linux), so no trainer outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


class Launcher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.procs: dict[int, subprocess.Popen] = {}
        self.incarnation: dict[int, int] = {}
        self.restarts = 0
        self.job_restarts = 0
        self.port = args.port or free_port()
        self.pending: dict[int, float] = {}  # process id -> monotonic time to respawn it
        self._out_lock = threading.Lock()
        self._events = open(args.events, "a", buffering=1) if args.events else None
        self._stopping = False

    # ---- output --------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        with self._out_lock:
            sys.stdout.write(f"[launcher] {text}\n")
            sys.stdout.flush()

    def event(self, name: str, **fields) -> None:
        record = {"event": name, "time": time.time(), **fields}
        if self._events is not None:
            self._events.write(json.dumps(record) + "\n")

    def _pump(self, i: int, stream) -> None:
        for line in iter(stream.readline, b""):
            with self._out_lock:
                sys.stdout.write(f"[p{i}] {line.decode(errors='replace')}")
                sys.stdout.flush()
        stream.close()

    # ---- processes -----------------------------------------------------------------------------

    def env(self, i: int) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(
            flags + [f"--xla_force_host_platform_device_count={self.args.devices_per_process}"]
        )
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.update(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{self.port}",
            JAX_NUM_PROCESSES=str(self.args.num_processes),
            JAX_PROCESS_ID=str(i),
            PYTHONUNBUFFERED="1",
        )
        return env

    def spawn(self, i: int) -> None:
        cmd = [sys.executable, "-m", "trainer.train", *self.args.trainer_args]
        proc = subprocess.Popen(
            cmd, env=self.env(i), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )  # the caller's cwd (see the module docstring)
        self.procs[i] = proc
        self.incarnation[i] = self.incarnation.get(i, -1) + 1
        threading.Thread(target=self._pump, args=(i, proc.stdout), daemon=True).start()
        self.say(f"started process {i} pid={proc.pid} (incarnation {self.incarnation[i]}, port {self.port})")
        self.event("spawn", process=i, pid=proc.pid, incarnation=self.incarnation[i], port=self.port)

    def stop_all(self, sig: int = signal.SIGKILL) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass
        for i, proc in self.procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if not getattr(proc, "_reported", False):
                proc._reported = True
                self.say(f"process {i} pid={proc.pid} exited rc={proc.returncode}")
                self.event("exit", process=i, pid=proc.pid, rc=proc.returncode, incarnation=self.incarnation[i])

    # ---- policy --------------------------------------------------------------------------------

    def run(self) -> int:
        for i in range(self.args.num_processes):
            self.spawn(i)
        try:
            return self._watch()
        finally:
            self.stop_all()
            if self._events is not None:
                self._events.close()

    def _watch(self) -> int:
        while True:
            now = time.monotonic()
            for i, due in sorted(self.pending.items()):
                if now >= due:
                    del self.pending[i]
                    self.spawn(i)
            for i, proc in list(self.procs.items()):
                rc = proc.poll()
                if rc is None or getattr(proc, "_reported", False):
                    continue
                proc._reported = True
                self.say(f"process {i} pid={proc.pid} exited rc={rc}")
                self.event("exit", process=i, pid=proc.pid, rc=rc, incarnation=self.incarnation[i])
                outcome = self._on_exit(i, rc)
                if outcome is not None:
                    self.event("done", rc=outcome)
                    self.say(f"job ended: exit {outcome}")
                    return outcome
            time.sleep(_POLL_S)

    def _on_exit(self, i: int, rc: int) -> int | None:
        """What a process's exit means; an int ends the launcher with that code."""
        if rc in FINAL_CODES:
            self.say(f"process {i} exited {rc} (not retriable): stopping the job")
            return rc
        if i == 0 and rc in (0, PREEMPTED):
            self._finish_others()
            return rc
        if i == 0:
            self.say("process 0 (the coordination service) is gone: every process of the job goes with it")
            self.stop_all()
            if self.job_restarts >= self.args.max_job_restarts:
                return exit_code(rc)
            self.job_restarts += 1
            self.say(
                f"restarting the whole job in {self.args.restart_delay} s "
                f"({self.job_restarts}/{self.args.max_job_restarts}); it resumes from its newest checkpoint"
            )
            self.event("job_restart", number=self.job_restarts, delay_s=self.args.restart_delay)
            time.sleep(self.args.restart_delay)
            self.procs.clear()
            self.pending.clear()
            self.port = free_port()
            for j in range(self.args.num_processes):
                self.spawn(j)
            return None
        if rc in (0, PREEMPTED):  # done, or stopped with the job (a scheduler would restart a preempted pod)
            return None
        if self.restarts >= self.args.max_restarts:
            self.say(f"process {i} not restarted: --max-restarts={self.args.max_restarts} used up")
            self.event("restart_refused", process=i)
            return None
        self.restarts += 1
        self.pending[i] = time.monotonic() + self.args.restart_delay
        self.say(
            f"restarting process {i} in {self.args.restart_delay} s ({self.restarts}/{self.args.max_restarts})"
        )
        self.event("respawn_scheduled", process=i, delay_s=self.args.restart_delay)
        return None

    def _finish_others(self) -> None:
        deadline = time.monotonic() + self.args.grace
        self.pending.clear()
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(_POLL_S)
        for i, proc in self.procs.items():
            if proc.poll() is None:
                self.say(f"process {i} still running {self.args.grace} s after process 0 finished: stopping it")
        self.stop_all(signal.SIGTERM)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s --num-processes N [options] -- TRAINER_ARGS..."
    )
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=1, help="CPU devices of each process")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    p.add_argument("--restart-delay", type=float, default=2.0, help="seconds before a dead process is replaced")
    p.add_argument("--max-restarts", type=int, default=3, help="process restarts allowed over the job")
    p.add_argument("--max-job-restarts", type=int, default=0, help="whole-job restarts after process 0 dies")
    p.add_argument("--grace", type=float, default=60.0, help="seconds the others get after process 0 finished")
    p.add_argument("--events", type=Path, default=None, help="append launcher events (JSON lines) here")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="after --: arguments of python -m trainer.train")
    args = p.parse_args(argv)
    if args.trainer_args[:1] == ["--"]:
        args.trainer_args = args.trainer_args[1:]
    if args.num_processes < 1:
        p.error("--num-processes must be >= 1")
    return args


def main(argv=None) -> int:
    launcher = Launcher(parse_args(argv))

    def on_signal(signum, frame):
        launcher.say(f"signal {signum}: stopping every process")
        launcher.stop_all(signal.SIGKILL)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
