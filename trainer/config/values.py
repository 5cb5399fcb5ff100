"""Typing config values by the schema, before any YAML guessing.

A value arrives as text (the command line, a scalar in a YAML file) or as a Python value (a list in a
YAML file, a dict passed to `build`). Text is parsed by the key's declared type, never by YAML's rules:
a string key takes the literal text (`run_name=007` stays "007", `prompt=yes` stays "yes"), an int is
decimal (`steps=010` is 10; `steps=1e3` is 1000), a float must be finite, a bool is true/false
(yes/no, on/off, 1/0). Only list-typed keys are parsed as YAML (`[a, b]`).

`Number` is the kind of a key that counts whole things but also takes a fraction of one
(`per_device_batch_size=0.5`: one sequence per two chips). The schema has no union types, so rather than
make such a key a float (`2` would print, dump and compare as `2.0`), its kind parses any finite decimal
number and keeps a whole value an int: `2`, `2.0` and `2e0` are the int 2, `0.5` is the float 0.5.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from trainer.config.errors import ConfigError

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_INT = re.compile(r"[+-]?\d[\d_]*")


class Number:
    """The kind of a key that takes a whole number or a decimal fraction (see the module docstring); a key
    declares it with `key(..., number=True)` in the schema."""


def kind_name(kind: type) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "text", list: "a list"}[kind]


def _whole_as_int(value: float) -> int | float:
    return int(value) if value.is_integer() else value


def _bad(name: str, kind: type, value: Any, hint: str = "") -> ConfigError:
    return ConfigError(f"config key {name!r}: expected {kind_name(kind)}, got {value!r}{hint}")


def _int_from_text(name: str, text: str) -> int:
    t = text.strip()
    if _INT.fullmatch(t):
        return int(t.replace("_", ""), 10)
    try:
        f = float(t)
    except ValueError:
        raise _bad(name, int, text) from None
    if math.isfinite(f) and f.is_integer():
        return int(f)
    raise _bad(name, int, text, f" (a whole number, e.g. {name}={int(f) if math.isfinite(f) else 100})")


def _float_from_text(name: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise _bad(name, float, text, " (e.g. 3e-4 or 0.0003)") from None
    return _finite(name, value)


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ConfigError(
            f"config key {name!r}: {value!r} is not a finite number (a value like 1e400 "
            "overflows to inf); give a finite value"
        )
    return value


def from_text(name: str, text: str, kind: type) -> Any:
    """Parse the text of one value (command line or YAML scalar) as the key's type."""
    if kind is str:
        return text
    if kind is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise _bad(name, bool, text)
    if kind is int:
        return _int_from_text(name, text)
    if kind is float:
        return _float_from_text(name, text)
    if kind is Number:
        return _whole_as_int(_float_from_text(name, text))
    if kind is list:
        try:
            value = yaml.safe_load(text) if text.strip() else []
        except yaml.YAMLError as e:
            raise ConfigError(f"config key {name!r}: {text!r} is not a YAML list: {e}") from None
        return coerce(name, value, kind)
    raise _bad(name, kind, text)


def coerce(name: str, value: Any, kind: type) -> Any:
    """A Python value (from a YAML collection or code) as the key's type, or a ConfigError saying why not."""
    if isinstance(value, str) and kind is not str:
        return from_text(name, value, kind)
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise _bad(name, kind, value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(name, kind, value)
        if isinstance(value, float):
            if not (math.isfinite(value) and value.is_integer()):
                raise _bad(name, kind, value)
            return int(value)
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(name, kind, value)
        return _finite(name, float(value))
    if kind is Number:
        number = coerce(name, value, float)  # refuses booleans, text and non-finite values
        return value if isinstance(value, int) else _whole_as_int(number)
    if kind is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list, tuple)):
            raise _bad(name, kind, value, " (quote it)")
        return str(value)
    if kind is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        if value is None:
            return []
        raise _bad(name, kind, value)
    raise _bad(name, kind, value)
