"""The model, whichever family the config names: functions of plain param dicts that ask the family.

Every function takes the ModelConfig and calls the decoder or FLOPs of its `model_family`
(`trainer/model/families.py`; a family is `trainer/model/<family>/`), so the runtime never names one.

init_params(cfg, rng)            -> params (nested dict of arrays, dtype weight_dtype; jittable, cfg static)
param_logical_axes(cfg)          -> same structure, tuples of logical axis names (no allocation)
abstract_params(cfg)             -> same structure, jax.ShapeDtypeStruct (no allocation)
forward(params, cfg, inputs, positions, segment_ids, *, shard=UNSHARDED, layers=None)
                                 -> (hidden [B,T,D] in cfg.dtype, f32 aux loss); `layers` transforms
                                    each block's params inside it (transformer.LayerAdapter)
logits_from_hidden(params, cfg, hidden)              -> float32 logits [..., vocab]
logits_pullback(params, cfg, hidden, d_logits)      -> (d params, d hidden) of logits_from_hidden
output_rows(params, cfg, ids)    -> [..., D] the projection's rows of vocabulary ids (one logit each)
count_params(cfg)                -> (total, active per token)
training_flops_per_token(cfg, seq_len) -> float
recompute_flops_per_token(cfg, seq_len) -> float
family_of(cfg)                   -> the ModelFamily itself (decoder, FLOPs, Hugging Face mapping, presets)

The contracts are those of the shared decoder (`transformer.py`) and its FLOPs (`flops.py`).
"""

from __future__ import annotations

import jax

from trainer.config.schema import ModelConfig
from trainer.model.families import FAMILIES, family_of
from trainer.model.family import ModelFamily, Params
from trainer.parallel.activations import UNSHARDED, ActivationSharding


def init_params(cfg: ModelConfig, rng: jax.Array) -> Params:
    return family_of(cfg).decoder.init_params(cfg, rng)


def abstract_params(cfg: ModelConfig) -> Params:
    return family_of(cfg).decoder.abstract_params(cfg)


def param_logical_axes(cfg: ModelConfig) -> Params:
    return family_of(cfg).decoder.param_logical_axes(cfg)


def forward(
    params: Params,
    cfg: ModelConfig,
    inputs: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    shard: ActivationSharding = UNSHARDED,
    layers=None,
) -> tuple[jax.Array, jax.Array]:
    return family_of(cfg).decoder.forward(params, cfg, inputs, positions, segment_ids, shard=shard, layers=layers)


def logits_from_hidden(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    return family_of(cfg).decoder.logits_from_hidden(params, cfg, hidden)


def logits_pullback(
    params: Params, cfg: ModelConfig, hidden: jax.Array, d_logits: jax.Array
) -> tuple[Params, jax.Array]:
    return family_of(cfg).decoder.logits_pullback(params, cfg, hidden, d_logits)


def output_rows(params: Params, cfg: ModelConfig, ids: jax.Array) -> jax.Array:
    return family_of(cfg).decoder.output_rows(params, cfg, ids)


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    return family_of(cfg).flops.count_params(cfg)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return family_of(cfg).flops.training_flops_per_token(cfg, seq_len)


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return family_of(cfg).flops.recompute_flops_per_token(cfg, seq_len)


__all__ = [
    "FAMILIES",
    "ModelFamily",
    "Params",
    "abstract_params",
    "count_params",
    "family_of",
    "forward",
    "init_params",
    "logits_from_hidden",
    "logits_pullback",
    "output_rows",
    "param_logical_axes",
    "recompute_flops_per_token",
    "training_flops_per_token",
]
