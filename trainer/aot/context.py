"""The context split of a compiled layout: how the sequence is cut over the `context` mesh axis.

Pure functions of the config and the layout's batch, reported by `trainer.compile` next to memory and
collectives. Under context parallelism every chip holds 1/N of each of its sequences, but the batch
(per_device_batch_size x every chip, context axis included) is sharded over the other axes only, so a
chip holds N times as many sequences: its tokens per micro-step stay per_device_batch_size x
max_target_length whatever N is. `tokens_per_chip` makes that visible. per_device_batch_size=1/N (a
fraction, `trainer.program.batch_rows`) puts one sequence on each context group: a chip then holds
`sequence_tokens_per_chip` = max_target_length / N tokens of one sequence (`sequences_per_chip` 1).
"""

from __future__ import annotations

from trainer.model import attention

STRATEGIES = ("all_gather", "ring")
# What computes the scores under the ring strategy: its own blockwise online softmax
# (trainer/model/context_attention.py), whatever `attention` resolves to.
RING_KERNEL = "ring online-softmax tiles"


def kernel_under_context(cfg, *, backend: str) -> str:
    """The attention computation that runs with the sequence split (`cfg`: the run config or a TrainSpec,
    its model, data and mesh sections): all_gather runs the `attention`
    kernel as resolved for `backend` under context parallelism (autoselected: flash, since splash and
    cudnn_flash do not run on a split sequence); ring runs its own online-softmax tiles."""
    if cfg.mesh.context_parallel_strategy == "ring":
        return RING_KERNEL
    m = cfg.model
    return attention.resolve(
        m.attention,
        backend=backend,
        seq_len=cfg.data.max_target_length,
        head_dim=m.head_dim,
        dtype=m.dtype,
        context=cfg.mesh.ici_context_parallelism,
    )


def context_split(cfg, *, chips: int, global_batch_size: int, micro_steps: int, backend: str) -> dict:
    """{axis, strategy, kernel, sequence_tokens_per_chip, sequences_per_chip, tokens_per_chip} of one
    layout (per micro-step); {} without context parallelism. sequences_per_chip (the sequences a chip
    holds a 1/N cut of) may be a fraction with tensor parallelism; tokens_per_chip is an int when whole."""
    n = cfg.mesh.ici_context_parallelism
    if n == 1:
        return {}
    length = cfg.data.max_target_length
    rows = global_batch_size // micro_steps
    return {
        "axis": n,
        "strategy": cfg.mesh.context_parallel_strategy,
        "kernel": kernel_under_context(cfg, backend=backend),
        "sequence_tokens_per_chip": length // n,
        "sequences_per_chip": rows * n / chips,
        "tokens_per_chip": _whole(rows * length, chips),
    }


def _whole(numerator: int, denominator: int) -> int | float:
    return numerator // denominator if numerator % denominator == 0 else numerator / denominator


def pick(candidates: list[dict]) -> dict | None:
    """The candidate ({overrides, total_bytes, fits}) that fits with the least memory per chip, or None."""
    fitting = [c for c in candidates if c["fits"]]
    return min(fitting, key=lambda c: c["total_bytes"]) if fitting else None
