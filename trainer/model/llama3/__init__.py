"""Llama 3 (the 3.1 and 3.2 architectures): the shared decoder without q/k norm, with GQA, tied (3.2 1B
and 3B) or untied (3.1 8B) embeddings, RoPE theta 500000 and the `llama3` RoPE scaling, RMSNorm eps 1e-5.

Everything but the config.json translation is shared: the decoder (`trainer/model/transformer.py`,
`use_qk_norm: false`, the scaling through `rope_scaling`), its FLOPs (`flops.py`) and the tensor layout
(`hf_tensors.py`, which Llama's safetensors names follow). What is Llama's own is `hf.py` and its presets.
"""

from trainer.model import flops, hf_tensors, transformer
from trainer.model.family import HfMapping, ModelFamily
from trainer.model.llama3 import hf

FAMILY = ModelFamily(
    name="llama3",
    decoder=transformer,
    flops=flops,
    hf=HfMapping(
        architectures=hf.ARCHITECTURES,
        model_keys=hf.model_keys,
        config_json=hf.config_json,
        tensor_plan=hf_tensors.tensor_plan,
    ),
    presets=("llama3-tiny", "llama3.2-1b", "llama3.2-3b", "llama3.1-8b"),
)
