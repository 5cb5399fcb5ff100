"""The targets: one module each, every one a function DeployParams -> Rendered."""

from __future__ import annotations

from collections.abc import Callable

from scripts.deploy.artefact import Rendered
from scripts.deploy.errors import DeployError
from scripts.deploy.params import DeployParams
from scripts.deploy.targets.jobset_gpu import render_jobset_gpu
from scripts.deploy.targets.jobset_pathways import render_jobset_pathways
from scripts.deploy.targets.pathwaysjob import render_pathwaysjob
from scripts.deploy.targets.slurm import render_slurm
from scripts.deploy.targets.xpk import render_xpk

RENDERERS: dict[str, Callable[[DeployParams], Rendered]] = {
    "jobset-pathways": render_jobset_pathways,
    "pathwaysjob": render_pathwaysjob,
    "xpk": render_xpk,
    "jobset-gpu": render_jobset_gpu,
    "slurm": render_slurm,
}


def render(target: str, p: DeployParams) -> Rendered:
    if target not in RENDERERS:
        raise DeployError(f"unknown target {target!r}; choose from {', '.join(RENDERERS)}")
    return RENDERERS[target](p)
