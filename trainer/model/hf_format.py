"""Reading a Hugging Face config.json: the error type and the value readers every family's mapping shares.

A family's `hf.py` translates its config.json keys with these, so a missing, mistyped or unsupported
value is reported the same way whatever the family: `HfFormatError` naming the key and the file (given
as `source`). Pure: no file I/O, nothing of the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trainer.errors import UserInputError


class HfFormatError(UserInputError):
    """An unsupported architecture or config, or a checkpoint that does not match it (names the tensor).

    A user input error: the converter's CLI reports it on one line and exits 2."""


def positive_int(hf: Mapping[str, Any], name: str, source: str, default: int | None = None) -> int:
    """A positive integer key; required unless `default` is given. 4.0 is accepted, 4.5 and "4" are not
    (int() would silently truncate or parse them)."""
    value = hf.get(name)
    if value is None:
        if default is None:
            raise HfFormatError(f"{source} has no {name!r} (every config.json of this architecture sets it)")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise HfFormatError(f"{source}: {name}={value!r} must be a positive integer")
    return int(value)


def number(value: Any, name: str, source: str) -> float:
    """A finite number (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HfFormatError(f"{source}: {name}={value!r} must be a number")
    return float(value)


def rope_section(hf: Mapping[str, Any], source: str) -> tuple[str, Mapping[str, Any]]:
    """(its key, the RoPE parameters): `rope_parameters` (transformers 5) or `rope_scaling` (4.x), {} if
    neither; a value that is not an object is an error naming its key."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(key) or {}
    if not isinstance(rope, Mapping):
        raise HfFormatError(f"{source} {key}={rope!r} must be an object")
    return key, rope


def rope_type(rope: Mapping[str, Any]) -> str:
    """The RoPE type of a rope section (`rope_type`, or 4.x's older `type`; `default` when absent)."""
    return rope.get("rope_type", rope.get("type", "default"))


def rope_theta(hf: Mapping[str, Any], source: str) -> float:
    """RoPE theta: under rope_parameters / rope_scaling, else top-level `rope_theta`, else 10000."""
    _, rope = rope_section(hf, source)
    return number(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)), "rope_theta", source)


def reject_unsupported(hf: Mapping[str, Any], source: str, **unsupported: str) -> None:
    """HfFormatError for the first key in `unsupported` (key -> what it would mean) set to a true value."""
    for key, why in unsupported.items():
        if hf.get(key):
            raise HfFormatError(f"{source} {key}={hf.get(key)!r}: {why} is not supported")


def reject_common(hf: Mapping[str, Any], source: str) -> None:
    """What no family here supports: another activation than SiLU, attention biases, a quantized checkpoint."""
    if hf.get("hidden_act", "silu") != "silu":
        raise HfFormatError(
            f"{source} hidden_act={hf.get('hidden_act')!r}: an activation other than silu is not supported"
        )
    reject_unsupported(
        hf, source, attention_bias="attention with biases", quantization_config="a quantized checkpoint"
    )
