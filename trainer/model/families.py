"""The model families, keyed by the `model_family` config value: the one place that names them.

    family_of(cfg)               -> the ModelFamily of cfg.model_family
    family_of_hf(config, source) -> (ModelFamily, model_type) of a Hugging Face config.json

A new family is a package `trainer/model/<family>/` with a `FAMILY`, one entry here and its name among
the `model_family` choices of `trainer/config/schema.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.config.schema import ModelConfig
from trainer.model import llama3, qwen3
from trainer.model.family import ModelFamily
from trainer.model.hf_format import HfFormatError

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (qwen3.FAMILY, llama3.FAMILY)}


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family whose decoder, FLOPs and Hugging Face mapping `cfg` is read by."""
    try:
        return FAMILIES[cfg.model_family]
    except KeyError:
        raise ValueError(
            f"model_family={cfg.model_family!r} is not a model family; use one of {', '.join(FAMILIES)}"
        ) from None


def family_of_hf(hf: Mapping[str, Any], source: str = "config.json") -> tuple[ModelFamily, str]:
    """(family, model_type) of a config.json, told by its `model_type` and checked against its
    `architectures`; HfFormatError naming both and what is supported when no family reads it."""
    if not isinstance(hf, Mapping):
        raise HfFormatError(f"{source} holds a JSON {type(hf).__name__}, not an object of config keys")
    by_type = {t: (f, arch) for f in FAMILIES.values() for t, arch in f.hf.architectures.items()}
    known = {arch: t for t, (_, arch) in by_type.items()}
    supported = ", ".join(known)
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for arch in archs:
        if arch not in known:
            raise HfFormatError(
                f"unsupported architecture {arch!r} (model_type {model_type!r}) in {source}; "
                f"supported: {supported}"
            )
    if model_type not in by_type:
        raise HfFormatError(
            f"unsupported model_type {model_type!r} in {source} (architectures {archs}); supported: {supported}"
        )
    if archs and known[archs[0]] != model_type:
        raise HfFormatError(f"{source}: architectures {archs} does not match model_type {model_type!r}")
    return by_type[model_type][0], model_type
