"""Low-rank adapters (LoRA) over the decoder's projections: their shapes, init, merge and PEFT names.

A targeted projection W [*in, *out] (our layout: `trainer/model/transformer.py`) gets A [*in, r] and
B [r, *out]; the model runs with W + scale * A B, scale = lora_alpha / r, which is PEFT's
W x + scale * B(A x) for every input x. With stacked layers (scan_layers=true) W, A and B carry the
leading "layers" dim. The adapters mirror the params' paths, one {"lora_A", "lora_B"} per targeted leaf:

    layers/self_attn/q_proj/lora_A  [L, D, r]      ("layers", "embed", None)
    layers/self_attn/q_proj/lora_B  [L, r, N, hd]  ("layers", None, "heads", "head_dim")
    layers/self_attn/o_proj/lora_A  [L, N, hd, r]  ("layers", "heads", "head_dim", None)
    layers/mlp/down_proj/lora_B     [L, r, D]      ("layers", None, "embed")

The step merges inside each decoder block (`layer_adapter`: the block's rematerialised function merges
its own layer), so it holds one layer's merged weights and, in the backward, their gradient (contracted
onto that layer's A and B there) at a time. `merge` merges the whole model at once (export, tests).

Init as PEFT's: A ~ uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming-uniform with a = sqrt(5)),
fan_in = prod(*in); B = 0, so a fresh adapter leaves the base's function unchanged.
Pure functions of shapes and arrays; jittable with the configs static.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from trainer.config.schema import LORA_MODULES, LoraConfig, ModelConfig
from trainer.model import abstract_params, param_logical_axes

# The projections' input dims (the rest are output dims), as stored without the layers dim.
IN_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
PARENT.update({"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"})
A, B = "lora_A", "lora_B"


def enabled(lora: LoraConfig | None) -> bool:
    return lora is not None and lora.lora_rank > 0


def target_modules(lora: LoraConfig) -> tuple[str, ...]:
    """The targeted projection names, in LORA_MODULES order (`all-linear`: all of them)."""
    names = set(LORA_MODULES) if "all-linear" in lora.lora_target_modules else set(lora.lora_target_modules)
    return tuple(m for m in LORA_MODULES if m in names)


def scale(lora: LoraConfig) -> float:
    return lora.lora_alpha / lora.lora_rank


def _targets(cfg: ModelConfig, lora: LoraConfig) -> list[tuple[tuple[str, ...], str]]:
    """(path of the weight in the params, projection name) of every targeted leaf."""
    wanted = target_modules(lora)
    layers = abstract_params(cfg)["layers"]
    prefixes = [()] if cfg.scan_layers else [(i,) for i in sorted(layers, key=int)]
    return [
        (("layers", *p, PARENT[name], name), name)
        for p in prefixes
        for name in wanted
        if name in (layers if not p else layers[p[0]])[PARENT[name]]
    ]


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _put(tree: dict, path, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _split(shape: tuple[int, ...], name: str, stacked: bool) -> tuple[tuple, tuple, tuple]:
    """(layers dims, in dims, out dims) of a weight's shape."""
    lead = shape[:1] if stacked else ()
    rest = shape[len(lead) :]
    return lead, rest[: IN_DIMS[name]], rest[IN_DIMS[name] :]


def adapter_shapes(cfg: ModelConfig, lora: LoraConfig, *, of=None) -> dict:
    """The adapters as `of(A shape, B shape, weight leaf, name)` pairs, on the params' paths; `of` defaults to
    float ShapeDtypeStructs in weight_dtype."""
    params, r = abstract_params(cfg), lora.lora_rank
    out: dict = {}
    for path, name in _targets(cfg, lora):
        w = _get(params, path)
        lead, ins, outs = _split(w.shape, name, cfg.scan_layers)
        a_shape, b_shape = (*lead, *ins, r), (*lead, r, *outs)
        if of is None:
            pair = {A: jax.ShapeDtypeStruct(a_shape, w.dtype), B: jax.ShapeDtypeStruct(b_shape, w.dtype)}
        else:
            pair = of(a_shape, b_shape, path, name)
        _put(out, path, pair)
    return out


def abstract_adapters(cfg: ModelConfig, lora: LoraConfig) -> dict:
    """The adapters as jax.ShapeDtypeStruct leaves (dtype weight_dtype): nothing allocated."""
    return adapter_shapes(cfg, lora)


def adapter_logical_axes(cfg: ModelConfig, lora: LoraConfig) -> dict:
    """Each adapter leaf's logical axis names: the weight's own for its in / out dims, None for the rank."""
    axes = param_logical_axes(cfg)

    def of(a_shape, b_shape, path, name):
        lead, ins, outs = _split(_get(axes, path), name, cfg.scan_layers)
        return {A: (*lead, *ins, None), B: (*lead, None, *outs)}

    return adapter_shapes(cfg, lora, of=of)


