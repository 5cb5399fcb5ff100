"""CLI: `python -m trainer.train [CONFIG] [key=value ...] [--print-config]`.

CONFIG is a path, or a name inside configs/ (default base.yml). The exit code follows the contract in
`trainer/errors.py` (0 finished, 1 failed, 2 bad input, 3 gave up, 42 preempted, 75 transient); the
last line printed is one `STATUS:` line saying how it ended.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from trainer.errors import EXIT_BAD_INPUT, EXIT_GAVE_UP, EXIT_OK, EXIT_PREEMPTED, EXIT_TRANSIENT
from trainer.observe import catalogue

_EPILOG = """Config layers, each later one winning: configs/base.yml (every key, its default and a one-line
description), the model preset configs/models/<model>.yml, CONFIG when it is not base.yml, then
key=value arguments (flags and key=value may come in any order). --print-config shows the result and
which layer set each value.

The run directory is <base_output_directory>/<run_name>; with no run_name it is named after the job
($JOBSET_NAME, $SLURM_JOB_NAME-$SLURM_JOB_ID), else <model>-<data>, so the same command resumes the
same run.

Exit codes (the contract with Kubernetes and Slurm): 0 finished; 1 a bug or unknown error; 2 bad
config, data, input path or checkpoint, or the run directory is held by another job (before any
compute); 3 gave up (failures came faster than progress); 42 preempted (SIGTERM: the newest state is
saved, restart me); 75 transient (infrastructure failed, or no progress within hang_timeout_seconds;
everything is resumable: restart me). The
last line is always 'STATUS: ...'."""


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m trainer.train",
        description="Train a Qwen3-family model.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "config", nargs="?", default="base.yml", help="config file path or name in configs/ (default base.yml)"
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, typed by the key (see configs/base.yml)")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (marking which layer set each value) and exit",
    )
    args = p.parse_intermixed_args(argv)
    if "=" in args.config:  # `python -m trainer.train steps=10`: no config file given
        args.overrides.insert(0, args.config)
        args.config = "base.yml"
    return args


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s] %(message)s", stream=sys.stderr, force=True
    )
    for noisy in ("absl", "jax._src", "orbax", "tensorstore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _status(line: str) -> None:
    print(f"STATUS: {line}", flush=True)


def main(argv=None) -> int:
    from trainer.backends import deterministic_gpu_ops

    args = _parse_args(sys.argv[1:] if argv is None else argv)
    _setup_logging()
    deterministic_gpu_ops()  # bitwise replays on GPUs too; before anything starts a backend
    from trainer.config.loader import load_explained
    from trainer.distributed.internals import check_versions

    try:
        check_versions()  # a JAX or Orbax outside the window the internals were checked in: exit 2
        cfg, config_text = load_explained(args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(config_text)
            return EXIT_OK
        paths, preflight = _prepare(cfg)
    except Exception as e:  # bad input (2), the store unreachable (75), a bug (1): the contract's code
        return _ended_before_training(e)
    return _train(cfg, paths, preflight, config_text)


def _ended_before_training(error: Exception) -> int:
    """A start-up that failed before the run directory was written: the error's code and STATUS line."""
    code, _, line, _ = _failure(error, logging.getLogger("trainer.train"))
    _status(line)
    return code


def _input_status(error) -> str:
    """config_error, data_error or input_error (a path or checkpoint that cannot be used)."""
    from trainer.config import ConfigError
    from trainer.data.errors import DataError

    if isinstance(error, ConfigError):
        return "config_error"
    return "data_error" if isinstance(error, DataError) else "input_error"


