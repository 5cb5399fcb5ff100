"""Greedy continuations of a batch of prompts of different lengths, on the KV cache of trainer.model.generation.

That cache holds one length for the whole batch (every row writes the same position), so prompts are not
padded: all rows advance one position per step, and a row still inside its prompt is fed its own next
prompt token (its prediction there is dropped) while a row past it is fed its last prediction. Every row
thus sees exactly its own tokens at positions 0, 1, 2, ..., as a batch of one would. The positions all
rows share (the shortest prompt) go in one prefill, in power-of-two chunks; every later position is one
`extend` of one token. Shapes come from a fixed set: rows is fixed, the cache length is a power of two
and a prefill chunk is a power of two, so a long evaluation compiles a handful of programs.

A row stops when `done(row tokens)` says so (its EOS, or a stop sequence in its text: stops.py) or after
`max_new` tokens; the batch stops when every row has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from trainer.evaluate.batching import length_bucket


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _extend_greedy(params, tokens, cache, *, cfg):
    """The argmax next token [rows] after `tokens` [rows, t], and the cache with their k/v written."""
    from trainer.model.generation import extend

    logits, cache = extend(params, cfg, tokens, cache)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def prefill_chunks(n: int) -> list[int]:
    """`n` as a sum of powers of two, largest first (the prefill's chunk lengths)."""
    return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


class Generator:
    """Greedy decoding of up to `rows` prompts at a time with `params` (cfg: the inference ModelConfig)."""

    def __init__(self, params, cfg, *, rows: int, cache_sharding: Callable | None = None):
        self.params, self.cfg, self.rows = params, cfg, rows
        self._cache_sharding = cache_sharding

    def generate(
        self, prompts: list[list[int]], max_new: int, done: Callable[[list[int]], bool]
    ) -> list[list[int]]:
        """New tokens of each prompt (at most `max_new`; up to and including the one that made `done` true)."""
        from trainer.model.generation import init_cache

        if not 0 < len(prompts) <= self.rows or min(map(len, prompts)) < 1 or max_new < 1:
            raise ValueError(f"need 1..{self.rows} non-empty prompts and max_new >= 1")
        lengths = [len(p) for p in prompts]
        table = np.zeros((self.rows, max(lengths) + max_new), np.int32)
        for r in range(self.rows):
            prompt = prompts[min(r, len(prompts) - 1)]  # padding rows repeat the last prompt
            table[r, : len(prompt)] = prompt
        cache = init_cache(self.cfg, self.rows, length_bucket(max(lengths) + max_new))
        if self._cache_sharding is not None:
            cache = jax.device_put(cache, self._cache_sharding(cache))
        start, filled = min(lengths), 0
        for chunk in prefill_chunks(start):
            pred, cache = self._step(table[:, filled : filled + chunk], cache)
            filled += chunk
        out: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        position = start  # the position `pred` is the token for
        while True:
            for r, prompt_len in enumerate(lengths):
                if position >= prompt_len and not finished[r]:
                    out[r].append(int(pred[r]))
                    table[r, position] = pred[r]
                    finished[r] = len(out[r]) >= max_new or done(out[r])
            if all(finished):
                return out
            pred, cache = self._step(table[:, position : position + 1], cache)
            position += 1

    def _step(self, tokens: np.ndarray, cache):
        pred, cache = _extend_greedy(self.params, jnp.asarray(tokens), cache, cfg=self.cfg)
        return np.asarray(pred), cache
