"""Log-likelihoods of continuations, batched: the model's own forward, scored on the device.

`Scorer.score([(context, continuation), ...])` returns, per request, the summed log-probability of the
continuation tokens and whether each of them is the model's argmax (lm-eval's `is_greedy`), as
lm-eval's Hugging Face backend computes them (batching.py: the same truncation, inputs and targets).
Requests run longest first in batches of fixed shapes; the device reduces each row to its two numbers,
so only [rows] floats and flags come back, never [rows, length, vocab] logits. The vocabulary
projection runs over LOGITS_CHUNK positions at a time, which bounds the float32 logits held at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from trainer.evaluate.batching import ScoreBatch, by_length, score_batch, score_row

LOGITS_CHUNK = 256  # positions whose [rows, chunk, vocab] float32 logits exist at once


def row_scores(params, cfg, batch: dict, *, shard):
    """(float32 [rows] sum of the scored targets' log-probs, bool [rows] every scored target is the argmax)
    for int32 [rows, length] tokens / segment_ids / targets and bool `scored` (jittable, cfg static)."""
    from trainer.model import forward, logits_from_hidden

    tokens = batch["tokens"]
    rows, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    hidden, _ = forward(params, cfg, tokens, positions, batch["segment_ids"], shard=shard)
    chunk = min(length, LOGITS_CHUNK)  # both powers of two: it divides the length

    def per_chunk(xs):
        h, targets, scored = xs  # [rows, chunk, ...]
        logits = logits_from_hidden(params, cfg, h)
        logp = jax.nn.log_softmax(logits, axis=-1)
        target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        greedy = jnp.argmax(logits, axis=-1) == targets
        return jnp.sum(jnp.where(scored, target_logp, 0.0), -1), jnp.all(greedy | ~scored, -1)

    def split(x):  # [rows, length, ...] -> [length / chunk, rows, chunk, ...]
        return jnp.moveaxis(x.reshape(rows, length // chunk, chunk, *x.shape[2:]), 1, 0)

    sums, greedy = jax.lax.map(per_chunk, (split(hidden), split(batch["targets"]), split(batch["scored"])))
    return jnp.sum(sums, 0), jnp.all(greedy, 0)


class Scorer:
    """Scores (context, continuation) token pairs with `params` (on `mesh`, sharded by `rules`)."""

    def __init__(self, params, cfg, *, mesh, rules, rows: int, max_length: int):
        from trainer.evaluate.placement import rows_sharding
        from trainer.parallel.activations import ActivationSharding

        self.params, self.rows, self.max_length = params, rows, max_length
        self._sharding = functools.partial(rows_sharding, mesh, rules, ("activation_batch", None))
        shard = ActivationSharding(mesh, rules)
        self._run = jax.jit(functools.partial(row_scores, cfg=cfg, shard=shard))

    def score(self, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each (context tokens, continuation tokens), in request order."""
        rows = [score_row(ctx, cont, self.max_length) for ctx, cont in requests]
        order = by_length([ctx + cont for ctx, cont in requests])
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.rows):
            picked = order[start : start + self.rows]
            sums, greedy = self._score_batch(score_batch([rows[i] for i in picked], self.rows))
            for k, i in enumerate(picked):
                out[i] = (float(sums[k]), bool(greedy[k]))
        return out

    def _score_batch(self, batch: ScoreBatch) -> tuple[np.ndarray, np.ndarray]:
        placed = {
            name: jax.device_put(value, self._sharding(value.shape))
            for name, value in vars(batch).items()  # tokens, segment_ids, targets, scored
        }
        sums, greedy = self._run(self.params, batch=placed)
        return np.asarray(sums), np.asarray(greedy)
