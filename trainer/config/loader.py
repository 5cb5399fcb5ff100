"""Load a RunConfig from its layers: configs/base.yml -> model preset -> the user's file -> `key=value`.

Each later layer wins. The preset (`configs/models/<model>.yml`, or a model YAML path) carries the
architecture; a user's config file beats anything the preset sets, and the command line beats both.
Every layer is checked against the schema (unknown keys get a did-you-mean; a key twice in a file is an
error, twice on the command line the later wins with a warning), every value is typed by the schema
(`trainer.config.values`), and `validate` collects every problem so the user sees them all at once,
before any device work.

The config is kept exactly as given: nothing derived is written back into it, so a printed or saved
config (`to_yaml`) loads again to the same RunConfig, and `explain` says which layer set each value.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from trainer.config.errors import ConfigError
from trainer.config.schema import (
    ARCHITECTURE_KEYS,
    AUTO,
    MOE_ARCHITECTURE_KEYS,
    RunConfig,
    flat_fields,
    section_classes,
)
from trainer.config.validate import validate
from trainer.config.values import Number, coerce, from_text

log = logging.getLogger(__name__)
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COMMAND_LINE = "command line"
# Keys that no longer exist: accepted with a warning while their value is the only legal one.
DEPRECATED = {
    "dcn_data_parallelism": "slices are always data-parallel replicas, so the DCN axis is num_slices; "
    "remove the key"
}


@dataclasses.dataclass(frozen=True)
class Layer:
    """One source of values: its name for messages and the typed values it sets."""

    name: str
    values: dict[str, Any]


def configs_dir() -> Path:
    """Where named configs live: $TRAINER_CONFIGS_DIR, else the repository's configs/."""
    return Path(os.environ.get("TRAINER_CONFIGS_DIR", REPO_CONFIGS))


def resolve_config_path(name: str) -> Path:
    """A config argument is a path if one exists, else a name inside configs/."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    candidate = configs_dir() / name
    if candidate.is_file():
        return candidate
    raise ConfigError(f"config file {name!r} not found (looked at {path.resolve()} and {candidate})")


def _looks_like_path(model: str) -> bool:
    return model.endswith((".yml", ".yaml")) or "/" in model or model.startswith("~")


def resolve_model_path(model: str) -> Path:
    """`model=` is a preset name in configs/models/ or a path to a model YAML."""
    if _looks_like_path(model):
        path = Path(model).expanduser()
        if path.is_file():
            return path
        raise ConfigError(
            f"model={model!r}: model file not found (looked at {path.resolve()}); give a "
            "preset name or the model.yml written by `python -m trainer.convert hf-to-trainer`"
        )
    candidate = configs_dir() / "models" / f"{model}.yml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in (configs_dir() / "models").glob("*.yml"))
    hint = difflib.get_close_matches(model, known, n=1)
    extra = f"; did you mean {hint[0]!r}?" if hint else ""
    raise ConfigError(f"unknown model preset {model!r}{extra} Known presets: {', '.join(known)}")


def _kind(key: str) -> type:
    f = flat_fields()[key][1]
    if f.metadata.get("number"):
        return Number
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return type(default)


def _unknown_key(k: str, source: str) -> ConfigError:
    known = list(flat_fields())
    hint = difflib.get_close_matches(k.lower(), known, n=1, cutoff=0.6)
    extra = f"; did you mean {hint[0]!r}?" if hint else ""
    return ConfigError(f"unknown config key {k!r} in {source}{extra} (every key is listed in configs/base.yml)")


def _typed(key: str, value: Any, source: str, *, text: bool) -> Any:
    """The value typed by its key's schema type (a deprecated key's value passes as given)."""
    if key in DEPRECATED:
        return value
    if key not in flat_fields():
        raise _unknown_key(key, source)
    kind = _kind(key)
    if isinstance(value, str) and value.strip().lower() == "auto" and flat_fields()[key][1].metadata.get("auto"):
        return AUTO
    return from_text(key, value, kind) if text else coerce(key, value, kind)


def read_yaml(path: Path) -> Layer:
    """A YAML file's values, typed by the schema from each scalar's own text (so `run_name: 007` is
    "007" and `steps: 010` is 10, not YAML's guesses)."""
    try:
        source = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        root = yaml.compose(source)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if root is None:
        return Layer(str(path), {})
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}: expected a mapping of key: value, got a {root.tag.rsplit(':', 1)[-1]}")
    values: dict[str, Any] = {}
    for key_node, value_node in root.value:
        k = key_node.value
        if k in values:
            raise ConfigError(f"{path}: key {k!r} is given twice (line {key_node.start_mark.line + 1}); keep one")
        if isinstance(value_node, yaml.ScalarNode):
            is_null = value_node.tag.endswith(":null") and value_node.style is None
            raw = "" if is_null else value_node.value
            values[k] = _typed(k, raw, str(path), text=True)
        else:
            values[k] = _typed(k, yaml.safe_load(yaml.serialize(value_node)), str(path), text=False)
    return Layer(str(path), values)


