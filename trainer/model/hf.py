"""Hugging Face Qwen3 / Qwen3-MoE <-> this model: config.json translation and the tensor plan.

Pure mapping, no file I/O (`trainer/convert.py` streams the files). It lives next to the model because
it mirrors the model's param layout (the torchtitan `state_dict_adapter.py` pattern), and `model/`
imports nothing from `checkpoint/`. The name and layout rules are in the `transformer.py` docstring:

    HF name = "model." + our path with "/" -> "." + ".weight", layer i = layers.{i} (or index i of the
    stacked L dim), experts stacked over e as mlp.experts.{e}.*, mlp/router = mlp.gate, lm_head outside
    "model.". A matrix W [out, in] is stored transposed, with its in/out dims split into heads.

`tensor_plan(cfg)` lists, for every param leaf, the HF tensors (`Piece`s) that fill it; both directions
of the conversion walk it, one tensor at a time, so neither needs a second copy of the model.

Supported: `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` with default RoPE, SiLU, no attention bias,
no sliding window, and (MoE) every layer sparse (`decoder_sparse_step=1`, no `mlp_only_layers`).
Anything else raises `HfFormatError` naming the config key.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from trainer.config.schema import ModelConfig
from trainer.model.transformer import abstract_params

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Written into exported config.json; RoPE has no length limit, this is Qwen3's published context.
MAX_POSITION_EMBEDDINGS = 40960
_TOP_LEVEL = {"embed_tokens": ("model.embed_tokens.weight", 0), "norm": ("model.norm.weight", 0),
              "lm_head": ("lm_head.weight", 1)}
_EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


class HfFormatError(ValueError):
    """An unsupported architecture or config, or a checkpoint that does not match it (names the tensor)."""


# ---------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def model_keys_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture keys of ModelConfig described by a Qwen3 / Qwen3-MoE config.json.

    Accepts both spellings real checkpoints use: `rope_theta` at top level or under `rope_parameters`
    (transformers 5) / `rope_scaling`; `num_experts` or `num_local_experts`. Keys transformers lets a
    config omit take transformers' defaults; the sizes are required."""
    model_type = _model_type(hf)
    _reject_unsupported(hf, model_type)
    heads = _required(hf, "num_attention_heads")
    hidden = _required(hf, "hidden_size")
    keys = {
        "base_num_decoder_layers": _required(hf, "num_hidden_layers"),
        "base_emb_dim": hidden,
        "base_num_query_heads": heads,
        "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        # Qwen3Config's head_dim defaults to 128; Qwen3MoeAttention falls back to hidden / heads.
        "head_dim": hf.get("head_dim") or (128 if model_type == "qwen3" else hidden // heads),
        "base_mlp_dim": _required(hf, "intermediate_size"),
        "vocab_size": _required(hf, "vocab_size"),
        "rope_max_timescale": float(_rope_theta(hf)),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "use_qk_norm": True,
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    }
    if model_type == "qwen3_moe":
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise HfFormatError("config.json has neither 'num_experts' nor 'num_local_experts' (qwen3_moe)")
        keys.update(num_experts=int(experts), num_experts_per_tok=_required(hf, "num_experts_per_tok"),
                    base_moe_mlp_dim=_required(hf, "moe_intermediate_size"),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    load_balance_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)))
    return keys


def dropless_capacity_factor(num_experts: int, top_k: int) -> float:
    """The smallest MoE capacity factor that never drops a token (HF routing is dropless)."""
    return num_experts / top_k


def hf_config(cfg: ModelConfig, torch_dtype: str) -> dict[str, Any]:
    """config.json for `cfg` that transformers 4.x and 5.x both read (rope_theta in both spellings)."""
    if not cfg.use_qk_norm:
        raise HfFormatError("use_qk_norm=false has no Qwen3 equivalent (Qwen3 always norms q and k)")
    moe = cfg.num_experts > 1
    out = {
        "architectures": [ARCHITECTURES["qwen3_moe" if moe else "qwen3"]],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.base_emb_dim, "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": cfg.base_num_decoder_layers, "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "rms_norm_eps": cfg.normalization_layer_epsilon,
        "rope_theta": cfg.rope_max_timescale,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_max_timescale},
        "tie_word_embeddings": cfg.logits_via_embedding, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": torch_dtype, "dtype": torch_dtype,
    }
    if moe:
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.base_moe_mlp_dim, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                   router_aux_loss_coef=cfg.load_balance_loss_weight)
    else:
        out["max_window_layers"] = cfg.base_num_decoder_layers
    return out


def _model_type(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    known = {v: k for k, v in ARCHITECTURES.items()}
    supported = ", ".join(ARCHITECTURES.values())
    for arch in archs:
        if arch not in known:
            raise HfFormatError(f"unsupported architecture {arch!r} (model_type {model_type!r}) in config.json; "
                                f"supported: {supported}")
    if model_type not in ARCHITECTURES:
        raise HfFormatError(f"unsupported model_type {model_type!r} in config.json (architectures {archs}); "
                            f"supported: {supported}")
    if archs and known[archs[0]] != model_type:
        raise HfFormatError(f"config.json: architectures {archs} does not match model_type {model_type!r}")
    return model_type


def _required(hf: Mapping[str, Any], name: str) -> int:
    if hf.get(name) is None:
        raise HfFormatError(f"config.json has no {name!r}")
    return int(hf[name])


def _rope(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: Mapping[str, Any]) -> float:
    return _rope(hf).get("rope_theta", hf.get("rope_theta", 10_000.0))


def _reject_unsupported(hf: Mapping[str, Any], model_type: str) -> None:
    def bad(key: str, why: str):
        raise HfFormatError(f"config.json {key}={hf.get(key)!r}: {why} is not supported")

    if hf.get("hidden_act", "silu") != "silu":
        bad("hidden_act", "an activation other than silu")
    if hf.get("attention_bias", False):
        bad("attention_bias", "attention with biases")
    if hf.get("use_sliding_window", False):
        bad("use_sliding_window", "sliding-window attention")
    if hf.get("quantization_config"):
        bad("quantization_config", "a quantized checkpoint")
    rope = _rope(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        raise HfFormatError(f"config.json {key}: rope_type {rope_type!r} is not supported (only default RoPE)")
    if model_type == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1:
            bad("decoder_sparse_step", "a MoE model with dense-MLP layers (every layer must be MoE)")
        if hf.get("mlp_only_layers"):
            bad("mlp_only_layers", "a MoE model with dense-MLP layers (every layer must be MoE)")
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is not None and experts < 2:
            raise HfFormatError(f"config.json num_experts={experts}: a qwen3_moe model needs >= 2 experts")


# ---------------------------------------------------------------------------------------------------
# Tensors


@dataclasses.dataclass(frozen=True)
class Piece:
    """One HF tensor and where it goes in a param leaf.

    `index` selects the slot in the leaf (stacked layer, expert); the rest of the leaf is the piece.
    `in_dims` = 0: stored as is (norms, embedding). n > 0: a linear layer, HF W [out, in] with
    ours = W.T reshaped, whose first n dims are the input (2 for o_proj [N, hd, D], else 1)."""

    hf_name: str
    index: tuple[int, ...]
    in_dims: int

    def hf_shape(self, piece_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not self.in_dims:
            return piece_shape
        return (math.prod(piece_shape[self.in_dims:]), math.prod(piece_shape[:self.in_dims]))

    def to_ours(self, w: np.ndarray, piece_shape: tuple[int, ...]) -> np.ndarray:
        return w.reshape(piece_shape) if not self.in_dims else w.T.reshape(piece_shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        if not self.in_dims:
            return x
        return x.reshape(math.prod(x.shape[:self.in_dims]), -1).T


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A param leaf (path into the params dict) and the HF tensors that make it up."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def piece_shape(self, piece: Piece) -> tuple[int, ...]:
        return self.shape[len(piece.index):]


def tensor_plan(cfg: ModelConfig) -> list[Leaf]:
    """Every param leaf of `cfg` (in the params' key order) with the HF tensors that fill it."""
    return [Leaf(path, tuple(shape), tuple(_pieces(cfg, path)))
            for path, shape in _leaf_shapes(abstract_params(cfg))]


def hf_names(plan: list[Leaf]) -> set[str]:
    return {p.hf_name for leaf in plan for p in leaf.pieces}


def _leaf_shapes(tree, prefix: tuple[str, ...] = ()):
    for k in sorted(tree):
        if isinstance(tree[k], dict):
            yield from _leaf_shapes(tree[k], prefix + (k,))
        else:
            yield prefix + (k,), tree[k].shape


def _pieces(cfg: ModelConfig, path: tuple[str, ...]) -> list[Piece]:
    if path[0] != "layers":
        name, in_dims = _TOP_LEVEL[path[0]]
        return [Piece(name, (), in_dims)]
    if cfg.scan_layers:
        layers, rest, stacked = range(cfg.base_num_decoder_layers), path[1:], True
    else:
        layers, rest, stacked = [int(path[1])], path[2:], False
    sub = ".".join(rest)
    if sub == "mlp.router":
        sub = "mlp.gate"
    in_dims = 0 if rest[-1].endswith("norm") else (2 if sub == "self_attn.o_proj" else 1)
    out = []
    for layer in layers:
        lead = (layer,) if stacked else ()
        if cfg.num_experts > 1 and rest[0] == "mlp" and rest[1] in _EXPERT_MATRICES:
            out += [Piece(f"model.layers.{layer}.mlp.experts.{e}.{rest[1]}.weight", lead + (e,), in_dims)
                    for e in range(cfg.num_experts)]
        else:
            out.append(Piece(f"model.layers.{layer}.{sub}.weight", lead, in_dims))
    return out


def set_leaf(params: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        params = params.setdefault(k, {})
    params[path[-1]] = value


def get_leaf(params: Mapping, path: tuple[str, ...]):
    for k in path:
        params = params[k]
    return params
