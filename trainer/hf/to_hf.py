"""trainer-to-hf: a checkpoint of this trainer -> config.json + safetensors that transformers loads.

Everything that can be checked without reading an array is, first (checkpoint directory, output, model
config and its HF equivalent, stored shapes); the checkpoint is then restored once and each HF tensor is
produced from its slice of a param leaf only as it is written, so the model is never held twice. The
checkpoint's tokenizer goes with it where transformers can load it to the same token ids
(trainer/hf/tokenizer_export.py), and its special-token ids into config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainer.checkpoint.checks import check_checkpoint_dir
from trainer.hf.checkpoints import check_matches, checkpoint_sections, load_checkpoint_params
from trainer.hf.lora_export import lora_run_config, merged_params
from trainer.hf.outputs import check_output
from trainer.hf.safetensors_io import OutTensor, write_hf_safetensors
from trainer.hf.tokenizer_export import export_tokenizer
from trainer.io.staging import staged_dir


def hf_tensors(params: dict, plan, dtype: str) -> list[OutTensor]:
    """The HF tensors of `params`, each produced on demand from its slice of a param leaf."""
    from trainer.model.hf import get_leaf

    out = []
    for leaf in plan:
        for piece in leaf.pieces:

            def produce(leaf=leaf, piece=piece):
                return piece.to_hf(np.asarray(get_leaf(params, leaf.path)[piece.index]))

            out.append(OutTensor(piece.hf_name, piece.hf_shape(leaf.piece_shape(piece)), dtype, produce))
    return out


def trainer_to_hf(
    ckpt,
    output_dir,
    *,
    model: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
) -> Path:
    """Write config.json + safetensors (+ the tokenizer, where exportable) of a checkpoint; returns output_dir.

    Everything that can be checked without reading an array is, first: the checkpoint directory, the
    output, the model config and its HF equivalent, and the stored shapes against that config. A LoRA
    checkpoint (adapters only) is written merged into its recorded base (`trainer.hf.lora_export`)."""
    from trainer.model.hf import hf_config, tensor_plan

    ckpt = check_checkpoint_dir(ckpt)
    output_dir = check_output(output_dir, overwrite=overwrite, flag="--output-dir", inputs=[ckpt])
    cfg, data, _ = checkpoint_sections(ckpt, model)
    dtype = dtype or cfg.weight_dtype
    config = hf_config(cfg, dtype)  # raises before anything is written if cfg has no HF equivalent
    plan = tensor_plan(cfg)
    lora_run = None if model else lora_run_config(ckpt)
    if lora_run is not None:  # adapters only: the merged model, W + scale * A B over the recorded base
        params = merged_params(ckpt, lora_run)
    else:
        check_matches(ckpt, cfg, model)
        params = load_checkpoint_params(ckpt, cfg)
    with staged_dir(output_dir, overwrite=overwrite) as staging:
        config.update(export_tokenizer(data, ckpt, staging))
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_hf_safetensors(staging, hf_tensors(params, plan, dtype), max_shard_bytes)
    return output_dir