def init_adapters(cfg: ModelConfig, lora: LoraConfig, rng: jax.Array) -> dict:
    """Fresh adapters: A kaiming-uniform as PEFT's (one rng per targeted leaf, by its position), B zeros.
    Jittable with the configs static."""
    dtype = jnp.dtype(cfg.weight_dtype)
    index = iter(range(1 << 30))

    def of(a_shape, b_shape, path, name):
        fan_in = math.prod(a_shape[(1 if cfg.scan_layers else 0) : -1])
        bound = 1.0 / math.sqrt(fan_in)
        key = jax.random.fold_in(rng, next(index))
        a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound).astype(dtype)
        return {A: a, B: jnp.zeros(b_shape, dtype)}

    return adapter_shapes(cfg, lora, of=of)


def delta(a: jax.Array, b: jax.Array, stacked: bool) -> jax.Array:
    """A B: [*lead, *in, r] x [*lead, r, *out] -> [*lead, *in, *out], in float32."""
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    if stacked:
        return jax.vmap(lambda x, y: jnp.tensordot(x, y, axes=1))(a32, b32)
    return jnp.tensordot(a32, b32, axes=1)


def merged_weight(w: jax.Array, pair: dict, s: float, stacked: bool) -> jax.Array:
    """W + s * A B for one targeted weight and its adapter `pair`: the sum in float32, cast to the promoted
    dtype of W and the adapters."""
    dtype = jnp.promote_types(w.dtype, pair[A].dtype)
    return (w.astype(jnp.float32) + s * delta(pair[A], pair[B], stacked)).astype(dtype)


def merge(base: dict, adapters: dict, cfg: ModelConfig, lora: LoraConfig) -> dict:
    """The params the model runs with: each targeted W replaced by W + scale * A B (float32 sum, cast to the
    promoted dtype of W and the adapters), every other leaf the base's own. Differentiable in `adapters`."""
    s = scale(lora)
    merged = jax.tree.map(lambda x: x, base)  # a fresh tree: the base's leaves themselves, not copies
    for path, _ in _targets(cfg, lora):
        _put(merged, path, merged_weight(_get(base, path), _get(adapters, path), s, cfg.scan_layers))
    return merged


def merge_layer(weights: dict, adapters: dict, lora: LoraConfig) -> dict:
    """One block's params the model runs with: `merge` for one layer (no layers dim), its params `weights`
    and its adapters `adapters` as they sit under "layers" (one layer's slice)."""
    s, merged = scale(lora), dict(weights)
    for parent, projections in adapters.items():
        merged[parent] = dict(weights[parent])
        for name, pair in projections.items():
            merged[parent][name] = merged_weight(weights[parent][name], pair, s, False)
    return merged


def layer_adapter(adapters: dict, lora: LoraConfig):
    """The adapters as the decoder's `layers` argument (`trainer.model.transformer.LayerAdapter`): each block
    merges its own layer (`merge_layer`) inside its rematerialised function, so the merged weights and
    their gradients exist for one layer at a time, never for the whole stack. The model run with the base
    and this computes what it computes with `merge(base, adapters)`, which targets only the layers."""
    return (lambda weights, layer: merge_layer(weights, layer, lora)), adapters["layers"]


def peft_tensors(adapters: dict, cfg: ModelConfig, lora: LoraConfig) -> dict[str, Any]:
    """The adapters as PEFT names them over a transformers *ForCausalLM, as numpy [out, in] matrices:
    base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight [r, prod(in)] and
    .lora_B.weight [prod(out), r] (torch Linear layout, flattened as the HF import flattens W)."""
    import numpy as np

    out = {}
    for path, name in _targets(cfg, lora):
        pair = _get(adapters, path)
        a, b = np.asarray(pair[A]), np.asarray(pair[B])
        layers = range(a.shape[0]) if cfg.scan_layers else [int(path[1])]
        for j, i in enumerate(layers):
            ai, bi = (a[j], b[j]) if cfg.scan_layers else (a, b)
            prefix = f"base_model.model.model.layers.{i}.{PARENT[name]}.{name}"
            r = ai.shape[-1]
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(ai.reshape(-1, r).T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(bi.reshape(r, -1).T)
    return out


def peft_config(cfg: ModelConfig, lora: LoraConfig, base_model: str) -> dict:
    """adapter_config.json of these adapters, as PEFT's LoraConfig reads it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.lora_rank,
        "lora_alpha": lora.lora_alpha,
        "lora_dropout": lora.lora_dropout,
        "target_modules": list(target_modules(lora)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
