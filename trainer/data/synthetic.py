"""A deterministic, learnable synthetic token stream with real packing structure.

Tokens follow a fixed random Markov chain over a small active vocabulary: each token has
BRANCHING likely successors, so a model can drive the loss from ln(vocab) toward ln(BRANCHING).
Each row packs several documents of random length (segment ids, per-document positions and padding
are exercised exactly as with real data). Row `r` of global step `s` is a pure function of
(seed, s, r): any number of loader processes, any resume point, the same global batches.
"""

from __future__ import annotations

import numpy as np

from trainer.data.batch import BATCH_KEYS

ACTIVE_VOCAB = 512
BRANCHING = 4


class SyntheticIterator:
    """This process's rows of each global batch; state is the next global step (process-count free)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        stream: int = 0,
    ):
        """`stream` 0 is the training stream; another value is a held-out stream of the same chain whose
        rows are drawn from other seeds (see `_row_seed`)."""
        if global_batch_size % process_count:
            raise ValueError(f"global batch {global_batch_size} does not split over {process_count} processes")
        self.seq_len = seq_len
        self.seed = seed
        self.stream = stream
        self.global_batch_size = global_batch_size
        rows = global_batch_size // process_count
        self.row_range = range(process_index * rows, (process_index + 1) * rows)
        table_rng = np.random.default_rng([seed, 0x5EED])
        active = min(vocab_size, ACTIVE_VOCAB)
        self.vocab = table_rng.choice(vocab_size, size=active, replace=False).astype(np.int32)
        self.successors = table_rng.integers(0, active, size=(active, BRANCHING))
        self.next_step = 0

    def _row_seed(self, step: int, row: int) -> list[int]:
        # numpy's SeedSequence pads short entropy with zeros, so [seed, step, row] is [seed, step, row, 0]:
        # a non-zero fourth word never produces a training row's generator.
        return [self.seed, step, row] if self.stream == 0 else [self.seed, step, row, self.stream]

    def _row(self, step: int, row: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self._row_seed(step, row))
        n = self.seq_len + 1
        choice = rng.integers(0, BRANCHING, size=n)
        state = np.empty(n, dtype=np.int64)
        state[0] = rng.integers(0, len(self.vocab))
        for t in range(1, n):
            state[t] = self.successors[state[t - 1], choice[t]]
        tokens = self.vocab[state]
        # Documents of random length packed back to back; the tail after the last one is padding.
        segment = np.zeros(self.seq_len, np.int32)
        positions = np.zeros(self.seq_len, np.int32)
        start, doc = 0, 1
        while start < self.seq_len - 1:
            length = int(rng.integers(max(2, self.seq_len // 4), self.seq_len + 1))
            end = min(start + length, self.seq_len)
            if end - start < 2 and doc > 1:
                break
            segment[start:end] = doc
            positions[start:end] = np.arange(end - start)
            start, doc = end, doc + 1
        inputs = tokens[:-1].copy()
        targets = tokens[1:].copy()
        # A target must be in the same document as its input: the last token of each document has none.
        same_doc = np.append(segment[1:] == segment[:-1], False) & (segment > 0)
        inputs[segment == 0] = 0
        targets[~same_doc] = 0
        return {
            "inputs": inputs,
            "targets": targets,
            "positions": positions,
            "segment_ids": segment,
            "loss_mask": same_doc.astype(np.int32),
        }

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        rows = [self._row(step, r) for r in self.row_range]
        return {k: np.stack([r[k] for r in rows]).astype(np.int32) for k in BATCH_KEYS}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.next_step)
        self.next_step += 1
        return batch

    def get_state(self) -> dict:
        return {"kind": "synthetic", "next_step": self.next_step}

    def set_state(self, state: dict) -> None:
        self.next_step = int(state["next_step"])

    def close(self) -> None:
        pass