def parse_overrides(args: Iterable[str]) -> Layer:
    """`key=value` strings, each value typed by its key (see trainer.config.values)."""
    out: dict[str, Any] = {}
    for arg in args:
        k, sep, v = arg.partition("=")
        k = k.strip()
        if not sep or not k:
            raise ConfigError(f"argument {arg!r} is not key=value (e.g. steps=100)")
        value = _typed(k, v, COMMAND_LINE, text=True)
        if k in out and out[k] != value:  # later wins, as in every layer order; said, not silent
            log.warning(
                "config key %s is given twice on the command line (%r, then %r): using %r", k, out[k], value, value
            )
        out[k] = value
    return Layer(COMMAND_LINE, out)


def build(flat: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a flat mapping of known keys (missing keys take their defaults)."""
    fields = flat_fields()
    per_section: dict[str, dict[str, Any]] = {s: {} for s in section_classes()}
    if any(k in DEPRECATED for k in flat):  # configs saved by older versions (checkpoint metadata)
        flat = _drop_deprecated(dict(flat), [Layer("config", dict(flat))])
    for k, v in flat.items():
        if k not in fields:
            raise _unknown_key(k, "config")
        per_section[fields[k][0]][k] = coerce(k, v, _kind(k))
    return RunConfig(**{s: cls(**per_section[s]) for s, cls in section_classes().items()})


def _drop_deprecated(merged: dict[str, Any], layers: list[Layer]) -> dict[str, Any]:
    out = dict(merged)
    for key, why in DEPRECATED.items():
        if key not in out:
            continue
        value = out.pop(key)
        where = next(layer.name for layer in reversed(layers) if key in layer.values)
        slices = out.get("num_slices", 1)
        if value not in (-1, slices, str(slices), "-1"):
            raise ConfigError(f"{key}={value!r} (in {where}) is no longer a config key: {why}")
        log.warning("config key %s (in %s) is deprecated and ignored: %s", key, where, why)
    return out


def load_layers(config_arg: str = "base.yml", overrides: Iterable[str] = ()) -> list[Layer]:
    """The layers in the order they apply: base.yml, the model preset, the user's file (when the config
    argument is not base.yml itself), the command line."""
    base_path = configs_dir() / "base.yml"
    base = read_yaml(base_path)
    user_path = resolve_config_path(config_arg)
    user = None if user_path.resolve() == base_path.resolve() else read_yaml(user_path)
    if user is not None:
        user = Layer(config_arg, user.values)
    cli = parse_overrides(overrides)
    model = cli.values.get("model") or (user.values.get("model") if user else None) or base.values.get("model")
    model = model or flat_fields()["model"][1].default
    preset_path = resolve_model_path(str(model))
    preset = Layer(
        f"model preset {model}" if preset_path.parent == configs_dir() / "models" else f"model file {model}",
        read_yaml(preset_path).values,
    )
    if user is not None:
        _check_not_a_copy_of_base(user, base, preset)
    return [base, preset] + ([user] if user else []) + [cli]


def _check_not_a_copy_of_base(user: Layer, base: Layer, preset: Layer) -> None:
    """A user's file beats the preset, so a copy of base.yml would put base.yml's architecture (the tiny
    default's) under the preset's name. Architecture keys the file sets to base.yml's value over a preset
    that sets another stop the run; on the command line they still win."""
    copied = [
        k
        for k in (*ARCHITECTURE_KEYS, *MOE_ARCHITECTURE_KEYS)
        if k in user.values and k in preset.values and user.values[k] == base.values.get(k) != preset.values[k]
    ]
    if copied:
        sets = ", ".join(f"{k}={user.values[k]!r} (preset: {preset.values[k]!r})" for k in copied)
        raise ConfigError(
            f"{user.name} sets base.yml's own values of architecture keys over the {preset.name}: {sets}. "
            f"A copy of base.yml would train the base architecture under the preset's name: delete these keys "
            f"from {user.name} to train the preset's architecture, or pass them as key=value on the command "
            "line to override the preset on purpose"
        )


def merge(layers: list[Layer]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer.values)
    return _drop_deprecated(merged, layers)


def load_config(config_arg: str = "base.yml", overrides: Iterable[str] = ()) -> RunConfig:
    """base.yml -> model preset -> user's file -> command line: a typed, validated RunConfig."""
    cfg = build(merge(load_layers(config_arg, overrides)))
    validate(cfg)
    return cfg


def load_resolved(path: Path | str) -> RunConfig:
    """Read back a config.yml written to a run directory (or printed with --print-config)."""
    layer = read_yaml(Path(path))
    return build(_drop_deprecated(layer.values, [Layer(str(path), layer.values)]))


def to_flat_dict(cfg: RunConfig) -> dict[str, Any]:
    """Flat key -> value, the inverse of `build`."""
    out: dict[str, Any] = {}
    for section in section_classes():
        out.update(dataclasses.asdict(getattr(cfg, section)))
    return out


def _dump_one(key: str, value: Any) -> list[str]:
    text = yaml.safe_dump(
        {key: value}, sort_keys=False, default_flow_style=False, width=1 << 16, allow_unicode=True
    )
    return text.rstrip("\n").splitlines()


def to_yaml(cfg: RunConfig, sources: Mapping[str, str] | None = None) -> str:
    """The config as YAML grouped by section; loads back to the same RunConfig. With `sources`
    (key -> layer name) each value that differs from base.yml says which layer set it."""
    lines = []
    for section in section_classes():
        lines.append(f"# --- {section} ---")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            dumped = _dump_one(key, value)
            if sources and key in sources:
                dumped[0] += f"  # from {sources[key]}"
            lines.extend(dumped)
    return "\n".join(lines) + "\n"


def value_sources(layers: list[Layer]) -> dict[str, str]:
    """key -> the layer that set its final value, for keys whose value differs from base.yml."""
    base = to_flat_dict(build(_drop_deprecated(layers[0].values, layers[:1])))
    final = merge(layers)
    out = {}
    for key, value in final.items():
        if base.get(key) == value:
            continue
        out[key] = next(layer.name for layer in reversed(layers) if key in layer.values)
    return out


def load_explained(config_arg: str = "base.yml", overrides: Iterable[str] = ()) -> tuple[RunConfig, str]:
    """The validated config and its YAML with each value set above base.yml marked with its layer (what
    --print-config prints and the run directory's config.yml holds)."""
    layers = load_layers(config_arg, overrides)
    cfg = build(merge(layers))
    validate(cfg)
    return cfg, to_yaml(cfg, value_sources(layers))


def explain(config_arg: str = "base.yml", overrides: Iterable[str] = ()) -> str:
    """--print-config: the validated config, each value set by a layer above base.yml marked with it."""
    return load_explained(config_arg, overrides)[1]
