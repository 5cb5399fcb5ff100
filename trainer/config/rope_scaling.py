"""The `rope_scaling` key: a RoPE frequency scaling, written as its type and its parameters.

    none                                            no scaling: inv_freq = theta^(-2i / head_dim)
    linear:factor=4.0
    dynamic:factor=2.0,original_max_position_embeddings=4096
    yarn:factor=4.0,original_max_position_embeddings=32768,beta_fast=32.0,beta_slow=1.0
    yarn:factor=4.0,...,beta_slow=1.0,attention_factor=1.1,mscale=1.0,mscale_all_dim=1.0,truncate=false
    llama3:factor=32,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192

A type is one entry of `SCALINGS`: a frozen dataclass whose fields are its parameters, by the names
Hugging Face's `rope_scaling` / `rope_parameters` give them. A field without a default is required; a
field with one is optional (yarn's `attention_factor`, `mscale`, `mscale_all_dim`: None = not given;
`truncate`: true). A new type is a dataclass here, its frequencies in `trainer/model/rope.py` and its
config.json spelling in `trainer/model/hf_rope.py`.

The text form is canonical (`rope_scaling_text`): the required parameters in declaration order, then the
optional ones that differ from their default, in declaration order; numbers written so they read back
exactly (`repr`), booleans as `true` / `false`. So a config saved and loaded again names the same scaling,
and the canonical text of a parsed canonical text is itself. Parsing imports nothing heavy: config
validation runs it before any device work.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from dataclasses import dataclass
from typing import ClassVar

from trainer.config.errors import ConfigError

NONE = "none"


def _positive(scaling, *names: str) -> list[str]:
    """A problem for each named parameter that is given (not None) and not > 0."""
    values = {n: getattr(scaling, n) for n in names}
    return [f"{n}={v} must be > 0" for n, v in values.items() if v is not None and v <= 0]


def _stretches(factor: float) -> list[str]:
    return [] if factor >= 1 else [f"factor={factor} must be >= 1 (the scaling stretches the context by it)"]


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (Hugging Face rope_type "linear"): every frequency divided by `factor`."""

    type: ClassVar[str] = "linear"
    factor: float

    def problems(self) -> list[str]:
        return _stretches(self.factor)


@dataclass(frozen=True)
class DynamicRopeScaling:
    """Dynamic NTK (Hugging Face rope_type "dynamic"): for a sequence of length L longer than
    original_max_position_embeddings, theta becomes theta * (factor * L / original - (factor - 1)) ^
    (head_dim / (head_dim - 2)); at most the original length, RoPE is unscaled. L is the static length of
    the forward (`trainer/model/rope.py` says which); Hugging Face reads the original length from
    config.json's `max_position_embeddings`."""

    type: ClassVar[str] = "dynamic"
    factor: float
    original_max_position_embeddings: int

    def problems(self) -> list[str]:
        return _stretches(self.factor) + _positive(self, "original_max_position_embeddings")


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (Hugging Face rope_type "yarn"): frequencies that rotate fewer than `beta_slow` times over
    original_max_position_embeddings divided by `factor`, more than `beta_fast` times kept, a linear ramp
    between (its ends floored / ceiled when `truncate`); cos and sin multiplied by the attention factor:
    `attention_factor` if given, else (0.1 * mscale * ln factor + 1) / (0.1 * mscale_all_dim * ln factor
    + 1) when both mscales are given, else 0.1 * ln factor + 1."""

    type: ClassVar[str] = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def problems(self) -> list[str]:
        out = _stretches(self.factor) + _positive(
            self, "original_max_position_embeddings", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"
        )
        if self.beta_fast < self.beta_slow:
            out.append(
                f"beta_fast={self.beta_fast} must be >= beta_slow={self.beta_slow} (beta_fast bounds the "
                "frequencies kept, beta_slow those interpolated)"
            )
        return out


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent scaling (Hugging Face rope_type "llama3"): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    original_max_position_embeddings / high_freq_factor kept, the band between interpolated smoothly."""

    type: ClassVar[str] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def problems(self) -> list[str]:
        out = _positive(self, *(f.name for f in dataclasses.fields(self)))
        if self.high_freq_factor <= self.low_freq_factor:
            out.append(
                f"high_freq_factor={self.high_freq_factor} must exceed low_freq_factor={self.low_freq_factor} "
                "(the smoothing band between them would be empty)"
            )
        return out


