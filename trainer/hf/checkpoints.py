"""This trainer's side of a conversion: which model a checkpoint holds, its params read, params saved.

A checkpoint's model config (and the tokenizer and sharding rules it was trained with) comes from --model,
the run config a training checkpoint records, or the model.yml hf-to-trainer writes; params are read onto
the host CPU (Orbax's shape errors reworded for a user) and saved params-only in place (no second copy of
the model).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from trainer.checkpoint.checks import check_params_match
from trainer.errors import UserInputError
from trainer.hf.errors import why
from trainer.io.paths import resolve

MODEL_FIX = (
    "--model must be the model the checkpoint was trained with (omit --model to use the config "
    "the checkpoint records)"
)
RECORDED_FIX = "the config recorded with the checkpoint does not describe its params; pass --model explicitly"


def _recorded_config(ckpt, model: str | None = None):
    """The config a checkpoint was made with: --model if given (base.yml with that model), else the training
    run's resolved config (metadata/metadata), else base.yml with the model.yml next to an hf-to-trainer
    checkpoint. Callers take the sections they need from it."""
    from trainer.config import ConfigError, build, load_config

    if model:
        return load_config("base.yml", [f"model={model}"])
    ckpt = resolve(ckpt)
    meta = ckpt / "metadata" / "metadata"
    if meta.is_file():
        try:
            return build(json.loads(meta.read_text())["config"])
        except (ValueError, KeyError, TypeError) as e:  # ConfigError is a ValueError
            kind = "ConfigError" if isinstance(e, ConfigError) else "unreadable"
            raise UserInputError(
                f"{meta}: the run config recorded in the checkpoint does not load "
                f"({kind}: {why(e)}); pass --model PRESET_OR_YAML of the model it was "
                f"trained with"
            ) from None
    if (ckpt / "model.yml").is_file():
        return load_config("base.yml", [f"model={ckpt / 'model.yml'}"])
    raise UserInputError(
        f"cannot tell the model config of {ckpt}: it has no metadata/metadata (a training "
        f"checkpoint step dir) and no model.yml (hf-to-trainer); pass --model PRESET_OR_YAML"
    )


def checkpoint_model_config(ckpt, model: str | None = None):
    """The ModelConfig of a checkpoint: --model if given, else the training run's resolved config
    (metadata/metadata), else model.yml next to an hf-to-trainer checkpoint."""
    return _recorded_config(ckpt, model).model


def checkpoint_sections(ckpt, model: str | None = None):
    """(ModelConfig, DataConfig, MeshConfig) a checkpoint was made with, from the same source as
    `checkpoint_model_config`: the tokenizer (tokenizer_path, tokenizer_type, add_bos) and the sharding rules
    the run used come with the model."""
    cfg = _recorded_config(ckpt, model)
    return cfg.model, cfg.data, cfg.mesh


def check_matches(ckpt, cfg, model: str | None) -> None:
    """The checkpoint's stored shapes fit `cfg` (from headers, no array read); the fix names --model when
    it was given, else says the recorded config is wrong."""
    check_params_match(ckpt, cfg, fix=MODEL_FIX if model else RECORDED_FIX)


def load_checkpoint_params(ckpt, cfg) -> dict:
    """Params of a checkpoint (full or params-only) on the host CPU device."""
    import jax

    from trainer.checkpoint import load_parameters
    from trainer.model import abstract_params

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), abstract_params(cfg))
    try:
        return load_parameters(resolve(ckpt), target)
    except ValueError as e:  # the pre-check missed it (no metadata): Orbax's shape check, reworded
        found = re.search(r"Requested shape: (\(.*?\)) is not compatible with the stored shape: (\(.*?\))", str(e))
        if not found:
            raise
        raise UserInputError(
            f"{resolve(ckpt)} does not match the model config: a tensor is stored as "
            f"{found.group(2)} but the model config needs {found.group(1)}; the model config "
            f"must be the one the checkpoint was trained with"
        ) from None


def save_params(staging: Path, params) -> None:
    """A params-only checkpoint of numpy `params` at the (empty) staging directory, saved in place.

    Orbax creates the checkpoint directory itself (through a `<dir>.orbax-checkpoint-tmp-*` sibling it
    renames), so the empty staging directory is handed over to it, and a failed save's sibling, which
    staged_dir does not know about, is removed here."""
    from trainer.checkpoint import save_parameters

    staging.rmdir()
    try:
        save_parameters(staging, params, in_place=True)  # numpy params: no second copy
    except BaseException:
        for leftover in staging.parent.glob(f"{staging.name}.orbax-checkpoint-tmp*"):
            shutil.rmtree(leftover, ignore_errors=True)
        raise
