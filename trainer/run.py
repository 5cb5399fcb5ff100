"""Run a resolved config: devices -> slices -> attempt(s) -> loop. The elastic supervisor wraps attempts."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Callable

import jax

from trainer.attempt import build_attempt
from trainer.config.schema import RunConfig
from trainer.loop import train_loop
from trainer.observe.rundir import RunPaths
from trainer.observe.sinks import JsonlSink, LogSink, Sinks, TensorBoardSink
from trainer.parallel.mesh import group_into_slices

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunOutcome:
    final_step: int
    preempted: bool


def make_sinks(cfg: RunConfig, run_dir: Path) -> Sinks:
    """metrics.jsonl and the log always; TensorBoard when enabled."""
    sinks = [JsonlSink(run_dir / "metrics.jsonl"), LogSink(cfg.observe.log_period)]
    if cfg.observe.enable_tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    return Sinks(sinks)


def setup_runtime(cfg: RunConfig) -> None:
    """Process-wide JAX setup, once, before any device is touched."""
    if cfg.mesh.enable_single_controller:
        import pathwaysutils

        pathwaysutils.initialize()  # Pathways proxy backend: one controller sees every slice
    if cfg.train.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.train.jax_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def run(cfg: RunConfig, *, paths: RunPaths, events, stop_requested: Callable[[], bool] = lambda: False) -> RunOutcome:
    setup_runtime(cfg)
    slices = group_into_slices(jax.devices(), cfg.mesh.num_slices)
    with contextlib.closing(make_sinks(cfg, paths.local)) as sinks:
        if cfg.elastic.elastic_enabled:
            from trainer.elastic.supervisor import run_elastic

            return run_elastic(cfg, slices, paths=paths, events=events, sinks=sinks, stop_requested=stop_requested)
        attempt = build_attempt(cfg, slices, checkpoint_dir=paths.checkpoints, events=events,
                                total_slices=len(slices))
        with contextlib.closing(attempt):
            events.emit("attempt_start", attempt=1, start_step=attempt.start_step, source=attempt.restored_from,
                        slices=list(range(len(slices))), global_batch_size=attempt.plan.global_batch_size,
                        micro_steps=attempt.plan.micro_steps, lr_scale=attempt.plan.lr_scale, steps_rewound=0)
            result = train_loop(attempt, sinks, events, steps=cfg.train.steps, stop_requested=stop_requested)
        return RunOutcome(result.final_step, result.preempted)
