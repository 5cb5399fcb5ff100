"""Hugging Face Qwen3 / Qwen3-MoE config.json <-> ModelConfig.

Supported: `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` with default RoPE or a RoPE scaling (`linear`,
`dynamic`, `yarn`, `llama3`: read in either spelling, written in both, `trainer/model/hf_rope.py`),
SiLU, no attention bias, no sliding window, and (MoE) every layer sparse (`decoder_sparse_step=1`, no
`mlp_only_layers`).
Anything else, and a key of the wrong type, raises `HfFormatError` naming the config key (and the file,
given as `source`). The tensors are the shared decoder's (`trainer/model/hf_tensors.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.config.rope_scaling import parse_rope_scaling, rope_scaling_text
from trainer.config.schema import ModelConfig
from trainer.model.hf_format import (
    HfFormatError,
    number,
    positive_int,
    reject_common,
    reject_unsupported,
    rope_theta,
)
from trainer.model.hf_rope import rope_config, scaling_from_hf

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Written into exported config.json; RoPE has no length limit, this is Qwen3's published context.
MAX_POSITION_EMBEDDINGS = 40960


def model_keys(hf: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The architecture keys of ModelConfig described by a Qwen3 / Qwen3-MoE config.json.

    Accepts both spellings real checkpoints use: `rope_theta` at top level or under `rope_parameters`
    (transformers 5) / `rope_scaling`; `num_experts` or `num_local_experts`. Keys transformers lets a
    config omit take transformers' defaults; the sizes are required."""
    _reject_unsupported(hf, model_type, source)
    heads = positive_int(hf, "num_attention_heads", source)
    hidden = positive_int(hf, "hidden_size", source)
    kv_heads = positive_int(hf, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise HfFormatError(
            f"{source}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
        )
    keys = {
        "model_family": "qwen3",
        "rope_scaling": rope_scaling_text(scaling_from_hf(hf, source, "Qwen3")),
        "base_num_decoder_layers": positive_int(hf, "num_hidden_layers", source),
        "base_emb_dim": hidden,
        "base_num_query_heads": heads,
        "base_num_kv_heads": kv_heads,
        # Qwen3Config's head_dim defaults to 128; Qwen3MoeAttention falls back to hidden / heads.
        "head_dim": positive_int(
            hf, "head_dim", source, default=128 if model_type == "qwen3" else hidden // heads
        ),
        "base_mlp_dim": positive_int(hf, "intermediate_size", source),
        "vocab_size": positive_int(hf, "vocab_size", source),
        "rope_max_timescale": rope_theta(hf, source),
        "normalization_layer_epsilon": number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        "use_qk_norm": True,
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    }
    if model_type == "qwen3_moe":
        name = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
        if hf.get(name) is None:
            raise HfFormatError(f"{source} has neither 'num_experts' nor 'num_local_experts' (qwen3_moe)")
        keys.update(
            num_experts=positive_int(hf, name, source),
            num_experts_per_tok=positive_int(hf, "num_experts_per_tok", source),
            base_moe_mlp_dim=positive_int(hf, "moe_intermediate_size", source),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            load_balance_loss_weight=number(hf.get("router_aux_loss_coef", 0.001), "router_aux_loss_coef", source),
        )
        if keys["num_experts_per_tok"] > keys["num_experts"]:
            raise HfFormatError(
                f"{source}: num_experts_per_tok={keys['num_experts_per_tok']} exceeds {name}={keys['num_experts']}"
            )
    return keys


def config_json(cfg: ModelConfig, torch_dtype: str) -> dict[str, Any]:
    """config.json for `cfg` that transformers 4.x and 5.x both read (the RoPE section in both spellings)."""
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
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        **rope_config(parse_rope_scaling(cfg.rope_scaling), cfg.rope_max_timescale, MAX_POSITION_EMBEDDINGS),
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


def _reject_unsupported(hf: Mapping[str, Any], model_type: str, source: str) -> None:
    reject_common(hf, source)
    reject_unsupported(hf, source, use_sliding_window="sliding-window attention")
    if model_type == "qwen3_moe":
        sparse_only = "a MoE model with dense-MLP layers (every layer must be MoE)"
        if hf.get("decoder_sparse_step", 1) != 1:
            raise HfFormatError(
                f"{source} decoder_sparse_step={hf.get('decoder_sparse_step')!r}: {sparse_only} is not supported"
            )
        reject_unsupported(hf, source, mlp_only_layers=sparse_only)
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if isinstance(experts, (int, float)) and experts < 2:
            raise HfFormatError(f"{source} num_experts={experts}: a qwen3_moe model needs >= 2 experts")
