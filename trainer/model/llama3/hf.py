"""Hugging Face Llama 3 (3.1 / 3.2) config.json <-> ModelConfig.

Supported: `LlamaForCausalLM` with default RoPE or a RoPE scaling (`linear`, `dynamic`, `yarn`,
`llama3`), tied or untied embeddings, GQA, SiLU, no attention or MLP biases. The RoPE section is read in
either spelling and written in both (`trainer/model/hf_rope.py`). Anything else, and a key of the wrong
type, raises `HfFormatError` naming the config key and the file (`source`). The tensors are the shared
decoder's (`trainer/model/hf_tensors.py`); Llama has no q/k norm, so none are read or written.
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

ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# Written into exported config.json; RoPE has no length limit, this is Llama 3.1 / 3.2's published context.
MAX_POSITION_EMBEDDINGS = 131072


def model_keys(hf: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The architecture keys of ModelConfig described by a Llama config.json. Keys transformers lets a
    config omit take LlamaConfig's defaults (head_dim = hidden / heads, rms_norm_eps 1e-6, untied);
    the sizes are required."""
    reject_common(hf, source)
    reject_unsupported(hf, source, mlp_bias="an MLP with biases")
    heads = positive_int(hf, "num_attention_heads", source)
    hidden = positive_int(hf, "hidden_size", source)
    kv_heads = positive_int(hf, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise HfFormatError(
            f"{source}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
        )
    return {
        "model_family": "llama3",
        "rope_scaling": rope_scaling_text(scaling_from_hf(hf, source, "Llama")),
        "base_num_decoder_layers": positive_int(hf, "num_hidden_layers", source),
        "base_emb_dim": hidden,
        "base_num_query_heads": heads,
        "base_num_kv_heads": kv_heads,
        "head_dim": positive_int(hf, "head_dim", source, default=hidden // heads),
        "base_mlp_dim": positive_int(hf, "intermediate_size", source),
        "vocab_size": positive_int(hf, "vocab_size", source),
        "rope_max_timescale": rope_theta(hf, source),
        "normalization_layer_epsilon": number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        "use_qk_norm": False,
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    }


def config_json(cfg: ModelConfig, torch_dtype: str) -> dict[str, Any]:
    """config.json for `cfg` that transformers 4.x and 5.x both read (the RoPE section in both spellings)."""
    if cfg.use_qk_norm:
        raise HfFormatError("use_qk_norm=true has no Llama equivalent (Llama norms neither q nor k)")
    if cfg.num_experts > 1:
        raise HfFormatError(f"num_experts={cfg.num_experts} has no Llama equivalent (Llama 3 is dense)")
    return {
        "architectures": [ARCHITECTURES["llama"]],
        "model_type": "llama",
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
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }
