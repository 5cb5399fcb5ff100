"""Packing documents into fixed-length rows of the batch contract (see trainer/data/batch.py).

A document of n tokens contributes n - 1 (input, target) pairs: inputs = doc[:-1], targets = doc[1:],
so a target never comes from another document. Documents are placed back to back with segment ids
1, 2, ... and positions restarting at 0; the rest of the row is padding (segment 0, loss mask 0).
"""

from __future__ import annotations

import numpy as np

from trainer.data.batch import BATCH_KEYS


def pairs(doc_ids: np.ndarray) -> int:
    """How many positions of a row a document fills."""
    return max(len(doc_ids) - 1, 0)


def pack_row(docs: list[tuple[np.ndarray, np.ndarray]], length: int) -> dict[str, np.ndarray]:
    """One row from (ids, mask) documents whose pairs fit in `length` together.

    mask[i] says whether token i is trained when it is a target, so loss_mask = mask[1:].
    """
    row = {k: np.zeros(length, np.int32) for k in BATCH_KEYS}
    start = 0
    for segment, (ids, mask) in enumerate(docs, start=1):
        n = pairs(ids)
        end = start + n
        if end > length:
            raise ValueError(f"documents need {end} positions, the row has {length}")
        row["inputs"][start:end] = ids[:-1]
        row["targets"][start:end] = ids[1:]
        row["loss_mask"][start:end] = mask[1:]
        row["positions"][start:end] = np.arange(n, dtype=np.int32)
        row["segment_ids"][start:end] = segment
        start = end
    return row


def empty_row(length: int) -> dict[str, np.ndarray]:
    """A row of padding only (a row stream that has run out of data)."""
    return pack_row([], length)
