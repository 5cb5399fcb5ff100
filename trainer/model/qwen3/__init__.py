"""Qwen3 (dense) and Qwen3-MoE: the shared decoder with per-head q/k RMSNorm, default RoPE and, for the
MoE, every layer's MLP routed to the top-k of `num_experts` experts.

The decoder, its FLOPs and its tensor layout are the shared ones (`trainer/model/transformer.py`,
`flops.py`, `hf_tensors.py`), read with the Qwen3 presets' keys (`use_qk_norm: true`); what is Qwen3's
own is its config.json translation (`hf.py`) and its presets.
"""

from trainer.model import flops, hf_tensors, transformer
from trainer.model.family import HfMapping, ModelFamily
from trainer.model.qwen3 import hf

FAMILY = ModelFamily(
    name="qwen3",
    decoder=transformer,
    flops=flops,
    hf=HfMapping(
        architectures=hf.ARCHITECTURES,
        model_keys=hf.model_keys,
        config_json=hf.config_json,
        tensor_plan=hf_tensors.tensor_plan,
    ),
    presets=(
        "qwen3-tiny",
        "qwen3-tiny-moe",
        "qwen3-mini",
        "qwen3-0.6b",
        "qwen3-1.7b",
        "qwen3-4b",
        "qwen3-8b",
        "qwen3-14b",
        "qwen3-32b",
        "qwen3-30b-a3b",
    ),
)
