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
Anything else, and a key of the wrong type, raises `HfFormatError` naming the config key (and the file,
given as `source`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from trainer.config.schema import ModelConfig
from trainer.errors import UserInputError
from trainer.model.transformer import abstract_params

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Written into exported config.json; RoPE has no length limit, this is Qwen3's published context.
MAX_POSITION_EMBEDDINGS = 40960
_TOP_LEVEL = {
    "embed_tokens": ("model.embed_tokens.weight", 0),
    "norm": ("model.norm.weight", 0),
    "lm_head": ("lm_head.weight", 1),
}
_EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


class HfFormatError(UserInputError):
    """An unsupported architecture or config, or a checkpoint that does not match it (names the tensor).

    A user input error: the converter's CLI reports it on one line and exits 2."""


# ---------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def model_keys_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The architecture keys of ModelConfig described by a Qwen3 / Qwen3-MoE config.json.

    Accepts both spellings real checkpoints use: `rope_theta` at top level or under `rope_parameters`
    (transformers 5) / `rope_scaling`; `num_experts` or `num_local_experts`. Keys transformers lets a
    config omit take transformers' defaults; the sizes are required. `source` (the file's path) names
    the file in errors, so a user with several model directories knows which one is bad."""
    if not isinstance(hf, Mapping):
        raise HfFormatError(f"{source} holds a JSON {type(hf).__name__}, not an object of config keys")
    model_type = _model_type(hf, source)
    _reject_unsupported(hf, model_type, source)
    heads = _int(hf, "num_attention_heads", source)
    hidden = _int(hf, "hidden_size", source)
    kv_heads = _int(hf, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise HfFormatError(
            f"{source}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
        )
    keys = {
        "base_num_decoder_layers": _int(hf, "num_hidden_layers", source),
        "base_emb_dim": hidden,
        "base_num_query_heads": heads,
        "base_num_kv_heads": kv_heads,
        # Qwen3Config's head_dim defaults to 128; Qwen3MoeAttention falls back to hidden / heads.
        "head_dim": _int(hf, "head_dim", source, default=128 if model_type == "qwen3" else hidden // heads),
        "base_mlp_dim": _int(hf, "intermediate_size", source),
        "vocab_size": _int(hf, "vocab_size", source),
        "rope_max_timescale": _number(_rope_theta(hf), "rope_theta", source),
        "normalization_layer_epsilon": _number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        "use_qk_norm": True,
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    }
    if model_type == "qwen3_moe":
        name = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
        if hf.get(name) is None:
            raise HfFormatError(f"{source} has neither 'num_experts' nor 'num_local_experts' (qwen3_moe)")
        keys.update(
            num_experts=_int(hf, name, source),
            num_experts_per_tok=_int(hf, "num_experts_per_tok", source),
            base_moe_mlp_dim=_int(hf, "moe_intermediate_size", source),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            load_balance_loss_weight=_number(
                hf.get("router_aux_loss_coef", 0.001), "router_aux_loss_coef", source
            ),
        )
        if keys["num_experts_per_tok"] > keys["num_experts"]:
            raise HfFormatError(
                f"{source}: num_experts_per_tok={keys['num_experts_per_tok']} exceeds {name}={keys['num_experts']}"
            )
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
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.base_emb_dim,
        "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": cfg.base_num_decoder_layers,
        "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        "rope_theta": cfg.rope_max_timescale,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_max_timescale},
        "tie_word_embeddings": cfg.logits_via_embedding,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }
    if moe:
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.base_moe_mlp_dim,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
            router_aux_loss_coef=cfg.load_balance_loss_weight,
        )
    else:
        out["max_window_layers"] = cfg.base_num_decoder_layers
    return out


def _model_type(hf: Mapping[str, Any], source: str) -> str:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    known = {v: k for k, v in ARCHITECTURES.items()}
    supported = ", ".join(ARCHITECTURES.values())
    for arch in archs:
        if arch not in known:
            raise HfFormatError(
                f"unsupported architecture {arch!r} (model_type {model_type!r}) in {source}; "
                f"supported: {supported}"
            )
    if model_type not in ARCHITECTURES:
        raise HfFormatError(
            f"unsupported model_type {model_type!r} in {source} (architectures {archs}); supported: {supported}"
        )
    if archs and known[archs[0]] != model_type:
        raise HfFormatError(f"{source}: architectures {archs} does not match model_type {model_type!r}")
    return model_type


def _int(hf: Mapping[str, Any], name: str, source: str, default: int | None = None) -> int:
    """A positive integer key; required unless `default` is given. 4.0 is accepted, 4.5 and "4" are not
    (int() would silently truncate or parse them)."""
    value = hf.get(name)
    if value is None:
        if default is None:
            raise HfFormatError(f"{source} has no {name!r} (every Qwen3 config.json sets it)")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise HfFormatError(f"{source}: {name}={value!r} must be a positive integer")
    return int(value)


def _number(value: Any, name: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HfFormatError(f"{source}: {name}={value!r} must be a number")
    return float(value)


def _rope(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: Mapping[str, Any]) -> float:
    return _rope(hf).get("rope_theta", hf.get("rope_theta", 10_000.0))


def _reject_unsupported(hf: Mapping[str, Any], model_type: str, source: str) -> None:
    def bad(key: str, why: str):
        raise HfFormatError(f"{source} {key}={hf.get(key)!r}: {why} is not supported")

    if hf.get("hidden_act", "silu") != "silu":
        bad("hidden_act", "an activation other than silu")
    if hf.get("attention_bias", False):
        bad("attention_bias", "attention with biases")
    if hf.get("use_sliding_window", False):
        bad("use_sliding_window", "sliding-window attention")
    if hf.get("quantization_config"):
        bad("quantization_config", "a quantized checkpoint")
    rope = _rope(hf)
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if not isinstance(rope, Mapping):
        raise HfFormatError(f"{source} {key}={rope!r} must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HfFormatError(f"{source} {key}: rope_type {rope_type!r} is not supported (only default RoPE)")
    if model_type == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1:
            bad("decoder_sparse_step", "a MoE model with dense-MLP layers (every layer must be MoE)")
        if hf.get("mlp_only_layers"):
            bad("mlp_only_layers", "a MoE model with dense-MLP layers (every layer must be MoE)")
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if isinstance(experts, (int, float)) and experts < 2:
            raise HfFormatError(f"{source} num_experts={experts}: a qwen3_moe model needs >= 2 experts")


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
        return (math.prod(piece_shape[self.in_dims :]), math.prod(piece_shape[: self.in_dims]))

    def to_ours(self, w: np.ndarray, piece_shape: tuple[int, ...]) -> np.ndarray:
        return w.reshape(piece_shape) if not self.in_dims else w.T.reshape(piece_shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        if not self.in_dims:
            return x
        return x.reshape(math.prod(x.shape[: self.in_dims]), -1).T


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A param leaf (path into the params dict) and the HF tensors that make it up."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def piece_shape(self, piece: Piece) -> tuple[int, ...]:
        return self.shape[len(piece.index) :]


def tensor_plan(cfg: ModelConfig) -> list[Leaf]:
    """Every param leaf of `cfg` (in the params' key order) with the HF tensors that fill it."""
    return [
        Leaf(path, tuple(shape), tuple(_pieces(cfg, path))) for path, shape in _leaf_shapes(abstract_params(cfg))
    ]


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
            out += [
                Piece(f"model.layers.{layer}.mlp.experts.{e}.{rest[1]}.weight", lead + (e,), in_dims)
                for e in range(cfg.num_experts)
            ]
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
