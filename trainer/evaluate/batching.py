"""Requests laid out in a fixed set of array shapes, so one compiled program serves many batches.

Every batch has the same number of rows (`batch_rows`: the batch size rounded up to a multiple of the
mesh's batch shards; rows past the requests are padding) and a length from `length_bucket`: the next
power of two from MIN_LENGTH on. A run of lm-eval therefore compiles the scorer at most once per bucket
(log2 of the longest request) instead of once per request length.

Scoring rows follow lm-eval's Hugging Face backend exactly: the context and continuation tokens, cut from
the left to the model's `max_length + 1` tokens, give the inputs (all but the last token) and the targets
(all but the first); the last len(continuation) targets are scored. Rows are right-padded: padding has
segment id 0, so no real token attends to it, and it is never scored.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MIN_LENGTH = 16


def length_bucket(n: int) -> int:
    """The array length for a row of `n` tokens: the next power of two, at least MIN_LENGTH."""
    if n < 1:
        raise ValueError(f"a row needs at least one token, got {n}")
    return max(MIN_LENGTH, 1 << (n - 1).bit_length())


def batch_rows(batch_size: int, shards: int) -> int:
    """Rows of every batch: `batch_size` rounded up to a multiple of the mesh's batch shards."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return -(-batch_size // shards) * shards


def by_length(token_lists: list[list[int]]) -> list[int]:
    """Indices of the rows, longest first (ties by the tokens), as lm-eval's Hugging Face backend orders
    its requests: each batch's first row sets its length, and a too-long request fails first."""
    return sorted(range(len(token_lists)), key=lambda i: (-len(token_lists[i]), tuple(token_lists[i])))


@dataclasses.dataclass(frozen=True)
class ScoreBatch:
    """int32 [rows, length] arrays of one scoring batch; `scored` marks the targets whose log-probs count."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    targets: np.ndarray
    scored: np.ndarray  # bool


def score_row(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], list[int], int]:
    """(inputs, targets, scored count) of one request, as lm-eval's Hugging Face backend builds it: the
    whole sequence cut from the left to max_length + 1 tokens, shifted by one."""
    if not context or not continuation:
        raise ValueError("a request needs a non-empty context and continuation (lm-eval gives both)")
    if len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens is longer than max_length {max_length}")
    whole = (context + continuation)[-(max_length + 1) :]
    return whole[:-1], whole[1:], len(continuation)


def score_batch(rows: list[tuple[list[int], list[int], int]], n_rows: int) -> ScoreBatch:
    """One batch of `n_rows` rows from score_row outputs (at most n_rows of them), right-padded to the
    length bucket of the longest."""
    if not 0 < len(rows) <= n_rows:
        raise ValueError(f"a batch holds 1..{n_rows} rows, got {len(rows)}")
    length = length_bucket(max(len(inputs) for inputs, _, _ in rows))
    shape = (n_rows, length)
    tokens, segments, targets = (np.zeros(shape, np.int32) for _ in range(3))
    scored = np.zeros(shape, bool)
    for r, (inputs, row_targets, n_scored) in enumerate(rows):
        n = len(inputs)
        tokens[r, :n], targets[r, :n], segments[r, :n] = inputs, row_targets, 1
        scored[r, n - n_scored : n] = True
    return ScoreBatch(tokens, segments, targets, scored)
