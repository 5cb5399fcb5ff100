"""A LoRA run's checkpoint for Hugging Face: a PEFT adapter directory, and the merged full model.

A LoRA checkpoint step (`lora_rank > 0` in the config it records) holds the adapters and their optimizer
state only; its base is named by the `lora_base` record in its metadata (`trainer.checkpoint.base_identity`):
the load_parameters_path and its content hash, or the init seed.

- `lora_to_peft`: adapter_config.json + adapter_model.safetensors, which `peft.PeftModel.from_pretrained`
  loads over the base exported with `trainer-to-hf` (names and layout: `trainer.model.lora.peft_tensors`).
- `merged_params`: the base with each targeted W replaced by W + scale * A B, for `trainer-to-hf`; the
  base is read from its recorded path and refused when its content hash differs from the record.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from trainer.checkpoint.checks import check_checkpoint_dir
from trainer.config.schema import LoraConfig, ModelConfig
from trainer.errors import UserInputError
from trainer.hf.checkpoints import _recorded_config, load_checkpoint_params
from trainer.hf.outputs import check_output
from trainer.hf.safetensors_io import OutTensor, write_safetensors
from trainer.io.paths import resolve
from trainer.io.staging import staged_dir

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoraSections:
    """The sections of the config a LoRA checkpoint recorded that its export needs."""

    model: ModelConfig
    lora: LoraConfig


def lora_run_config(ckpt) -> LoraSections | None:
    """The model and LoRA sections a LoRA checkpoint recorded, or None when it is not one (full training,
    params-only)."""
    meta = resolve(ckpt) / "metadata" / "metadata"
    if not meta.is_file():
        return None
    recorded = _recorded_config(ckpt)
    return LoraSections(recorded.model, recorded.lora) if recorded.lora.lora_rank > 0 else None


def _base_record(ckpt) -> dict:
    from trainer.checkpoint import base_identity

    meta = json.loads((resolve(ckpt) / "metadata" / "metadata").read_text())
    record = meta.get(base_identity.RECORD_KEY)
    if record is None:
        raise UserInputError(
            f"{ckpt}: a LoRA checkpoint without a {base_identity.RECORD_KEY} record in its metadata"
        )
    return record


def load_adapters(ckpt, run) -> dict:
    """The adapters of a LoRA checkpoint on the host CPU device (the optimizer state is not read)."""
    import jax

    from trainer.checkpoint import load_parameters
    from trainer.model import lora

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), lora.abstract_adapters(run.model, run.lora)
    )
    return load_parameters(resolve(ckpt), target)


def load_base(ckpt, run) -> dict:
    """The frozen base a LoRA checkpoint was trained over, on the host CPU device: read from the recorded
    load_parameters_path (refused when its content hash is not the recorded one), or initialised from the
    recorded init seed as the run did."""
    import jax

    from trainer.checkpoint import base_identity

    record = _base_record(ckpt)
    path = record.get("load_parameters_path")
    if not path:
        from trainer.model import init_params

        with jax.default_device(jax.devices("cpu")[0]):
            return jax.jit(lambda r: init_params(run.model, r))(jax.random.key(record["init_weights_seed"]))
    check_checkpoint_dir(path, flag="the recorded load_parameters_path")
    found = base_identity.content_sha256(path)
    if found != record["sha256"]:
        raise UserInputError(
            f"{ckpt} was trained over {path} with sha256 {record['sha256'][:12]}..., which now holds "
            f"sha256 {found[:12]}...: put the original base back at that path"
        )
    return load_checkpoint_params(path, run.model)


def merged_params(ckpt, run) -> dict:
    """The base merged with the checkpoint's adapters (W + scale * A B), as numpy arrays."""
    import jax

    from trainer.model import lora

    merged = lora.merge(load_base(ckpt, run), load_adapters(ckpt, run), run.model, run.lora)
    return jax.tree.map(np.asarray, merged)


def lora_to_peft(ckpt, output_dir, *, overwrite: bool = False) -> Path:
    """Write a PEFT adapter directory (adapter_config.json, adapter_model.safetensors, float32) of a LoRA
    checkpoint; returns output_dir."""
    from trainer.model import lora

    ckpt = check_checkpoint_dir(ckpt)
    output_dir = check_output(output_dir, overwrite=overwrite, flag="--output-dir", inputs=[ckpt])
    run = lora_run_config(ckpt)
    if run is None:
        raise UserInputError(
            f"{ckpt} is not a LoRA checkpoint (its recorded config has lora_rank=0 or none): export it with "
            "trainer-to-hf"
        )
    record = _base_record(ckpt)
    config = lora.peft_config(run.model, run.lora, record.get("load_parameters_path") or "")
    tensors = lora.peft_tensors(load_adapters(ckpt, run), run.model, run.lora)
    out = [
        OutTensor(name, tuple(a.shape), "float32", lambda a=a: a.astype(np.float32))
        for name, a in sorted(tensors.items())
    ]
    with staged_dir(output_dir, overwrite=overwrite) as staging:
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_safetensors(staging / ADAPTER_WEIGHTS, out)
    return output_dir
