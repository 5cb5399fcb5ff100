"""CLI: `python -m trainer.train [CONFIG] [key=value ...] [--print-config]`.

CONFIG is a path, or a name inside configs/ (default base.yml). Exit codes: 0 finished (or preempted
after a final save), 2 bad config or data (before any compute), 3 elastic retries exhausted or
timed out, 1 any other failure. The last line printed is one `STATUS:` line saying how it ended.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_ELASTIC = 0, 1, 2, 3
_EPILOG = """Config layers, each later one winning: configs/base.yml (every key, its default and a one-line
description), the model preset configs/models/<model>.yml, CONFIG when it is not base.yml, then
key=value arguments (flags and key=value may come in any order). --print-config shows the result and
which layer set each value.

The run directory is <base_output_directory>/<run_name>; with no run_name it is named after the job
($JOBSET_NAME, $SLURM_JOB_NAME-$SLURM_JOB_ID), else <model>-<data>, so the same command resumes the
same run.

Exit codes: 0 finished (or preempted by SIGTERM after a final save); 2 bad config, data or input
path (before any compute); 3 elastic recovery gave up; 1 any other failure. The last line is
always 'STATUS: ...'."""


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


class _StopFlag:
    """Set by SIGTERM (a preemption notice): the loop finishes the step, saves and exits 0."""

    def __init__(self):
        self._event = threading.Event()

    def install(self) -> None:
        def handler(signum, frame):
            logging.getLogger(__name__).warning("SIGTERM received: finishing the current step and saving")
            self._event.set()

        signal.signal(signal.SIGTERM, handler)

    def __call__(self, step: int | None = None) -> bool:
        return self._event.is_set()


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    _setup_logging()
    from trainer.config.loader import load_explained
    from trainer.errors import UserInputError

    try:
        cfg, config_text = load_explained(args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(config_text)
            return EXIT_OK
        paths, preflight = _prepare(cfg)
    except UserInputError as e:
        status = _input_status(e)
        print(f"{status.replace('_', ' ')}: {e}", file=sys.stderr)
        _status(status)
        return EXIT_BAD_INPUT
    return _train(cfg, paths, preflight, config_text)


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
    print(f"run_dir={paths.run_dir} ({where}; run_name from {why})", flush=True)
    return paths, checked


def _train(cfg, paths, checked, config_text: str) -> int:
    from trainer.elastic.errors import ElasticGiveUp
    from trainer.errors import UserInputError
    from trainer.hostmem import hugepages_requested
    from trainer.loop import PREEMPTED, TARGET_REACHED
    from trainer.observe.events import EventLog
    from trainer.run import run

    log = logging.getLogger("trainer.train")
    run_dir = paths.local
    run_dir.mkdir(parents=True, exist_ok=True)
    paths.pull()
    (run_dir / "config.yml").write_text(config_text)
    events = EventLog(run_dir / "events.jsonl")
    events.emit(
        "start",
        run_name=paths.local.name if paths.remote is None else paths.remote.name,
        model=cfg.model.model,
        steps=cfg.train.steps,
        resume_step=checked.resume_step,
        argv=sys.argv[1:],
        host_hugepages=hugepages_requested(),
    )
    stop = _StopFlag()
    stop.install()
    try:
        outcome = run(cfg, paths=paths, events=events, stop_requested=stop)
        if outcome.kind == PREEMPTED:
            saved = (
                "checkpoint saved; rerun the same command to resume"
                if cfg.checkpoint.enable_checkpointing
                else "no checkpoint saved (enable_checkpointing=false): a rerun starts over"
            )
            code, status, line = EXIT_OK, "preempted", f"preempted step={outcome.step}: {saved}"
        elif outcome.kind == TARGET_REACHED:
            code, status = EXIT_OK, TARGET_REACHED
            line = (
                f"{status} step={outcome.step} eval_loss={outcome.eval_loss:.4f} <= "
                f"target_eval_loss={cfg.eval.target_eval_loss} run_dir={paths.run_dir}"
            )
        else:
            code, status, line = EXIT_OK, "finished", f"finished step={outcome.step} run_dir={paths.run_dir}"
        fields = {"step": outcome.step}
    except UserInputError as e:
        status = _input_status(e)
        print(f"{status.replace('_', ' ')}: {e}", file=sys.stderr)
        code, line, fields = EXIT_BAD_INPUT, status, {"error": str(e)}
    except ElasticGiveUp as e:
        log.error("elastic recovery gave up: %s", e)
        code, status, line, fields = EXIT_ELASTIC, "elastic_gave_up", f"elastic_gave_up: {e}", {"error": str(e)}
    except Exception as e:  # every other failure: logged with its traceback, reported, non-zero
        log.exception("training failed")
        code, status = EXIT_FAILED, "failed"
        line, fields = f"failed: {type(e).__name__}: {e}", {"error": f"{type(e).__name__}: {e}"}
    _emit_goodput(events, run_dir)
    events.emit("finish", status=status, **fields)
    events.close()
    paths.sync()
    _status(line)
    return code


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
        "goodput",
        goodput=None if summary["goodput"] is None else round(summary["goodput"], 4),
        wall_s=round(summary["wall_s"], 3),
        productive_s=round(summary["productive_s"], 3),
        badput_s=summary["badput_s"],
    )


if __name__ == "__main__":
    from trainer.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # once, before JAX allocates anything (see trainer/hostmem.py)
    sys.exit(main())