def _prepare(cfg):
    """The run's directory (named, and its bucket logs continued) and the preflight of every input."""
    from trainer import preflight
    from trainer.observe.rundir import resolve_run_name, run_paths

    name, why = resolve_run_name(
        cfg.train.run_name,
        model=cfg.model.model,
        dataset_type=cfg.data.dataset_type,
        grain_train_files=cfg.data.grain_train_files,
    )
    paths = run_paths(
        cfg.train.base_output_directory, name, local_checkpoint_directory=cfg.checkpoint.local_checkpoint_directory
    )
    paths = _process_paths(paths, cfg)
    checked = preflight.check(cfg, paths.checkpoints, local_checkpoints=paths.local_checkpoints)
    where = f"resuming from step {checked.resume_step}" if checked.resume_step is not None else "new run"
    logging.getLogger("trainer.train").info(
        "event=run_dir run_dir=%s run_name=%s named_by=%s start=%s",
        paths.run_dir,
        name,
        why,
        where.replace(" ", "_"),
    )
    unused = "".join(f"; {given} not used: the run resumes" for given in checked.unused_load_paths)
    print(f"run_dir={paths.run_dir} ({where}; run_name from {why}{unused})", flush=True)
    return paths, checked


def _train(cfg, paths, checked, config_text: str) -> int:
    from trainer.checkpoint.fence import SaveFence
    from trainer.hostmem import hugepages_requested
    from trainer.observe.events import EventLog
    from trainer.run import run
    from trainer.runtime import outcome as ended
    from trainer.runtime.preemption import Preempted, StopSignal

    log = logging.getLogger("trainer.train")
    exit_process = ReleaseThenExit()  # the watchdogs' exits (stop deadline, hang) release the lease first
    stop = StopSignal(cfg.train.stop_timeout_seconds, exit_process=exit_process)
    stop.install()
    run_dir = paths.local
    try:  # before the first write: two jobs must never train one run directory
        lease, taken = _take_lease(cfg, paths)
    except Exception as e:  # held by another job (2), the store unreachable (75)
        stop.finished()
        return _ended_before_training(e)
    exit_process.lease = lease
    run_dir.mkdir(parents=True, exist_ok=True)
    paths.pull()
    (run_dir / "config.yml").write_text(config_text)
    events = EventLog(run_dir / "events.jsonl")
    events.emit(
        catalogue.START,
        run_name=paths.local.name if paths.remote is None else paths.remote.name,
        model=cfg.model.model,
        steps=cfg.train.steps,
        resume_step=checked.resume_step,
        argv=sys.argv[1:],
        host_hugepages=hugepages_requested(),
    )
    upload = _live_upload(paths, events)
    if taken is not None:
        events.emit(catalogue.LEASE_ACQUIRED, **taken)
    for given in checked.unused_load_paths:
        key, _, value = given.partition("=")
        events.emit(catalogue.LOAD_PATH_UNUSED, key=key, path=value, resume_step=checked.resume_step)
    if lease is not None:
        stop.add_check(lambda: _check_lease(lease))
        lease.start_heartbeat(on_lost=lambda: log.error("the run's lease was taken over by another job"))
    watchdog = _start_watchdog(
        cfg,
        events,
        lambda hang: _exit_hung(hang, events=events, stop=stop, paths=paths, exit_process=exit_process),
        _exit_frozen,
    )
    try:
        outcome = run(cfg, paths=paths, events=events, stop_requested=stop, fence=SaveFence(lease), stop=stop)
        if isinstance(outcome, ended.Preempted):
            saved = (
                "checkpoint saved; rerun the same command to resume"
                if cfg.checkpoint.enable_checkpointing
                else "no checkpoint saved (enable_checkpointing=false): a rerun starts over"
            )
            code, status, line = EXIT_PREEMPTED, "preempted", f"preempted step={outcome.step}: {saved}"
        elif isinstance(outcome, ended.TargetReached):
            code, status = EXIT_OK, ended.TARGET_REACHED
            line = (
                f"{status} step={outcome.step} eval_loss={outcome.eval_loss:.4f} <= "
                f"target_eval_loss={cfg.eval.target_eval_loss} run_dir={paths.run_dir}"
            )
        else:
            trained = outcome.step - (checked.resume_step or 0)
            resumed = "" if trained else f" (resumed at step {outcome.step}: nothing left to train; raise steps=)"
            code, status = EXIT_OK, "finished"
            line = f"finished step={outcome.step} trained={trained}{resumed} run_dir={paths.run_dir}"
        fields = {"step": outcome.step}
    except Preempted as e:
        log.warning("stopped by SIGTERM during %s; rerun the same command to resume", e.phase)
        code, status = EXIT_PREEMPTED, "preempted"
        line, fields = f"preempted during {e.phase}: rerun the same command to resume", {"phase": e.phase}
    except Exception as e:  # every failure ends with the contract's code for its cause (trainer.errors)
        code, status, line, fields = _failure(e, log)
    if watchdog is not None:
        watchdog.stop()
    _emit_goodput(events, run_dir)
    events.emit(catalogue.FINISH, status=status, exit_code=code, **fields)
    events.close()
    if upload is not None:
        upload.stop()
    paths.sync()
    if lease is not None:
        lease.release()
    stop.finished()
    _status(line)
    return code


