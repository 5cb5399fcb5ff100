"""When a layout does not fit: which single knob makes it fit, and by how much, found by compiling.

Knob families, in the order tried (the ones that keep the training math first):
1. more fsdp: every chip of a slice on the fsdp axis (parameters, gradients and optimizer state
   sharded instead of replicated over data or tensor);
2. remat_policy=full: recompute each layer's activations in the backward pass;
3. micro-steps: per_device_batch_size / k with gradient_accumulation_steps x k (same global batch);
4. per_device_batch_size / k: a smaller global batch (changes the training math; last resort).
Within a family the smallest change is compiled first and the next only if it still does not fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from trainer.config.schema import RunConfig

FACTORS = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Knob:
    family: str
    overrides: tuple[str, ...]  # key=value, as on the command line


def knob_families(cfg: RunConfig) -> list[list[Knob]]:
    """The candidate changes for `cfg`, grouped by family, each family smallest change first."""
    m, b, acc = cfg.mesh, cfg.data.per_device_batch_size, cfg.optim.gradient_accumulation_steps
    families = []
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
    divisors = [k for k in FACTORS if b % k == 0]
    if divisors:
        families.append(
            [
                Knob("micro-steps", (f"per_device_batch_size={b // k}", f"gradient_accumulation_steps={acc * k}"))
                for k in divisors
            ]
        )
        families.append([Knob("per_device_batch_size", (f"per_device_batch_size={b // k}",)) for k in divisors])
    return families


def search(cfg: RunConfig, try_knob: Callable[[Knob], object], *, stop_at_first: bool = True) -> list[tuple]:
    """[(knob, result)] for the knobs compiled; `try_knob` compiles one and returns a result with
    `.fits`. Stops at the first knob that fits unless `stop_at_first` is false (then every family is
    tried, each up to its first fitting change)."""
    tried = []
    for family in knob_families(cfg):
        for knob in family:
            result = try_knob(knob)
            tried.append((knob, result))
            if result.fits:
                break
        if stop_at_first and tried and tried[-1][1].fits:
            break
    return tried
