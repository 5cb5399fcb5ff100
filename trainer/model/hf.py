"""Hugging Face checkpoints <-> this model, whatever the family: config.json translation and the tensor plan.

Pure mapping, no file I/O (`trainer/hf/` streams the files). Each family's own mapping is in
`trainer/model/<family>/hf.py` (its `HfMapping`); this module picks it: by `model_type` for a config.json
(`model_keys_from_hf`), by `model_family` for a ModelConfig (`hf_config`, `tensor_plan`). The shared
tensor layout (`Piece`, `Leaf`, `set_leaf`, `get_leaf`) is `hf_tensors.py`'s, the error and value readers
`hf_format.py`'s.

Supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM (`qwen3`) and LlamaForCausalLM (`llama3`). Anything
else, and a key of the wrong type, raises `HfFormatError` naming the config key (and the file, given as
`source`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.config.schema import ModelConfig
from trainer.model.families import family_of, family_of_hf
from trainer.model.hf_format import HfFormatError as HfFormatError
from trainer.model.hf_tensors import Leaf as Leaf
from trainer.model.hf_tensors import Piece as Piece
from trainer.model.hf_tensors import get_leaf as get_leaf
from trainer.model.hf_tensors import set_leaf as set_leaf


def model_keys_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The architecture keys of ModelConfig (`model_family` and `rope_scaling` included) described by a
    config.json of any supported family. `source` (the file's path) names the file in errors, so a user
    with several model directories knows which one is bad."""
    fam, model_type = family_of_hf(hf, source)
    return fam.hf.model_keys(hf, model_type, source)


def hf_config(cfg: ModelConfig, torch_dtype: str) -> dict[str, Any]:
    """config.json for `cfg` in its family's architecture (HfFormatError when it has no equivalent there)."""
    return family_of(cfg).hf.config_json(cfg, torch_dtype)


def tensor_plan(cfg: ModelConfig) -> list[Leaf]:
    """Every param leaf of `cfg` (in the params' key order) with the HF tensors that fill it."""
    return family_of(cfg).hf.tensor_plan(cfg)


def dropless_capacity_factor(num_experts: int, top_k: int) -> float:
    """The smallest MoE capacity factor that never drops a token (HF routing is dropless)."""
    return num_experts / top_k
