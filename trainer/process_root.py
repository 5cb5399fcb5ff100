"""The process root: everything a training process holds from its start to its exit, in one object.

`ProcessRoot.open` takes, in this order, each pushed on one ExitStack: SIGTERM (`StopSignal`, with the
process's `Phases`), the run's lease (process 0 of the job, unless run_lease_stale_seconds=0: two jobs
never train one run directory), the run directory (config.yml, the event log `events.jsonl`, its live
upload when the run directory is on a bucket) and the progress watchdog (trainer.process.watchdog). `run()`
(trainer.run) gets the root and reads its parts: the phases, the stop signal, the save fence, the events,
the paths, the backend, the watchdog's `beat` and `writable`. `close(ending)` unwinds the stack in the
reverse order: the watchdog stops, goodput and the `finish` event are recorded, the event log closes, the
logs go up, the lease is released and SIGTERM's own watchdog stands down.

The watchdog's exits leave from its thread (`os._exit`: nothing a stuck main thread could block):
- a hang (no progress within the phase's bound): every thread's stack to the log and to the run
  directory, the newest host snapshot to the local tier (bounded), `hang_detected` and `finish`, then
  exit 75 after releasing the lease (`ReleaseThenExit`, as the stop deadline does);
- a frozen process (several processes: its peers went on without it): it writes nothing, the lease
  included, and exits 75.
Every way out ends with one `STATUS:` line and the contract's exit code (trainer/errors.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.checkpoint.fence import SaveFence
from trainer.config.schema import TrainConfig
from trainer.errors import EXIT_BAD_INPUT, EXIT_GAVE_UP, EXIT_PREEMPTED, EXIT_TRANSIENT, exit_code_for
from trainer.logevents import event_extra
from trainer.observe import catalogue
from trainer.observe.events import EventLog
from trainer.process.preemption import Phases, Preempted, StopSignal
from trainer.process.watchdog import Hang, HangTimeouts, ProgressWatchdog

if TYPE_CHECKING:
    from trainer.elastic.backends import Backend
    from trainer.observe.rundir import RunPaths
    from trainer.preflight import Preflight

log = logging.getLogger(__name__)


def print_status(line: str) -> None:
    """The last line a process prints: how it ended (below the console's live line, taken down first)."""
    from trainer.observe.console import stop_status_line

    stop_status_line()
    print(f"STATUS: {line}", flush=True)


@dataclasses.dataclass(frozen=True)
class Ending:
    """How the process ends: its exit code, the `finish` event's status and fields, the STATUS line."""

    code: int
    status: str
    line: str
    fields: dict


def ending_of_error(error: BaseException, logger: logging.Logger = log) -> Ending:
    """The ending of an error that ended the run (call it in the `except` block: a failure's traceback
    goes to `logger`): the contract's code for its cause (trainer.errors)."""
    if isinstance(error, Preempted):
        logger.warning("stopped by SIGTERM during %s; rerun the same command to resume", error.phase)
        line = f"preempted during {error.phase}: rerun the same command to resume"
        return Ending(EXIT_PREEMPTED, "preempted", line, {"phase": error.phase})
    code = exit_code_for(error)
    text = f"{type(error).__name__}: {error}"
    if code == EXIT_BAD_INPUT:
        status = _input_status(error)
        logger.error("%s: %s", status.replace("_", " "), error)
        return Ending(code, status, status, {"error": str(error)})
    if code == EXIT_GAVE_UP:
        logger.error("elastic recovery gave up: %s", error)
        return Ending(code, "elastic_gave_up", f"elastic_gave_up: {error}", {"error": str(error)})
    if code == EXIT_TRANSIENT:
        logger.exception("infrastructure failure; everything saved is intact: rerun the same command to resume")
        return Ending(code, "transient", f"transient: {text}", {"error": text})
    if code == EXIT_PREEMPTED:
        return Ending(code, "preempted", f"preempted: {error}", {"error": text})
    logger.exception("training failed")
    return Ending(code, "failed", f"failed: {text}", {"error": text})


def _input_status(error: BaseException) -> str:
    """config_error, data_error or input_error (a path or checkpoint that cannot be used)."""
    from trainer.config import ConfigError
    from trainer.data.errors import DataError

    if isinstance(error, ConfigError):
        return "config_error"
    return "data_error" if isinstance(error, DataError) else "input_error"


class ReleaseThenExit:
    """How a watchdog thread ends the process (the stop deadline, a hang): release the run's lease (after
    the emergency save, bounded: the store may be what hangs), then `exit_process(code)`. A frozen process
    does not use it: it writes nothing, the lease included."""

    RELEASE_BOUND_S = 3.0

    def __init__(self, exit_process: Callable[[int], None] = os._exit):
        self.lease = None
        self.exit_process = exit_process

    def __call__(self, code: int) -> None:
        if self.lease is not None:
            releasing = threading.Thread(target=self.lease.release, name="lease-release", daemon=True)
            releasing.start()
            releasing.join(timeout=self.RELEASE_BOUND_S)
        self.exit_process(code)


class ProcessRoot:
    """See the module docstring. `train`: the run's own section (stop and hang bounds, the lease's);
    `paths`: this process's run paths (`Backend.log_paths`); `backend`: the job's backend, chosen once;
    `exit_process`: how a watchdog ends the process (os._exit)."""

    def __init__(
        self,
        train: TrainConfig,
        paths: RunPaths,
        backend: Backend,
        *,
        exit_process: Callable[[int], None] = os._exit,
    ):
        self.train = train
        self.paths = paths
        self.backend = backend
        self.phases = Phases()
        self.exit = ReleaseThenExit(exit_process)
        self._exit_frozen = exit_process
        self.stop = StopSignal(train.stop_timeout_seconds, phases=self.phases, exit_process=self.exit)
        self.fence = SaveFence()
        self.events: EventLog | None = None
        self.lease = None
        self.upload = None
        self.watchdog: ProgressWatchdog | None = None
        self._ending: Ending | None = None
        self._stack = contextlib.ExitStack()

    # ---- start ----------------------------------------------------------------------------------------

    def open(self, config_text: str, *, model: str, checked: Preflight) -> ProcessRoot:
        """Take the process's parts, in order (see the module docstring). On an error, what was taken is
        given back before it propagates."""
        try:
            self._open(config_text, model, checked)
        except BaseException:
            self._stack.close()
            raise
        return self

    def _open(self, config_text: str, model: str, checked: Preflight) -> None:
        stack, paths = self._stack, self.paths
        self.stop.install()
        stack.callback(self.stop.finished)
        taken = self._take_lease()  # before the first write: two jobs must never train one run directory
        if self.lease is not None:
            self.exit.lease = self.lease  # the watchdogs' exits (stop deadline, hang) release it first
            self.fence = SaveFence(self.lease)
            stack.callback(self.lease.release)
        paths.local.mkdir(parents=True, exist_ok=True)
        paths.pull()
        (paths.local / "config.yml").write_text(config_text)
        stack.callback(paths.sync)
        stack.callback(self._stop_upload)
        self.events = events = EventLog(paths.local / "events.jsonl")
        stack.callback(events.close)
        self._emit_start(model, checked)
        self.upload = _live_upload(paths, events)
        if taken is not None:
            events.emit(catalogue.LEASE_ACQUIRED, **taken)
        for given in checked.unused_load_paths:
            key, _, value = given.partition("=")
            events.emit(catalogue.LOAD_PATH_UNUSED, key=key, path=value, resume_step=checked.resume_step)
        if self.lease is not None:
            self.stop.add_check(self._check_lease)
            self.lease.start_heartbeat(on_lost=lambda: log.error("the run's lease was taken over by another job"))
        stack.callback(self._record_ending)
        self.watchdog = self._start_watchdog()
        if self.watchdog is not None:
            stack.callback(self.watchdog.stop)

    def _emit_start(self, model: str, checked: Preflight) -> None:
        from trainer.hostmem import hugepages_requested

        paths = self.paths
        self.events.emit(
            catalogue.START,
            run_name=paths.local.name if paths.remote is None else paths.remote.name,
            model=model,
            steps=self.train.steps,
            resume_step=checked.resume_step,
            argv=sys.argv[1:],
            host_hugepages=hugepages_requested(),
        )

    def _take_lease(self) -> dict | None:
        """The lease for process 0 of the job (its event fields); None for the others or when leases are off."""
        from trainer.checkpoint.lease import RunLease

        if self.train.run_lease_stale_seconds <= 0 or self.backend.process_id != 0:
            return None
        paths = self.paths
        root = paths.remote if paths.remote is not None else paths.local
        if paths.remote is None:
            paths.local.mkdir(parents=True, exist_ok=True)
        lease = RunLease(root, stale_s=self.train.run_lease_stale_seconds)
        taken = lease.acquire()
        self.lease = lease
        return taken

    def _check_lease(self) -> None:
        from trainer.checkpoint.lease import LeaseLost

        if self.lease.lost:
            raise LeaseLost(
                f"the run directory's lease was taken over by another job (a heartbeat older than "
                f"run_lease_stale_seconds={self.lease.stale_s:g}): this job stops; its saves no longer commit"
            )

    def _start_watchdog(self) -> ProgressWatchdog | None:
        """The progress watchdog, unless hang_timeout_seconds=0. With several processes it also fences a
        process frozen for longer than its peers take to declare it dead (`Backend.freeze_bound_s`)."""
        t = self.train
        if t.hang_timeout_seconds == 0:
            return None
        watchdog = ProgressWatchdog(
            HangTimeouts(t.hang_timeout_seconds, t.hang_timeout_phase_seconds),
            self._on_hang,
            phase=self.phases.current,
            freeze_bound_s=self.backend.freeze_bound_s,
            on_frozen=self._on_frozen,
        )
        self.events.writable = self.writable
        return watchdog.start()

    # ---- what run() reads -----------------------------------------------------------------------------

    def beat(self, step: int) -> None:
        """Step `step` completed: progress for the watchdog."""
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def hold(self, close: Callable[[], None]) -> None:
        """Call `close` when the root closes, before everything `open` took is given back (a service that
        lives as long as the process: the live metrics endpoint)."""
        self._stack.callback(close)

    def writable(self) -> bool:
        """False once this process was frozen past the point its peers declared it dead: it writes nothing."""
        return self.watchdog is None or not self.watchdog.fenced()

    # ---- the end --------------------------------------------------------------------------------------

    def __enter__(self) -> ProcessRoot:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def close(self, ending: Ending) -> None:
        """The run ended with `ending`: record it and give everything back (see the module docstring)."""
        self._ending = ending
        self._stack.close()

    def _record_ending(self) -> None:
        if self._ending is None:  # an error before the run, or one that bypassed its end: nothing to say
            return
        ending = self._ending
        emit_goodput(self.events, self.paths.local)
        self.events.emit(catalogue.FINISH, status=ending.status, exit_code=ending.code, **ending.fields)

    def _stop_upload(self) -> None:
        if self.upload is not None:
            self.upload.stop()

    # ---- the watchdog's exits -------------------------------------------------------------------------

    def _on_frozen(self, seconds: float) -> None:
        """This process was frozen and its peers went on without it: it writes nothing (its logs are
        fenced) and exits 75, so the launcher or scheduler brings it back as a replacement."""
        _exit_now(
            EXIT_TRANSIENT,
            f"transient: this process was frozen for {seconds:.0f} s and its peers went on without it; "
            "exiting without writing anything (restart me: I rejoin as a replacement)",
            self._exit_frozen,
        )

    def _on_hang(self, hang: Hang) -> None:
        """The watchdog saw no progress: every thread's stack in the log (and a file in the run directory),
        the newest host snapshot to the local tier (bounded by stop_timeout_seconds: a hung device may hang
        the copy too), recorded, and exit 75 through `ReleaseThenExit` so the scheduler restarts the same
        command."""
        events, stop, paths = self.events, self.stop, self.paths
        stacks = _dump_stacks(hang, paths.local / "hangs" / f"{os.getpid()}-{int(time.time())}.txt")
        events.emit(
            catalogue.HANG_DETECTED,
            phase=hang.phase,
            step=hang.step,
            seconds=hang.seconds,
            timeout_s=hang.timeout_s,
            stacks=None if stacks is None else str(stacks),
        )
        saver = threading.Thread(target=stop.save_now, name="hang-emergency-save", daemon=True)
        saver.start()
        saver.join(timeout=stop.timeout_s)
        if saver.is_alive():
            print(
                f"hang: the emergency save did not end within {stop.timeout_s:g} s; exiting without it",
                file=sys.stderr,
            )
        error = f"hang: no progress in phase {hang.phase} for {hang.seconds:.0f} s (bound {hang.timeout_s:.0f} s)"
        with contextlib.suppress(Exception):
            emit_goodput(events, paths.local)
        events.emit(
            catalogue.FINISH,
            status="transient",
            exit_code=EXIT_TRANSIENT,
            step=hang.step,
            phase=hang.phase,
            error=error,
        )
        events.close()
        syncing = threading.Thread(target=paths.sync, name="hang-sync", daemon=True)
        syncing.start()
        syncing.join(timeout=stop.timeout_s)
        stop.finished()
        _exit_now(EXIT_TRANSIENT, f"transient: {error}; rerun the same command to resume", self.exit)


def _dump_stacks(hang: Hang, path: Path) -> Path | None:
    """Every thread's stack to `path` and to the log as one record (one JSON object under
    `log_format=json`, the stacks in its message); the path. When `path` cannot be written, the stacks go
    to stderr as faulthandler writes them, and None is returned."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"phase={hang.phase} step={hang.step} seconds={hang.seconds} timeout_s={hang.timeout_s}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        stacks = path.read_text()
    except OSError as e:
        print(
            f"hang: could not write the stacks to the run directory ({e}); every thread's stack:", file=sys.stderr
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        return None
    log.error(
        "no progress in phase %s for %.0f s; every thread's stack (also in %s):\n%s",
        hang.phase,
        hang.seconds,
        path,
        stacks,
        extra=event_extra("hang_stacks", {"phase": hang.phase, "step": hang.step, "path": str(path)}),
    )
    return path


def _exit_now(code: int, status: str, exit_process: Callable[[int], None]) -> None:
    """End the process from the watchdog's thread: the `STATUS:` line, the logs flushed, then
    `exit_process(code)` (os._exit: nothing a stuck main thread could block)."""
    print_status(status)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    sys.stderr.flush()
    exit_process(code)


def _live_upload(paths: RunPaths, events: EventLog):
    """For a run directory on a bucket: its files sent every LIVE_SYNC_SECONDS and after each committed
    checkpoint (trainer.observe.live_upload); None for a local run."""
    from trainer.observe.live_upload import LiveUpload

    if paths.remote is None:
        return None
    upload = LiveUpload(paths.sync).start()
    events.subscribe(upload.on_event)
    return upload


def emit_goodput(events: EventLog, run_dir: Path) -> None:
    """One summary event and log line: where the wall time went (see trainer.observe.goodput)."""
    from trainer.io.jsonl import read_jsonl
    from trainer.observe.goodput import account

    # The whole run, earlier processes and pods included (a resumed run appends to the same files).
    summary = account(read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "metrics.jsonl"), now=time.time())
    events.emit(
        catalogue.GOODPUT,
        goodput=None if summary["goodput"] is None else round(summary["goodput"], 4),
        wall_s=round(summary["wall_s"], 3),
        productive_s=round(summary["productive_s"], 3),
        badput_s=summary["badput_s"],
    )
