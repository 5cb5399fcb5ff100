"""The batch contract shared by every data source, the train step and the checkpointed data order.

A batch is a dict of int32 numpy arrays, all [rows, max_target_length]:
  inputs       token ids fed to the model
  targets      next-token ids to predict (inputs shifted by one within a document)
  positions    position of each token inside its document (RoPE positions; restart at 0 per document)
  segment_ids  document id of each token inside its row, >= 1; 0 marks padding. Attention never
               crosses segments, so packed documents never see each other.
  loss_mask    1 where the target counts in the loss (0 for padding and, in SFT, non-assistant tokens)
"""

from __future__ import annotations

import hashlib

import numpy as np

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def fingerprint(batch: dict[str, np.ndarray]) -> str:
    """A short hash of the global batch's token ids and mask, so data order can be audited and compared."""
    h = hashlib.sha256()
    for k in ("inputs", "targets", "loss_mask"):
        h.update(np.ascontiguousarray(batch[k], dtype=np.int32).tobytes())
    return h.hexdigest()[:16]


def check_batch(batch: dict[str, np.ndarray], rows: int, length: int) -> None:
    """Raise ValueError naming the key when a batch breaks the contract above."""
    for k in BATCH_KEYS:
        if k not in batch:
            raise ValueError(f"batch is missing {k!r} (has {sorted(batch)})")
        if batch[k].shape != (rows, length):
            raise ValueError(f"batch[{k!r}] has shape {batch[k].shape}, expected {(rows, length)}")
