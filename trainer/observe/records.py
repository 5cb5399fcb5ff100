"""The two kinds of rows in metrics.jsonl: one per training step, and one per evaluation.

A step row has the per-step fields (`step`, `loss`, `step_time_s`, ...) and no `kind`. An eval row has
`"kind": "eval"`, the `step` it evaluated, `eval_loss`, `eval_perplexity`, `eval_tokens`,
`eval_batches`, `eval_time_s`, `pid` and `time`. Every reader that wants steps keeps `step_rows`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

EVAL_KIND = "eval"


def is_eval(record: dict[str, Any]) -> bool:
    return record.get("kind") == EVAL_KIND


def step_rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step rows, in file order (eval rows left out)."""
    return [r for r in records if not is_eval(r)]


def eval_rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval rows, in file order."""
    return [r for r in records if is_eval(r)]
