"""Held-out evaluation during training: when to evaluate, and one evaluation's metrics.jsonl row.

The eval set is the same tokens in the same order at every evaluation, on any mesh, after any recovery or
restart: the eval iterator is rewound to its first state before each evaluation (its position is never
checkpointed), and the eval batch has a fixed global size (`eval_per_device_batch_size`, possibly a
fraction, times every device of every configured slice: whole sequences, `trainer.program.batch_rows`),
which a smaller mesh runs in more micro-steps. Losses are token sums added in a fixed order and divided
once, so a clean run and one that recovered on the same mesh evaluate bitwise alike.

Which steps evaluate (`EvalSchedule`): every `eval_interval` steps from `eval_start_step`, and the last
step. An evaluation belongs to the attempt that trains its step, right after that step: a recovery that
restores a step does not evaluate it again, and one that goes back before it trains it again and so
evaluates it again (readers keep the newest row of a step, as for step rows).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from trainer.observe.records import EVAL_KIND

log = logging.getLogger(__name__)
IN_FLIGHT = 2  # eval batches dispatched ahead of the oldest unfinished one


@dataclasses.dataclass(frozen=True)
class EvalSchedule:
    interval: int  # -1: off
    start_step: int
    last_step: int

    def due(self, step: int) -> bool:
        if self.interval < 1:
            return False
        return step == self.last_step or (step >= self.start_step and step % self.interval == 0)


class Evaluator:
    """Runs the compiled eval step over the held-out set and returns the eval row of metrics.jsonl.

    `iterator` is built once per attempt (bad data fails before compiling); its first state is kept and
    restored before each evaluation. `batches` is eval_steps (-1: until the iterator ends).
    """

    def __init__(
        self,
        *,
        eval_fn: Callable,
        iterator,
        device_batch: Callable[[dict], dict],
        schedule: EvalSchedule,
        batches: int,
        target_loss: float = 0.0,
        timer: Callable[[], float] = time.perf_counter,
    ):
        self.eval_fn = eval_fn
        self.iterator = iterator
        self.device_batch = device_batch
        self.schedule = schedule
        self.batches = batches
        self.target_loss = target_loss
        self.timer = timer
        self.start_state = iterator.get_state()

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    def reached_target(self, row: dict[str, Any]) -> bool:
        loss = row["eval_loss"]
        return self.target_loss > 0 and loss is not None and loss <= self.target_loss

    def __call__(
        self, step: int, params, *, interrupt: Callable[[], bool] = lambda: False
    ) -> dict[str, Any] | None:
        """Evaluate `params` (the state after `step`); blocks until the sums are on the host. None when
        `interrupt()` turned true between batches (a stop request): no row for a partial evaluation."""
        t0 = self.timer()
        self.iterator.set_state(self.start_state)
        sums = []
        while self.batches < 0 or len(sums) < self.batches:
            if interrupt():
                jax.block_until_ready(sums)
                return None
            try:
                host_batch = next(self.iterator)
            except StopIteration:
                break
            sums.append(self.eval_fn(params, self.device_batch(host_batch)))  # dispatched; read below
            if len(sums) > IN_FLIGHT:  # bounds the device batches alive at once on a long eval set
                jax.block_until_ready(sums[-1 - IN_FLIGHT])
        sums = jax.device_get(sums)
        ce = math.fsum(float(s["ce_sum"]) for s in sums)  # in batch order: the same sum every time
        tokens = int(sum(float(s["tokens"]) for s in sums))
        seconds = self.timer() - t0
        if tokens == 0:
            log.warning("eval at step %d: the eval set gave no loss tokens; eval_loss is null", step)
        loss = ce / tokens if tokens else None
        preference = {}
        if sums and "pairs" in sums[0]:  # objective=dpo: the loss and TRL's metrics are means over pairs
            pairs = math.fsum(float(s["pairs"]) for s in sums)
            loss = ce / pairs if pairs else None
            names = [k for k in sums[0] if "/" in k]
            preference = {
                f"eval_{k}": math.fsum(float(s[k]) for s in sums) / pairs if pairs else None for k in names
            }
            preference["eval_pairs"] = int(pairs)
        return {
            "kind": EVAL_KIND,
            "step": step,
            "eval_loss": loss,
            "eval_perplexity": None if loss is None or preference else _perplexity(loss),
            "eval_tokens": tokens,
            "eval_batches": len(sums),
            "eval_time_s": seconds,
            "pid": os.getpid(),
            "time": time.time(),
            **preference,
        }


def _perplexity(loss: float) -> float | None:
    try:
        return math.exp(loss)
    except OverflowError:
        return None
