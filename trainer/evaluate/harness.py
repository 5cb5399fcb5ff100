"""lm-eval's side of an evaluation: the package present, the tasks found, run, and the results written.

Every input problem is a UserInputError naming the input and the fix: lm-eval not installed (the `eval`
extra), an --include-path that is not a directory, a task name no task directory defines. Tasks are
looked up in --include-path alone first, and among lm-eval's own bundled tasks (thousands of files to
index) only when a name is not there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from trainer.errors import UserInputError

log = logging.getLogger(__name__)

INSTALL = "pip install 'elastic-trainer[eval]'"


def require_lm_eval() -> str:
    """lm-eval's version; a UserInputError saying how to install it when it is missing."""
    try:
        import lm_eval
    except ImportError as e:
        raise UserInputError(
            f"lm-eval (lm_eval) is not installed ({e}); install the eval extra: {INSTALL} "
            f"(from a checkout: pip install -e '.[eval]')"
        ) from None
    return lm_eval.__version__


def task_manager(tasks: list[str], include_path: str | None):
    """(an lm-eval TaskManager that knows every name in `tasks`, the task names): names may be globs, as on
    lm-eval's command line, and are expanded to the tasks they match."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise UserInputError(
            f"--include-path {include_path} is not a directory; give the directory that holds the task YAML files"
        )
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if _unknown(local, tasks) == []:
            return local, _expanded(local, tasks)
    manager = TaskManager(include_path=include_path)
    unknown = _unknown(manager, tasks)
    if unknown:
        where = f"in --include-path {include_path} nor " if include_path else ""
        raise UserInputError(
            f"--tasks: no task named {', '.join(unknown)} {where}among lm-eval's tasks; check the spelling "
            f"(`lm_eval ls tasks` lists them), or pass --include-path DIR with the task's YAML"
        )
    return manager, _expanded(manager, tasks)


def _unknown(manager, tasks: list[str]) -> list[str]:
    return [t for t in tasks if not manager.match_tasks([t])]


def _expanded(manager, tasks: list[str]) -> list[str]:
    """Each name, or the names its glob matches, in the order given, each once."""
    return list(dict.fromkeys(name for t in tasks for name in manager.match_tasks([t])))


def evaluate(
    lm, tasks: list[str], manager, *, num_fewshot, limit, log_samples: bool, bootstrap_iters: int
) -> dict:
    """lm-eval's results for `lm` on `tasks` (its JSON: results, configs, versions, n-shot, ...); standard
    errors from `bootstrap_iters` resamples (0: none, the scores only)."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
    )


def table(results: dict) -> str:
    """lm-eval's own results table (and the groups table when a task group ran)."""
    from lm_eval.utils import make_table

    return make_table(results) + (make_table(results, "groups") if "groups" in results else "")


def to_json(results: dict) -> str:
    """The results as lm-eval's command line writes them."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
