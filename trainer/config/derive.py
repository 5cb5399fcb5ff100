"""Derived config values, computed in one place from the user's values."""
from __future__ import annotations

import dataclasses
import time

from trainer.config.schema import RunConfig


def derive(cfg: RunConfig, *, now: float | None = None) -> RunConfig:
    """Fill in values that follow from others (`-1` = follow another key, empty run name)."""
    train, optim, mesh = cfg.train, cfg.optim, cfg.mesh
    if not train.run_name:
        stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(time.time() if now is None else now))
        train = dataclasses.replace(train, run_name=f"run_{stamp}")
    if optim.learning_rate_schedule_steps == -1:
        optim = dataclasses.replace(optim, learning_rate_schedule_steps=train.steps)
    if mesh.dcn_data_parallelism == -1:
        mesh = dataclasses.replace(mesh, dcn_data_parallelism=mesh.num_slices)
    return dataclasses.replace(cfg, train=train, optim=optim, mesh=mesh)