def _live_upload(paths, events):
    """For a run directory on a bucket: its files sent every LIVE_SYNC_SECONDS and after each committed
    checkpoint (trainer.observe.live_upload); None for a local run."""
    from trainer.observe.live_upload import LiveUpload

    if paths.remote is None:
        return None
    upload = LiveUpload(paths.sync).start()
    events.subscribe(upload.on_event)
    return upload


def _start_watchdog(cfg, events, on_hang, on_frozen):
    """The progress watchdog (trainer.runtime.watchdog), unless hang_timeout_seconds=0. With several
    processes it also fences a process frozen for longer than its peers take to declare it dead (the
    checkpoint barriers' bound, 3 heartbeat timeouts + 5 s): it then writes nothing and exits 75."""
    from trainer.config import ConfigError
    from trainer.distributed import resolve_settings
    from trainer.runtime import watchdog

    t = cfg.train
    if t.hang_timeout_seconds == 0:
        return None
    try:
        settings = resolve_settings(cfg.distributed)
        freeze = 3.0 * settings.heartbeat_timeout_seconds + 5.0 if settings.multi_process else 0.0
    except ConfigError:
        freeze = 0.0  # reported, with exit code 2, when run() resolves the settings again
    w = watchdog.ProgressWatchdog(
        watchdog.HangTimeouts(t.hang_timeout_seconds, t.hang_timeout_phase_seconds),
        on_hang,
        freeze_bound_s=freeze,
        on_frozen=on_frozen,
    )
    watchdog.install(w)
    events.writable = lambda: not watchdog.fenced()
    return w.start()


class ReleaseThenExit:
    """How a watchdog thread ends the process (the stop deadline, a hang): release the run's lease (after
    the emergency save, bounded: the store may be what hangs), then `exit_process(code)`. A frozen process
    does not use it: it writes nothing, the lease included."""

    RELEASE_BOUND_S = 3.0

    def __init__(self, exit_process=os._exit):
        self.lease = None
        self.exit_process = exit_process

    def __call__(self, code: int) -> None:
        import threading

        if self.lease is not None:
            releasing = threading.Thread(target=self.lease.release, name="lease-release", daemon=True)
            releasing.start()
            releasing.join(timeout=self.RELEASE_BOUND_S)
        self.exit_process(code)


def _exit_now(code: int, status: str, exit_process) -> None:
    """End the process from the watchdog's thread: the `STATUS:` line, the logs flushed, then
    `exit_process(code)` (os._exit: nothing a stuck main thread could block)."""
    _status(status)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    sys.stderr.flush()
    exit_process(code)


def _exit_frozen(seconds: float, exit_process=os._exit) -> None:
    """This process was frozen and its peers went on without it: it writes nothing (its logs are fenced)
    and exits 75, so the launcher or scheduler brings it back as a replacement."""
    from trainer.errors import EXIT_TRANSIENT

    _exit_now(
        EXIT_TRANSIENT,
        f"transient: this process was frozen for {seconds:.0f} s and its peers went on without it; "
        "exiting without writing anything (restart me: I rejoin as a replacement)",
        exit_process,
    )


