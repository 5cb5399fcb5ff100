"""Load a RunConfig: base YAML, then the model preset, then `key=value` overrides.

Every layer is checked against the schema (unknown keys get a did-you-mean), values are coerced to the
field's type, derived values are filled in by `derive`, and `validate` collects every problem so the
user sees them all at once, before any device work.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from trainer.config.derive import derive
from trainer.config.errors import ConfigError
from trainer.config.schema import RunConfig, flat_fields, section_classes
from trainer.config.validate import validate

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def configs_dir() -> Path:
    """Where named configs live: $TRAINER_CONFIGS_DIR, else the repository's configs/."""
    return Path(os.environ.get("TRAINER_CONFIGS_DIR", REPO_CONFIGS))


def resolve_config_path(name: str) -> Path:
    """A config argument is a path if one exists, else a name inside configs/."""
    path = Path(name)
    if path.is_file():
        return path
    candidate = configs_dir() / name
    if candidate.is_file():
        return candidate
    raise ConfigError(f"config file {name!r} not found (looked at {path.resolve()} and {candidate})")


def resolve_model_path(model: str) -> Path:
    """`model=` is a preset name in configs/models/ or a path to a model YAML."""
    path = Path(model)
    if model.endswith((".yml", ".yaml")) and path.is_file():
        return path
    candidate = configs_dir() / "models" / f"{model}.yml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in (configs_dir() / "models").glob("*.yml"))
    hint = difflib.get_close_matches(model, known, n=1)
    extra = f"; did you mean {hint[0]!r}?" if hint else ""
    raise ConfigError(f"unknown model preset {model!r}{extra} Known presets: {', '.join(known)}")


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value, got {type(data).__name__}")
    return data


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings; values are parsed as YAML scalars (`1e-3`, `true`, `[a, b]`)."""
    out: dict[str, Any] = {}
    for arg in args:
        k, sep, v = arg.partition("=")
        if not sep or not k:
            raise ConfigError(f"argument {arg!r} is not key=value (e.g. steps=100)")
        try:
            out[k.strip()] = yaml.safe_load(v) if v != "" else ""
        except yaml.YAMLError:
            out[k.strip()] = v
    return out


def _check_keys(layer: Mapping[str, Any], source: str) -> None:
    known = flat_fields()
    for k in layer:
        if k not in known:
            hint = difflib.get_close_matches(k, list(known), n=1, cutoff=0.6)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(f"unknown config key {k!r} in {source}{extra}")


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Coerce a YAML value to the type of the field's default, or explain why it cannot be."""
    kind = type(default)
    bad = ConfigError(f"config key {name!r}: expected {kind.__name__}, got {value!r} ({type(value).__name__})")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if kind is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if kind is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if kind is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    if kind is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise bad
    raise bad


def build(flat: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a flat mapping of known keys (missing keys take their defaults)."""
    _check_keys(flat, "config")
    fields = flat_fields()
    per_section: dict[str, dict[str, Any]] = {s: {} for s in section_classes()}
    for k, v in flat.items():
        section, f = fields[k]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        per_section[section][k] = _coerce(k, v, default)
    return RunConfig(**{s: cls(**per_section[s]) for s, cls in section_classes().items()})


def to_flat_dict(cfg: RunConfig) -> dict[str, Any]:
    """Flat key -> value, the inverse of `build`."""
    out: dict[str, Any] = {}
    for section in section_classes():
        out.update(dataclasses.asdict(getattr(cfg, section)))
    return out


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML, grouped by section (what --print-config shows)."""
    lines = []
    for section in section_classes():
        lines.append(f"# --- {section} ---")
        sub = dataclasses.asdict(getattr(cfg, section))
        lines.append(yaml.safe_dump(sub, sort_keys=False, default_flow_style=False).rstrip())
    return "\n".join(lines) + "\n"


def load_config(config_arg: str, overrides: Iterable[str] = (), *, now: float | None = None) -> RunConfig:
    """base YAML -> model preset -> CLI overrides -> typed, derived, validated RunConfig."""
    base_path = resolve_config_path(config_arg)
    base = read_yaml(base_path)
    _check_keys(base, str(base_path))
    cli = parse_overrides(overrides)
    _check_keys(cli, "command-line overrides")
    model = cli.get("model", base.get("model", flat_fields()["model"][1].default))
    preset_path = resolve_model_path(str(model))
    preset = read_yaml(preset_path)
    _check_keys(preset, str(preset_path))
    merged = {**base, **preset, **cli}
    cfg = derive(build(merged), now=now)
    validate(cfg)
    return cfg


def load_resolved(path: Path | str) -> RunConfig:
    """Read back a resolved config.yml written to a run directory (no preset layering)."""
    return build(read_yaml(Path(path)))
