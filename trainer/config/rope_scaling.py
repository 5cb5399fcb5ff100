"""The `rope_scaling` key: a RoPE frequency scaling, written as its type and its parameters.

    none                                            no scaling: inv_freq = theta^(-2i / head_dim)
    llama3:factor=32,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192

A type is one entry of `SCALINGS`: a frozen dataclass whose fields are its parameters, by the names
Hugging Face's `rope_scaling` / `rope_parameters` give them, all required. A new type (`linear`,
`dynamic`, `yarn`) is a dataclass here, its frequencies in `trainer/model/rope.py` and its config.json
spelling in the family's HF mapping. The text form is canonical (`rope_scaling_text`): parameters in
declaration order, numbers written so they read back exactly, so a config saved and loaded again names
the same scaling. Parsing imports nothing heavy: config validation runs it before any device work.
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
        out = [f"{name}={getattr(self, name)} must be > 0" for name in self._names() if getattr(self, name) <= 0]
        if self.high_freq_factor <= self.low_freq_factor:
            out.append(
                f"high_freq_factor={self.high_freq_factor} must exceed low_freq_factor={self.low_freq_factor} "
                "(the smoothing band between them would be empty)"
            )
        return out

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


RopeScaling = Llama3RopeScaling  # the union of SCALINGS' types (one so far)
SCALINGS: dict[str, type[RopeScaling]] = {Llama3RopeScaling.type: Llama3RopeScaling}


def _example(kind: type[RopeScaling]) -> str:
    return f"{kind.type}:" + ",".join(f"{f.name}=..." for f in dataclasses.fields(kind))


def _value(name: str, text: str, kind: type, where: str) -> float | int:
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
    values: dict[str, float | int] = {}
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
        kind_of_value = int if fields[key].type in (int, "int") else float
        values[key] = _value(key, raw.strip(), kind_of_value, f"{source}={text!r}")
    missing = [n for n in fields if n not in values]
    if missing:
        raise ConfigError(
            f"{source}={text!r}: {kind.type} needs {', '.join(missing)} too; write it as {_example(kind)}"
        )
    scaling = kind(**values)
    problems = scaling.problems()
    if problems:
        raise ConfigError(f"{source}={text!r}: " + "; ".join(problems))
    return scaling


def rope_scaling_text(scaling: RopeScaling | None) -> str:
    """The canonical `rope_scaling` value of `scaling` (parse_rope_scaling's inverse)."""
    if scaling is None:
        return NONE
    params = ",".join(f"{f.name}={getattr(scaling, f.name)!r}" for f in dataclasses.fields(scaling))
    return f"{scaling.type}:{params}"