RopeScaling = LinearRopeScaling | DynamicRopeScaling | YarnRopeScaling | Llama3RopeScaling
SCALINGS: dict[str, type[RopeScaling]] = {
    kind.type: kind for kind in (LinearRopeScaling, DynamicRopeScaling, YarnRopeScaling, Llama3RopeScaling)
}


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING


def _value_kind(field: dataclasses.Field) -> type:
    """int, float or bool: the field's annotation (a string under postponed evaluation) less `| None`."""
    name = str(field.type).replace(" | None", "").strip()
    return {"int": int, "float": float, "bool": bool}[name]


def _example(kind: type[RopeScaling]) -> str:
    fields = dataclasses.fields(kind)
    required = [f"{f.name}=..." for f in fields if _required(f)]
    optional = [f.name for f in fields if not _required(f)]
    return f"{kind.type}:" + ",".join(required) + (f" (optional: {', '.join(optional)})" if optional else "")


def _value(name: str, text: str, kind: type, where: str) -> float | int | bool:
    if kind is bool:
        if text not in ("true", "false"):
            raise ConfigError(f"{where}: {name}={text!r} must be true or false")
        return text == "true"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (kind is int and not value.is_integer()):
        what = "a whole number" if kind is int else "a finite number"
        raise ConfigError(f"{where}: {name}={text!r} must be {what}")
    return int(value) if kind is int else value


@functools.lru_cache(maxsize=64)
def parse_rope_scaling(text: str, source: str = "rope_scaling") -> RopeScaling | None:
    """`none` -> None; `TYPE:name=value,...` -> that type's parameters; a ConfigError naming the bad part."""
    text = text.strip()
    if text in ("", NONE):
        return None
    name, _, params = text.partition(":")
    kind = SCALINGS.get(name.strip())
    if kind is None:
        known = ", ".join([NONE, *SCALINGS])
        raise ConfigError(f"{source}={text!r}: unknown scaling type {name.strip()!r}; known: {known}")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    values: dict[str, float | int | bool] = {}
    for item in (p.strip() for p in params.split(",") if p.strip()):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(
                f"{source}={text!r}: {item!r} is not a parameter of {kind.type} ({', '.join(fields)}){extra}"
            )
        if key in values:
            raise ConfigError(f"{source}={text!r}: {key} is given twice")
        values[key] = _value(key, raw.strip(), _value_kind(fields[key]), f"{source}={text!r}")
    missing = [n for n, f in fields.items() if _required(f) and n not in values]
    if missing:
        raise ConfigError(
            f"{source}={text!r}: {kind.type} needs {', '.join(missing)} too; write it as {_example(kind)}"
        )
    scaling = kind(**values)
    problems = scaling.problems()
    if problems:
        raise ConfigError(f"{source}={text!r}: " + "; ".join(problems))
    return scaling


def _text(value: float | int | bool) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def given_parameters(scaling: RopeScaling) -> dict[str, float | int | bool]:
    """The parameters the canonical text writes, by name, in its order: the required ones, then the
    optional ones not at their default (also what a config.json carries)."""
    fields = dataclasses.fields(scaling)
    shown = [f for f in fields if _required(f)]
    shown += [f for f in fields if not _required(f) and getattr(scaling, f.name) != f.default]
    return {f.name: getattr(scaling, f.name) for f in shown}


def rope_scaling_text(scaling: RopeScaling | None) -> str:
    """The canonical `rope_scaling` value of `scaling` (parse_rope_scaling's inverse)."""
    if scaling is None:
        return NONE
    params = ",".join(f"{name}={_text(value)}" for name, value in given_parameters(scaling).items())
    return f"{scaling.type}:{params}"
