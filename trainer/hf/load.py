"""A Hugging Face directory of a supported family (Qwen3, Qwen3-MoE, Llama 3) read as this trainer's
ModelConfig and params.

config.json and every safetensors header are checked against each other before any tensor is read
(`open_hf`), so a wrong architecture, a missing, misshapen or unexpected tensor is an error naming it
before the heavy work; `read_hf_params` then fills each param leaf once, tensor by tensor, following
the tensor plan of the family's mapping (`trainer/model/hf.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from etils import epath

from trainer.hf.errors import MissingInput, hf_error, why
from trainer.hf.safetensors_io import ST_DTYPES, TORCH_DTYPES, SafetensorsDir, np_dtype

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports include; recomputed, never loaded


def read_hf_config(hf_dir) -> dict:
    """config.json of a Hugging Face directory as a dict; a missing or unparsable file is an error
    naming it."""
    hf_dir = hf_dir if isinstance(hf_dir, epath.Path) else Path(hf_dir)
    path = hf_dir / "config.json"
    if not hf_dir.exists():
        raise MissingInput(f"--hf-dir {hf_dir} does not exist")
    if not path.is_file():
        raise MissingInput(f"{path} not found (a Hugging Face model directory has config.json)")
    try:
        hf = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise hf_error(f"{path} is not valid JSON ({why(e)}); download it again") from None
    if not isinstance(hf, dict):
        raise hf_error(f"{path} holds a JSON {type(hf).__name__}, not an object of config keys")
    return hf


def activation_dtype(hf: dict) -> str:
    """The activation dtype a config.json records (float32 if none, or one this trainer does not write)."""
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return stored if stored in ST_DTYPES else "float32"


def model_config_from_hf(
    hf: dict,
    *,
    dtype: str,
    weight_dtype: str,
    scan_layers: bool = True,
    moe_capacity_factor: float | None = None,
    source: str = "config.json",
):
    """ModelConfig of a config.json; MoE capacity dropless (HF semantics) unless given."""
    from trainer.config.schema import ModelConfig
    from trainer.model.hf import dropless_capacity_factor, model_keys_from_hf

    keys = model_keys_from_hf(hf, source)
    if keys.get("num_experts", 1) > 1:
        keys["moe_capacity_factor"] = moe_capacity_factor or dropless_capacity_factor(
            keys["num_experts"], keys["num_experts_per_tok"]
        )
    return ModelConfig(**keys, dtype=dtype, weight_dtype=weight_dtype, scan_layers=scan_layers)


def check_tensors(reader: SafetensorsDir, plan, tied: bool, architecture: str = "") -> None:
    """Every tensor the plan needs is there with the shape config.json implies, and nothing else is;
    `architecture` (config.json's) names the model in the error about tensors it has no place for."""
    expected = {p.hf_name: p.hf_shape(leaf.piece_shape(p)) for leaf in plan for p in leaf.pieces}
    for name, shape in expected.items():
        if name not in reader:
            raise hf_error(
                f"tensor {name!r} is missing from {reader.dir} (config.json implies shape {list(shape)})"
            )
        if reader.shape(name) != shape:
            raise hf_error(
                f"tensor {name!r} has shape {list(reader.shape(name))} in {reader.dir}, but "
                f"config.json implies {list(shape)}"
            )
        if reader.dtype(name) not in TORCH_DTYPES:
            raise hf_error(
                f"tensor {name!r} has dtype {reader.dtype(name)}; only floating-point "
                f"F32/BF16/F16/F64 tensors are read"
            )
    extra = [
        n
        for n in reader.names()
        if n not in expected and not n.endswith(_IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight")
    ]  # tied: HF ignores a stored head too
    if extra:
        raise hf_error(
            f"{len(extra)} tensor(s) in {reader.dir} are not part of the {architecture or 'model'} "
            f"config.json describes, e.g. {extra[:4]}"
        )


def read_hf_params(reader: SafetensorsDir, plan, weight_dtype: str) -> dict:
    """Params (numpy, weight_dtype) filled tensor by tensor: each leaf is allocated once."""
    from trainer.model.hf import set_leaf

    params: dict = {}
    dtype = np_dtype(weight_dtype)
    for leaf in plan:
        out = np.empty(leaf.shape, dtype)
        for piece in leaf.pieces:
            out[piece.index] = piece.to_ours(reader.read(piece.hf_name), leaf.piece_shape(piece))
        set_leaf(params, leaf.path, out)
    return params


def open_hf(
    hf_dir,
    *,
    dtype: str | None,
    weight_dtype: str,
    scan_layers: bool = True,
    moe_capacity_factor: float | None = None,
):
    """(ModelConfig, reader, plan) of a Hugging Face directory: config.json and every safetensors header
    checked against each other, no tensor read yet, so every format error comes before the heavy work.
    dtype None: the activation dtype config.json records."""
    from trainer.model.hf import tensor_plan

    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(
        hf,
        dtype=dtype or activation_dtype(hf),
        weight_dtype=weight_dtype,
        scan_layers=scan_layers,
        moe_capacity_factor=moe_capacity_factor,
        source=str(hf_dir / "config.json" if isinstance(hf_dir, epath.Path) else Path(hf_dir) / "config.json"),
    )
    reader = SafetensorsDir(hf_dir)
    plan = tensor_plan(cfg)
    architecture = ", ".join(hf.get("architectures") or [str(hf.get("model_type"))])
    check_tensors(reader, plan, tied=cfg.logits_via_embedding, architecture=architecture)
    return cfg, reader, plan


def load_hf(
    hf_dir, *, dtype: str, weight_dtype: str, scan_layers: bool = True, moe_capacity_factor: float | None = None
):
    """(ModelConfig, numpy params) of a Hugging Face directory, checked against its config.json."""
    cfg, reader, plan = open_hf(
        hf_dir,
        dtype=dtype,
        weight_dtype=weight_dtype,
        scan_layers=scan_layers,
        moe_capacity_factor=moe_capacity_factor,
    )
    return cfg, read_hf_params(reader, plan, weight_dtype)
