"""The trainer command: built once from the parameters, checked with the trainer's own config loader (a bad key
fails here, with the loader's message, not on the cluster), and embedded unchanged in every artefact."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from scripts.deploy.errors import DeployError
from scripts.deploy.graceful_stop import check_spot_fit
from scripts.deploy.params import DeployParams
from trainer.config import load_config

TRAINER_ENTRY = ["python", "-m", "trainer.train"]


def _yaml_bool(b: bool) -> str:
    return "true" if b else "false"


def trainer_argv(p: DeployParams, *, single_controller: bool) -> list[str]:
    """`python -m trainer.train CONFIG key=value ...` for this run, as an argv list (logging JSON lines;
    an override log_format=... comes later and wins)."""
    argv = [
        *TRAINER_ENTRY,
        p.config,
        f"model={p.model}",
        f"num_slices={p.slices}",
        f"enable_single_controller={_yaml_bool(single_controller)}",
        f"elastic_enabled={_yaml_bool(p.elastic)}",
    ]
    if p.elastic:
        argv += [
            f"elastic_min_slice_count={p.min_slices}",
            f"elastic_timeout_seconds={float(p.elastic_timeout_seconds)!r}",
            f"elastic_max_retries={p.elastic_max_retries}",
        ]
    argv += [
        f"checkpoint_period={p.checkpoint_period}",
        f"base_output_directory={p.output_dir}",
        f"run_name={p.run_name}",
        "log_format=json",  # one JSON object per line with its severity: what Cloud Logging and collectors index
    ]
    if p.cache_dir:
        argv.append(f"jax_cache_dir={p.cache_dir}")
    if p.metrics_port:
        argv.append(f"metrics_port={p.metrics_port}")
    if p.spot and p.explicit_stop_timeout is None:  # the stop that fits Spot's notice (spot_stop_timeout)
        argv.append(f"stop_timeout_seconds={p.spot_stop_timeout}")
    return argv + list(p.overrides)


def check_trainer_argv(argv: Sequence[str], p: DeployParams | None = None):
    """Load the argv's config with the trainer's loader (raises ConfigError) and return the RunConfig."""
    argv = list(argv)
    if argv[: len(TRAINER_ENTRY)] != TRAINER_ENTRY or len(argv) <= len(TRAINER_ENTRY):
        raise DeployError(f"not a trainer command: {argv!r}")
    cfg = load_config(argv[len(TRAINER_ENTRY)], argv[len(TRAINER_ENTRY) + 1 :])
    if p is not None:  # every path and name must reach the trainer exactly as given
        for key, want, got in (
            ("run_name", p.run_name, cfg.train.run_name),
            ("base_output_directory", p.output_dir, cfg.train.base_output_directory),
            ("jax_cache_dir", p.cache_dir, cfg.train.jax_cache_dir),
        ):
            if want != got:
                raise DeployError(f"{key}={want!r} reads back as {got!r}; choose another value")
    return cfg


def trainer_stop_timeout(p: DeployParams, cfg) -> float:
    """stop_timeout_seconds as the trainer resolves it (its config file, then the overrides); from a loader
    without the key, the last override or DEFAULT_STOP_TIMEOUT_SECONDS."""
    for section in dataclasses.fields(cfg) if dataclasses.is_dataclass(cfg) else ():
        value = getattr(getattr(cfg, section.name), "stop_timeout_seconds", None)
        if value is not None:
            return float(value)
    return p.stop_timeout_seconds


def prepare(p: DeployParams, *, single_controller: bool, check: Callable[[], list[str]]):
    """Common checks, then the trainer command through the trainer's loader (its message wins), then the
    target's own checks. Returns (argv, warnings, the trainer's stop_timeout_seconds)."""
    warnings = p.check_common()
    argv = trainer_argv(p, single_controller=single_controller)
    cfg = check_trainer_argv(argv, p)
    stop = trainer_stop_timeout(p, cfg)
    check_spot_fit(p, stop)
    return argv, warnings + check(), stop
