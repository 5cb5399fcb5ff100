"""The RoPE section of a Hugging Face config.json <-> `rope_theta` and the `rope_scaling` key, for every
family (Qwen3 and Llama read and write it alike).

Read in either spelling: `rope_parameters` (transformers 5: `rope_type`, the type's parameters and
`rope_theta`) or `rope_scaling` (4.x: `rope_type` or the older `type`, with a top-level `rope_theta`).
Where transformers fills a parameter in, the same value is taken here: YaRN's and llama3's
`original_max_position_embeddings` from a top-level `original_max_position_embeddings`, else
`max_position_embeddings`; YaRN's `factor` from max_position_embeddings / original when absent,
`beta_fast` / `beta_slow` 32 / 1; `dynamic`'s original length is config.json's `max_position_embeddings`
(transformers reads no other). Written in both spellings, `rope_parameters` exactly as transformers 5
writes it, with `max_position_embeddings` the original length for `dynamic` (which transformers
computes from it) and factor * original for `yarn` (the length transformers checks the factor against).
Another RoPE type (longrope, ...), partial rotary embeddings, or a bad value raise `HfFormatError`
naming the key and the file (`source`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.config.rope_scaling import (
    DynamicRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    RopeScaling,
    YarnRopeScaling,
    given_parameters,
)
from trainer.model.hf_format import HfFormatError, number, positive_int, rope_section, rope_type

DEFAULT = "default"


def scaling_from_hf(hf: Mapping[str, Any], source: str, family: str) -> RopeScaling | None:
    """The RoPE scaling a config.json describes: None for default RoPE; HfFormatError for anything else
    this trainer cannot run (`family` names the architecture in the message)."""
    key, rope = rope_section(hf, source)
    where = f"{source} {key}"
    for section, name in ((hf, source), (rope, where)):
        partial = section.get("partial_rotary_factor")
        if partial is not None and number(partial, "partial_rotary_factor", name) != 1.0:
            raise HfFormatError(
                f"{name}: partial_rotary_factor={partial!r}: partial rotary embeddings are not supported"
            )
    kind = rope_type(rope)
    if kind == DEFAULT:
        return None
    read = _READERS.get(kind)
    if read is None:
        raise HfFormatError(
            f"{where}: rope_type {kind!r} is not supported for {family} (one of {', '.join([DEFAULT, *_READERS])})"
        )
    scaling = read(hf, rope, where)
    if scaling.problems():
        raise HfFormatError(f"{where}: " + "; ".join(scaling.problems()))
    return scaling


def rope_config(scaling: RopeScaling | None, theta: float, max_position_embeddings: int) -> dict[str, Any]:
    """The config.json keys for RoPE: `rope_parameters`, `rope_scaling`, `rope_theta` and
    `max_position_embeddings` (the family's published context unless the scaling sets it)."""
    params: dict[str, Any] = {}
    if scaling is not None:
        params = {"rope_type": scaling.type, **given_parameters(scaling)}
    if isinstance(scaling, DynamicRopeScaling):
        max_position_embeddings = params.pop("original_max_position_embeddings")
    elif isinstance(scaling, YarnRopeScaling):
        max_position_embeddings = round(scaling.factor * scaling.original_max_position_embeddings)
    return {
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": DEFAULT, **params, "rope_theta": theta},
        "rope_scaling": params or None,
    }


def _factor(rope: Mapping[str, Any], where: str, kind: str) -> float:
    if rope.get("factor") is None:
        raise HfFormatError(f"{where} has no 'factor' (rope_type {kind} needs it)")
    return number(rope["factor"], "factor", where)


def _original(hf: Mapping[str, Any], rope: Mapping[str, Any], where: str, kind: str) -> int:
    """original_max_position_embeddings as transformers standardizes it (top level, the section, or
    max_position_embeddings)."""
    for section in (hf, rope):
        if section.get("original_max_position_embeddings") is not None:
            return positive_int(section, "original_max_position_embeddings", where)
    if hf.get("max_position_embeddings") is None:
        raise HfFormatError(
            f"{where} has no 'original_max_position_embeddings' and the file no 'max_position_embeddings' "
            f"(rope_type {kind} needs the original context)"
        )
    return positive_int(hf, "max_position_embeddings", where)


def _linear(hf: Mapping[str, Any], rope: Mapping[str, Any], where: str) -> LinearRopeScaling:
    return LinearRopeScaling(factor=_factor(rope, where, "linear"))


def _dynamic(hf: Mapping[str, Any], rope: Mapping[str, Any], where: str) -> DynamicRopeScaling:
    if hf.get("max_position_embeddings") is None:
        raise HfFormatError(
            f"{where}: rope_type dynamic needs the file's 'max_position_embeddings' (its original context)"
        )
    original = positive_int(hf, "max_position_embeddings", where)
    return DynamicRopeScaling(factor=_factor(rope, where, "dynamic"), original_max_position_embeddings=original)


def _optional(rope: Mapping[str, Any], name: str, where: str) -> float | None:
    """A YaRN parameter transformers treats as absent when null (attention_factor) or falsy (the mscales)."""
    value = rope.get(name)
    if value is None or (name != "attention_factor" and not value):
        return None
    return number(value, name, where)


def _yarn(hf: Mapping[str, Any], rope: Mapping[str, Any], where: str) -> YarnRopeScaling:
    original = _original(hf, rope, where, "yarn")
    if rope.get("factor") is None:
        factor = positive_int(hf, "max_position_embeddings", where) / original
    else:
        factor = number(rope["factor"], "factor", where)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise HfFormatError(f"{where}: truncate={truncate!r} must be true or false")
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=number(rope.get("beta_fast") or 32, "beta_fast", where),
        beta_slow=number(rope.get("beta_slow") or 1, "beta_slow", where),
        attention_factor=_optional(rope, "attention_factor", where),
        mscale=_optional(rope, "mscale", where),
        mscale_all_dim=_optional(rope, "mscale_all_dim", where),
        truncate=truncate,
    )


def _llama3(hf: Mapping[str, Any], rope: Mapping[str, Any], where: str) -> Llama3RopeScaling:
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if rope.get(name) is None:
            raise HfFormatError(f"{where} has no {name!r} (rope_type llama3 needs it)")
    return Llama3RopeScaling(
        factor=number(rope["factor"], "factor", where),
        low_freq_factor=number(rope["low_freq_factor"], "low_freq_factor", where),
        high_freq_factor=number(rope["high_freq_factor"], "high_freq_factor", where),
        original_max_position_embeddings=_original(hf, rope, where, "llama3"),
    )


_READERS = {"linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3}
