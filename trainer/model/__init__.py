"""Qwen3 (dense and MoE) in Flax NNX behind a functional facade of plain param dicts.

init_params(cfg, rng)            -> params (nested dict of arrays, dtype weight_dtype; jittable, cfg static)
param_logical_axes(cfg)          -> same structure, tuples of logical axis names (no allocation)
abstract_params(cfg)             -> same structure, jax.ShapeDtypeStruct (no allocation)
forward(params, cfg, inputs, positions, segment_ids, *, shard=UNSHARDED)
                                 -> (hidden [B,T,D] in cfg.dtype, f32 aux loss)
logits_from_hidden(params, cfg, hidden)              -> float32 logits [..., vocab]
logits_pullback(params, cfg, hidden, d_logits)      -> (d params, d hidden) of logits_from_hidden
output_rows(params, cfg, ids)    -> [..., D] the projection's rows of vocabulary ids (one logit each)
count_params(cfg)                -> (total, active per token)
training_flops_per_token(cfg, seq_len) -> float
recompute_flops_per_token(cfg, seq_len) -> float
"""

from trainer.model.flops import count_params, recompute_flops_per_token, training_flops_per_token
from trainer.model.transformer import (
    Params,
    abstract_params,
    forward,
    init_params,
    logits_from_hidden,
    logits_pullback,
    output_rows,
    param_logical_axes,
)

__all__ = [
    "Params",
    "abstract_params",
    "count_params",
    "forward",
    "init_params",
    "logits_from_hidden",
    "logits_pullback",
    "output_rows",
    "param_logical_axes",
    "recompute_flops_per_token",
    "training_flops_per_token",
]
