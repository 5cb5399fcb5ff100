"""slurm: an sbatch script running the same multi-process JAX run under Slurm (pyxis containers)."""

from __future__ import annotations

import shlex

from scripts.deploy.artefact import Rendered, artefact_header
from scripts.deploy.graceful_stop import STOP_MARGIN_SECONDS, grace_seconds
from scripts.deploy.multiprocess_env import multiprocess_env
from scripts.deploy.params import DeployParams
from scripts.deploy.shell_template import fill, load_template
from scripts.deploy.trainer_command import prepare


def pyxis_image(image: str) -> str:
    """pyxis/enroot spell a registry image `registry#repository:tag` (e.g. nvcr.io#nvidia/jax:25.04)."""
    first, sep, rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost") and "#" not in image:
        return f"{first}#{rest}"
    return image


def render_slurm(p: DeployParams) -> Rendered:
    argv, warnings, stop = prepare(p, single_controller=False, check=p.check_multiprocess)
    if p.spot:
        warnings.append(
            "--capacity spot is GKE's: the Slurm script only shares the trainer's shorter stop_timeout_seconds "
            f"({stop:g}); --signal gives it {grace_seconds(stop)} s before the time limit"
        )
    if p.gpu_networking != "none":
        warnings.append(f"--gpu-networking={p.gpu_networking} is GKE's: the Slurm script does not apply it")
    exports = [
        f"export {k}={shlex.quote(v)}"
        for k, v in multiprocess_env(p)
        if k not in ("JAX_NUM_PROCESSES", "NODES_PER_SLICE")
    ]
    # Shared-filesystem outputs must be visible inside the pyxis container at the same path.
    shared = [d.rstrip("/") for d in dict.fromkeys((p.output_dir, p.cache_dir)) if d.startswith("/")]
    mounts = [d for d in shared if not any(d.startswith(o + "/") for o in shared)]
    values = {
        "header": artefact_header("slurm", p),
        "platform": p.platform,
        "name": p.job_name,
        "num_nodes": str(p.num_processes),
        "gpu_sbatch": [f"#SBATCH --gpus-per-node={p.gpus_per_node}"] if p.platform == "gpu" else [],
        "container_image": shlex.quote(pyxis_image(p.image)),
        "container_mounts": shlex.quote(",".join(f"{d}:{d}" for d in mounts)),
        "shared_dirs": " ".join(shlex.quote(d) for d in shared),
        "nodes_per_slice": str(p.nodes_per_slice),
        "max_task_restarts": str(p.max_task_restarts),
        "max_restarts": str(p.max_restarts),
        "max_preemptions": str(p.max_preemptions),
        "restart_backoff_seconds": str(p.restart_backoff_seconds),
        "grace_seconds": str(grace_seconds(stop)),
        "stop_timeout": f"{stop:g}",
        "stop_margin": str(STOP_MARGIN_SECONDS),
        "coordinator_port": str(p.coordinator_port),
        "exports": exports,
        "trainer_argv": " ".join(shlex.quote(a) for a in argv),
    }
    text = fill(load_template("slurm.sbatch.tmpl"), values)
    return Rendered("slurm", f"{p.job_name}.sbatch", text, argv, warnings)
