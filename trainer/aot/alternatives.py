"""When a layout does not fit: which single knob makes it fit, and by how much, found by compiling.

Knob families, in the order tried (the ones that keep the training math first):
0. context (with ici_context_parallelism > 1): the other context_parallel_strategy, then a context
   axis twice as wide (taken from the fill axis), each compiled and reported on its own;
1. more fsdp: every chip of a slice on the fsdp axis (parameters, gradients and optimizer state
   sharded instead of replicated over data or tensor);
2. remat_policy=full: recompute each layer's activations in the backward pass;
3. micro-steps: per_device_batch_size / k with gradient_accumulation_steps x k (same global batch);
4. per_device_batch_size / k: a smaller global batch (changes the training math; last resort).
Within a family the smallest change is compiled first and the next only if it still does not fit.

A per_device_batch_size / k is offered only where it is a usable batch size: a whole number, or, when the
slice's chips are known, a fraction that still gives whole sequences over the slice's batch shards
(`trainer.program.batch_rows`; e.g. 0.5 with ici_context_parallelism=2). k is a power of two, so b / k is
exact; values are written as typed (`2`, `0.25`, never `2.0`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from trainer.config.schema import RunConfig
from trainer.errors import ConfigError
from trainer.parallel.mesh import resolve_ici
from trainer.program.batch_rows import per_device_text, rows_per_slice

FACTORS = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Knob:
    family: str
    overrides: tuple[str, ...]  # key=value, as on the command line


def context_knobs(cfg: RunConfig, chips_per_slice: int) -> list[Knob]:
    """Context-parallel alternatives of `cfg` (none without context parallelism): the other strategy,
    and the context axis doubled where a slice and the sequence allow it (max_target_length a multiple
    of 2 x the new axis; the axis set to -1 gives up the chips, or fsdp halves when none is -1)."""
    m, length = cfg.mesh, cfg.data.max_target_length
    n = m.ici_context_parallelism
    if n == 1:
        return []
    other = next(s for s in ("all_gather", "ring") if s != m.context_parallel_strategy)
    knobs = [Knob("context strategy", (f"context_parallel_strategy={other}",))]
    wider = 2 * n
    axes = (m.ici_data_parallelism, m.ici_fsdp_parallelism, m.ici_tensor_parallelism, m.ici_expert_parallelism)
    fills = -1 in axes
    if chips_per_slice % wider == 0 and length % (2 * wider) == 0:
        if fills:
            knobs.append(Knob("wider context", (f"ici_context_parallelism={wider}",)))
        elif m.ici_fsdp_parallelism % 2 == 0:
            knobs.append(
                Knob(
                    "wider context",
                    (f"ici_context_parallelism={wider}", f"ici_fsdp_parallelism={m.ici_fsdp_parallelism // 2}"),
                )
            )
    return knobs


def knob_families(cfg: RunConfig, chips_per_slice: int = 0) -> list[list[Knob]]:
    """The candidate changes for `cfg`, grouped by family, each family smallest change first; the
    context family (each knob its own family) only when `chips_per_slice` is given."""
    m, acc = cfg.mesh, cfg.optim.gradient_accumulation_steps
    families = [[k] for k in context_knobs(cfg, chips_per_slice)] if chips_per_slice else []
    if m.ici_data_parallelism != 1 or m.ici_tensor_parallelism != 1 or m.ici_expert_parallelism != 1:
        all_fsdp = (
            "ici_fsdp_parallelism=-1",
            "ici_data_parallelism=1",
            "ici_tensor_parallelism=1",
            "ici_expert_parallelism=1",
        )
        families.append([Knob("more fsdp", all_fsdp)])
    if cfg.model.remat_policy != "full":
        families.append([Knob("remat_policy", ("remat_policy=full",))])
    smaller = smaller_batches(cfg, chips_per_slice)
    if smaller:
        families.append(
            [
                Knob("micro-steps", (f"per_device_batch_size={text}", f"gradient_accumulation_steps={acc * k}"))
                for k, text in smaller
            ]
        )
        families.append([Knob("per_device_batch_size", (f"per_device_batch_size={text}",)) for k, text in smaller])
    return families


def smaller_batches(cfg: RunConfig, chips_per_slice: int = 0) -> list[tuple[int, str]]:
    """(k, per_device_batch_size / k as typed) for each factor k whose smaller batch size is usable: whole,
    or a fraction giving whole sequences over a slice's batch shards when `chips_per_slice` is known."""
    b = cfg.data.per_device_batch_size
    shards = 0
    if chips_per_slice:
        try:
            ici = resolve_ici(cfg.mesh, chips_per_slice)
            shards = ici.data * ici.fsdp * ici.expert
        except ConfigError:
            shards = 0  # the mesh does not fit the slice: only whole batch sizes are offered
    out = []
    for k in FACTORS:
        value = b / k  # exact: k is a power of two
        if not value.is_integer():
            if not shards:
                continue
            try:
                rows_per_slice(value, devices_per_slice=chips_per_slice, shards_per_slice=shards)
            except ConfigError:
                continue
        out.append((k, per_device_text(value)))
    return out


def search(
    cfg: RunConfig, try_knob: Callable[[Knob], object], *, stop_at_first: bool = True, chips_per_slice: int = 0
) -> list[tuple]:
    """[(knob, result)] for the knobs compiled; `try_knob` compiles one and returns a result with
    `.fits`. Stops at the first knob that fits unless `stop_at_first` is false (then every family is
    tried, each up to its first fitting change)."""
    tried = []
    for family in knob_families(cfg, chips_per_slice):
        for knob in family:
            result = try_knob(knob)
            tried.append((knob, result))
            if result.fits:
                break
        if stop_at_first and tried and tried[-1][1].fits:
            break
    return tried
