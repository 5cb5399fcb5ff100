"""AdamW with warmup + cosine decay and global-norm clipping, built once from OptimConfig."""

from __future__ import annotations

from typing import Any

import jax
import optax

from trainer.config.schema import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, *, steps: int, lr_scale: float = 1.0) -> optax.Schedule:
    """Linear warmup from 0 to the peak, cosine decay to `final_fraction * peak`, then flat.

    The schedule spans learning_rate_schedule_steps, or the run's `steps` when that is -1. `lr_scale`
    multiplies the peak (replica-resize with the `scale` batch policy).
    """
    peak = cfg.learning_rate * lr_scale
    total = steps if cfg.learning_rate_schedule_steps == -1 else cfg.learning_rate_schedule_steps
    warmup = int(round(cfg.warmup_steps_fraction * total))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(total, warmup + 1),
        end_value=peak * cfg.cosine_learning_rate_final_fraction,
    )


def weight_decay_mask(logical_axes: Any) -> Any:
    """Decay matrices, not norm scales: a param is decayed unless its logical names include 'norm'."""
    return jax.tree.map(lambda names: "norm" not in names, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(
    cfg: OptimConfig, logical_axes: Any, *, schedule: optax.Schedule
) -> optax.GradientTransformation:
    """AdamW on `schedule` (from learning_rate_schedule; the caller reports the same rate)."""
    parts = []
    if cfg.gradient_clipping_threshold > 0:
        parts.append(optax.clip_by_global_norm(cfg.gradient_clipping_threshold))
    parts.append(
        optax.adamw(
            schedule,
            b1=cfg.adam_b1,
            b2=cfg.adam_b2,
            eps=cfg.adam_eps,
            weight_decay=cfg.adam_weight_decay,
            mask=weight_decay_mask(logical_axes),
        )
    )
    return optax.chain(*parts)
