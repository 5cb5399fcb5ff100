"""CLI: `python -m trainer.train [CONFIG] [key=value ...] [--print-config]`.

CONFIG is a path, or a name inside configs/ (default base.yml). Parse, prepare (the job's backend, the
run directory, the preflight of every input), run (`trainer.run` under the process root,
`trainer.process_root`), status. The exit code follows the contract in `trainer/errors.py` (0 finished,
1 failed, 2 bad input, 3 gave up, 42 preempted, 75 transient); the last line printed is one `STATUS:`
line saying how it ended.
"""

from __future__ import annotations

import argparse
import logging
import sys

from trainer.errors import EXIT_OK, EXIT_PREEMPTED

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


def _setup_logging(log_format: str) -> None:
    """The console for `log_format` (trainer.observe.console); third-party INFO chatter left out."""
    from trainer.observe import console

    console.setup(log_format)
    for noisy in ("absl", "jax._src", "orbax", "tensorstore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _log_format_given(overrides: list[str]) -> str:
    """The log_format=... of the command line, for the lines logged before the config is read (a value
    that is not a format waits for the config's own check)."""
    from trainer.observe.console import FORMATS

    given = [o.partition("=")[2] for o in overrides if o.startswith("log_format=")]
    return given[-1] if given and given[-1] in FORMATS else "text"


def main(argv=None) -> int:
    from trainer.backends import deterministic_gpu_ops

    args = _parse_args(sys.argv[1:] if argv is None else argv)
    _setup_logging(_log_format_given(args.overrides))
    deterministic_gpu_ops()  # bitwise replays on GPUs too; before anything starts a backend
    from trainer.config.loader import load_explained
    from trainer.distributed.internals import check_versions

    try:
        check_versions()  # a JAX or Orbax outside the window the internals were checked in: exit 2
        cfg, config_text = load_explained(args.config, args.overrides)
        _setup_logging(cfg.observe.log_format)
        if args.print_config:
            sys.stdout.write(config_text)
            return EXIT_OK
        root, checked = _prepare(cfg)
        root.open(config_text, model=cfg.model.model, checked=checked)  # held by another job: exit 2
    except Exception as e:  # bad input (2), the store unreachable (75), a bug (1): the contract's code
        return _ended_before_training(e)
    return _train(cfg, root, checked)


def _ended_before_training(error: Exception) -> int:
    """A start-up that failed before the run began: the error's code and STATUS line."""
    from trainer.process_root import ending_of_error, print_status

    ending = ending_of_error(error, logging.getLogger("trainer.train"))
    print_status(ending.line)
    return ending.code


def _prepare(cfg):
    """The job's backend (chosen once: a job that cannot be the one the config asks for stops here), the
    run's directory (named, and its bucket logs continued) and the preflight of every input; the process
    root that will hold them."""
    from trainer import preflight
    from trainer.observe import console
    from trainer.observe.rundir import resolve_run_name, run_paths
    from trainer.process_root import ProcessRoot
    from trainer.run import backend_for

    backend = backend_for(cfg)
    name, why = resolve_run_name(
        cfg.train.run_name,
        model=cfg.model.model,
        dataset_type=cfg.data.dataset_type,
        grain_train_files=cfg.data.grain_train_files,
    )
    paths = run_paths(
        cfg.train.base_output_directory, name, local_checkpoint_directory=cfg.checkpoint.local_checkpoint_directory
    )
    paths = backend.log_paths(paths)  # several processes: process i > 0 writes under process_<i>/
    checked = preflight.check(cfg, paths.checkpoints, local_checkpoints=paths.local_checkpoints)
    where = f"resuming from step {checked.resume_step}" if checked.resume_step is not None else "new run"
    console.identify(run_name=name, process_index=backend.process_id)
    unused = "".join(f"; {given} not used: the run resumes" for given in checked.unused_load_paths)
    line = f"run_dir={paths.run_dir} ({where}; run_name from {why}{unused})"
    if cfg.observe.log_format == "json":  # every line a JSON object
        logging.getLogger("trainer.train").info(
            "%s", line, extra={console.FIELDS: {"run_dir": str(paths.run_dir), "named_by": why, "start": where}}
        )
    else:
        print(line, flush=True)
    return ProcessRoot(cfg.train, paths, backend), checked


def _train(cfg, root, checked) -> int:
    from trainer.process.preemption import Preempted
    from trainer.process_root import ending_of_error, print_status
    from trainer.run import run

    with root:
        try:
            ending = _ending_of(run(cfg, root), cfg, root.paths, checked)
        except (Preempted, Exception) as e:  # every failure ends with the contract's code for its cause
            ending = ending_of_error(e, logging.getLogger("trainer.train"))
        root.close(ending)
    print_status(ending.line)
    return ending.code


def _ending_of(outcome, cfg, paths, checked):
    """The ending of a run that returned: preempted at a step boundary, the eval target reached, finished."""
    from trainer.attempt import outcome as ended
    from trainer.process_root import Ending

    fields = {"step": outcome.step}
    if isinstance(outcome, ended.Preempted):
        saved = (
            "checkpoint saved; rerun the same command to resume"
            if cfg.checkpoint.enable_checkpointing
            else "no checkpoint saved (enable_checkpointing=false): a rerun starts over"
        )
        return Ending(EXIT_PREEMPTED, "preempted", f"preempted step={outcome.step}: {saved}", fields)
    if isinstance(outcome, ended.TargetReached):
        line = (
            f"{ended.TARGET_REACHED} step={outcome.step} eval_loss={outcome.eval_loss:.4f} <= "
            f"target_eval_loss={cfg.eval.target_eval_loss} run_dir={paths.run_dir}"
        )
        return Ending(EXIT_OK, ended.TARGET_REACHED, line, fields)
    trained = outcome.step - (checked.resume_step or 0)
    resumed = "" if trained else f" (resumed at step {outcome.step}: nothing left to train; raise steps=)"
    line = f"finished step={outcome.step} trained={trained}{resumed} run_dir={paths.run_dir}"
    return Ending(EXIT_OK, "finished", line, fields)


if __name__ == "__main__":
    from trainer.hostmem import reexec_with_hugepages

    reexec_with_hugepages()  # once, before JAX allocates anything (see trainer/hostmem.py)
    sys.exit(main())
