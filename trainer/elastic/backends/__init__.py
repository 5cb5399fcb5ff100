"""The backend a job runs on, chosen once per process from the `cluster` key, before JAX starts.

    auto       several processes -> processes; else enable_single_controller -> pathways; else local
    local      one process, its devices grouped into virtual slices (`trainer.elastic.backends.local`)
    pathways   one controller that sees every slice (`trainer.elastic.backends.pathways`)
    processes  several processes joined by jax.distributed (`trainer.elastic.backends.processes`)

Each backend is one module holding one `Backend` (`trainer.elastic.backends.backend`), which builds
everything that depends on the machines: the slices, the cluster the supervisor retries on, the host
snapshots, the periods the job may plan, whether the silent-data-corruption check can run, the stop and
the heartbeat, the slow-step host times. Another backend is one more module and one more entry in
`BACKENDS`. A job that cannot be the backend its config asks for stops in `open_backend` with a
ConfigError (exit 2) naming the key and the fix.
"""

from __future__ import annotations

from trainer.distributed.init import DistributedSettings
from trainer.elastic.backends.backend import Backend, BackendSpec
from trainer.elastic.backends.local import LocalBackend
from trainer.elastic.backends.pathways import PathwaysBackend
from trainer.elastic.backends.processes import ProcessesBackend

BACKENDS: dict[str, type[Backend]] = {
    LocalBackend.name: LocalBackend,
    PathwaysBackend.name: PathwaysBackend,
    ProcessesBackend.name: ProcessesBackend,
}


def resolve(cluster: str, settings: DistributedSettings, *, single_controller: bool) -> str:
    """The backend's name: `cluster` itself, or what `auto` means for this job."""
    if cluster != "auto":
        return cluster
    if settings.multi_process:
        return ProcessesBackend.name
    return PathwaysBackend.name if single_controller else LocalBackend.name


def open_backend(spec: BackendSpec) -> Backend:
    """The job's backend (raises ConfigError when the job cannot be the one the config asks for)."""
    name = resolve(spec.cluster, spec.settings, single_controller=spec.mesh.enable_single_controller)
    return BACKENDS[name](spec)


__all__ = ["BACKENDS", "Backend", "BackendSpec", "open_backend", "resolve"]
