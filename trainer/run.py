"""Run a resolved config: runtime setup -> devices grouped into slices -> the supervisor runs the attempts."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import jax

from trainer.config.schema import RunConfig
from trainer.distributed import DistributedSettings, initialize, leave, process_slices, resolve_settings
from trainer.elastic.supervisor import run_supervised
from trainer.io.paths import resolve
from trainer.loop import LoopResult
from trainer.observe.rundir import RunPaths
from trainer.observe.sinks import JsonlSink, LogSink, ProgressSink, Sinks, TensorBoardSink
from trainer.parallel.mesh import group_into_slices

log = logging.getLogger(__name__)


def make_sinks(cfg: RunConfig, run_dir: Path, *, stderr: TextIO | None = None) -> Sinks:
    """metrics.jsonl always; a live progress line when stderr is a terminal, else a log line every
    log_period steps; TensorBoard when enabled."""
    stderr = sys.stderr if stderr is None else stderr
    console = ProgressSink(cfg.train.steps, stream=stderr) if stderr.isatty() else LogSink(cfg.observe.log_period)
    sinks = [JsonlSink(run_dir / "metrics.jsonl"), console]
    if cfg.observe.enable_tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    return Sinks(sinks)


def setup_runtime(cfg: RunConfig) -> DistributedSettings:
    """Process-wide JAX setup, once, before any device is touched (several processes: join the job first)."""
    settings = resolve_settings(cfg.distributed)
    if settings.multi_process:
        initialize(settings, fault_tolerant=cfg.elastic.elastic_enabled)
    if cfg.mesh.enable_single_controller:
        import pathwaysutils

        pathwaysutils.initialize()  # Pathways proxy backend: one controller sees every slice
    if cfg.train.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(resolve(cfg.train.jax_cache_dir)))
        # Cache the train step, init and snapshot copies, not every small eager op.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return settings


def run(
    cfg: RunConfig, *, paths: RunPaths, events, stop_requested: Callable[[], bool] = lambda: False
) -> LoopResult:
    settings = setup_runtime(cfg)
    membership = None
    try:
        if settings.multi_process:  # one slice per group of processes; membership agreed across them
            slices, membership = process_slices(cfg, settings, events)
        else:
            slices = group_into_slices(jax.devices(), cfg.mesh.num_slices)
        with contextlib.closing(make_sinks(cfg, paths.local)) as sinks:
            return run_supervised(
                cfg,
                slices,
                paths=paths,
                events=events,
                sinks=sinks,
                stop_requested=stop_requested,
                membership=membership,
            )
    finally:
        if settings.multi_process:
            leave(settings)  # process 0 last: its exit takes the coordination service down