def _exit_hung(hang, *, events, stop, paths, exit_process=os._exit) -> None:
    """The watchdog saw no progress: put every thread's stack in the log (and a file in the run directory),
    write the newest host snapshot to the local tier (bounded by stop_timeout_seconds: a hung device may
    hang the copy too), record it, and exit 75 through `exit_process` (which releases the run's lease) so
    the scheduler restarts the same command."""
    import faulthandler
    import threading

    from trainer.errors import EXIT_TRANSIENT

    stacks = paths.local / "hangs" / f"{os.getpid()}-{int(time.time())}.txt"
    print(
        f"hang: no progress in phase {hang.phase} for {hang.seconds:.0f} s; every thread's stack:", file=sys.stderr
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    try:
        stacks.parent.mkdir(parents=True, exist_ok=True)
        with open(stacks, "w") as f:
            f.write(f"phase={hang.phase} step={hang.step} seconds={hang.seconds} timeout_s={hang.timeout_s}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
    except OSError as e:
        stacks = None
        print(f"hang: could not write the stacks to the run directory: {e}", file=sys.stderr)
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
        _emit_goodput(events, paths.local)
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
    _exit_now(EXIT_TRANSIENT, f"transient: {error}; rerun the same command to resume", exit_process)


def _failure(error: Exception, log) -> tuple[int, str, str, dict]:
    """(exit code, status, STATUS line, finish-event fields) of the error that ended the run."""
    from trainer.errors import exit_code_for

    code = exit_code_for(error)
    text = f"{type(error).__name__}: {error}"
    if code == EXIT_BAD_INPUT:
        status = _input_status(error)
        print(f"{status.replace('_', ' ')}: {error}", file=sys.stderr)
        return code, status, status, {"error": str(error)}
    if code == EXIT_GAVE_UP:
        log.error("elastic recovery gave up: %s", error)
        return code, "elastic_gave_up", f"elastic_gave_up: {error}", {"error": str(error)}
    if code == EXIT_TRANSIENT:
        log.exception("infrastructure failure; everything saved is intact: rerun the same command to resume")
        return code, "transient", f"transient: {text}", {"error": text}
    if code == EXIT_PREEMPTED:
        return code, "preempted", f"preempted: {error}", {"error": text}
    log.exception("training failed")
    return code, "failed", f"failed: {text}", {"error": text}


def _take_lease(cfg, paths):
    """(lease, event fields) for process 0 of the job; (None, None) for the others or when leases are off."""
    from trainer.checkpoint.lease import RunLease
    from trainer.config import ConfigError
    from trainer.distributed import resolve_settings

    if cfg.train.run_lease_stale_seconds <= 0:
        return None, None
    try:
        if resolve_settings(cfg.distributed).process_id != 0:
            return None, None
    except ConfigError:
        pass  # reported, with exit code 2, when run() resolves the settings again
    root = paths.remote if paths.remote is not None else paths.local
    if paths.remote is None:
        paths.local.mkdir(parents=True, exist_ok=True)
    lease = RunLease(root, stale_s=cfg.train.run_lease_stale_seconds)
    return lease, lease.acquire()


def _check_lease(lease) -> None:
    from trainer.checkpoint.lease import LeaseLost

    if lease.lost:
        raise LeaseLost(
            f"the run directory's lease was taken over by another job (a heartbeat older than "
            f"run_lease_stale_seconds={lease.stale_s:g}): this job stops; its saves no longer commit"
        )


def _process_paths(paths, cfg):
    """Several processes share the run directory and its checkpoints; process i > 0 writes its logs
    (metrics.jsonl, events.jsonl, config.yml) and its local checkpoint tier under `process_<i>/`."""
    import dataclasses

    from trainer.config import ConfigError
    from trainer.distributed import process_log_dir, resolve_settings

    try:
        settings = resolve_settings(cfg.distributed)
    except ConfigError:
        return paths  # reported, with exit code 2, when run() resolves the settings again
    local = process_log_dir(paths.local, settings)
    if local == paths.local:
        return paths
    remote = None if paths.remote is None else paths.remote / local.name
    # The local checkpoint tier is per process too: each writes only what its own devices hold.
    tier = None if paths.local_checkpoints is None else paths.local_checkpoints / local.name
    return dataclasses.replace(paths, local=local, remote=remote, local_checkpoints=tier)


def _emit_goodput(events, run_dir: Path) -> None:
    """One summary event and log line: where the wall time went (see trainer.observe.goodput)."""
    import time

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


if __name__ == "__main__":
    from trainer.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # once, before JAX allocates anything (see trainer/hostmem.py)
    sys.exit(main())
