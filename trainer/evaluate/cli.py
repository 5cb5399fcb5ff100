"""CLI: `python -m trainer.evaluate RUN_DIR_OR_CHECKPOINT --tasks T1,T2`: lm-eval tasks on a checkpoint.

    python -m trainer.evaluate runs/NAME --tasks hellaswag,arc_easy --batch-size 16 --output results.json
    python -m trainer.evaluate runs/NAME/checkpoints/100 --tasks my_task --include-path my_tasks/ --limit 50

RUN_DIR_OR_CHECKPOINT: a run directory (its newest committed checkpoint), a committed step directory
<run>/checkpoints/<step>, or an hf-to-trainer output. The model, tokenizer and sharding rules are the ones
the checkpoint records. EleutherAI's lm-evaluation-harness (the `eval` extra:
pip install 'elastic-trainer[eval]') builds the requests and computes the metrics; the model side is this
trainer's (trainer/evaluate/lm.py): log-likelihoods and greedy generation on the local devices' mesh,
params sharded by the run's logical_axis_rules, in batches of fixed shapes. Scores equal those of
lm-eval's Hugging Face backend on the checkpoint's `trainer.convert trainer-to-hf` export (float32, same
--max-length; tests/test_evaluate_interop.py). Prints lm-eval's results table; --output writes its JSON.

Exit codes: 0 done; 2 bad input, found before the model is read and printed as one line
`python -m trainer.evaluate: error: ...` naming the input and the fix (lm-eval not installed, a path
without a committed checkpoint, an unknown task, an --include-path that is not a directory, an existing
--output without --overwrite); 1 any other failure (with its traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys

from trainer.errors import EXIT_OK, tool_main

PROG = "python -m trainer.evaluate"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("path", metavar="RUN_DIR_OR_CHECKPOINT", help="run directory or committed checkpoint dir")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (globs allowed)")
    p.add_argument("--include-path", help="a directory of task YAML files (local tasks), searched first")
    p.add_argument("--batch-size", type=int, default=8, help="requests per device batch (default 8)")
    p.add_argument("--limit", type=float, help="at most N documents per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--output", help="write lm-eval's results JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--log-samples", action="store_true", help="put every request and its answer in --output")
    p.add_argument("--max-length", type=int, help="context tokens (default: the run's max_target_length)")
    p.add_argument("--max-gen-toks", type=int, default=256, help="tokens a generation may add (default 256)")
    p.add_argument(
        "--bootstrap-iters", type=int, default=0, help="resamples for standard errors (default 0: none)"
    )
    p.add_argument("--dtype", default="float32", help="activation dtype: float32 (default) or bfloat16")
    p.add_argument("--model", help="model preset or YAML, for a checkpoint that records no config")
    return p


def _limit(value: float | None) -> int | float | None:
    return None if value is None else value if value < 1 else int(value)


def _run(args) -> int:
    from trainer.evaluate import harness
    from trainer.evaluate.source import open_source

    tasks, output = _check_inputs(args)
    open_source(args.path, args.model)  # the path, its config and stored shapes, before lm-eval's imports
    harness.require_lm_eval()
    manager, tasks = harness.task_manager(tasks, args.include_path)
    from trainer.evaluate.lm import TrainerLM

    lm = TrainerLM(
        args.path,
        batch_size=args.batch_size,
        max_length=args.max_length,
        max_gen_toks=args.max_gen_toks,
        dtype=args.dtype,
        model=args.model,
    )
    results = harness.evaluate(
        lm,
        tasks,
        manager,
        num_fewshot=args.num_fewshot,
        limit=_limit(args.limit),
        log_samples=args.log_samples,
        bootstrap_iters=args.bootstrap_iters,
    )
    print(harness.table(results), flush=True)
    if output is not None:
        from trainer.io.staging import staged_file

        with staged_file(output, overwrite=args.overwrite) as tmp:
            tmp.write_text(harness.to_json(results) + "\n")
        print(f"wrote {output}")
    return EXIT_OK


def _check_inputs(args):
    """(task names, resolved --output or None): the arguments checked before anything is read."""
    from trainer.errors import UserInputError
    from trainer.evaluate.backend import DTYPES
    from trainer.hf.outputs import check_output

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserInputError("--tasks is empty: name at least one lm-eval task, e.g. --tasks arc_easy")
    if args.dtype not in DTYPES:
        raise UserInputError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--max-length", args.max_length, 2),
                               ("--max-gen-toks", args.max_gen_toks, 1)):  # fmt: skip
        if value is not None and value < least:
            raise UserInputError(f"{flag} {value} must be >= {least}")
    if args.output is None:
        return tasks, None
    return tasks, check_output(args.output, overwrite=args.overwrite, flag="--output", inputs=[args.path])


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s] %(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax", "lm_eval", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return tool_main(PROG, lambda: _run(args))
