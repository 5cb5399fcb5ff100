"""What the Pathways targets (jobset-pathways, pathwaysjob, xpk) share: the Pathways images and the trainer JAX
they must match, the component ports, the trainer's env on the head pod and the command that follows its logs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from scripts.deploy.errors import DeployError
from scripts.deploy.manifest import TRAINER_CONTAINER

if TYPE_CHECKING:
    from scripts.deploy.params import DeployParams

REPO_ROOT = Path(__file__).resolve().parents[2]
# The Dockerfile's default TPU build (Python 3.11, JAX_EXTRA=tpu) installs these exact versions.
DEFAULT_TPU_CONSTRAINTS = REPO_ROOT / "constraints" / "tpu-py3.11.txt"

# Pathways component ports (the defaults the Pathways images and xpk use).
PATHWAYS_PROXY_PORT = 29000
PATHWAYS_RM_PORT = 29001
PATHWAYS_WORKER_PORT = 29005
PATHWAYS_IMAGE_REPO = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways"


def default_trainer_jax() -> str:
    """The JAX the Dockerfile's default TPU image pins (constraints/tpu-py3.11.txt)."""
    for line in DEFAULT_TPU_CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip().lower() == "jax":
            return version.split(";")[0].strip()
    raise DeployError(f"{DEFAULT_TPU_CONSTRAINTS} pins no jax: regenerate it (constraints/README.md)")


def head_logs_command(p: DeployParams) -> str:
    """`kubectl logs` of the trainer: the head pod only (the worker pods have no `trainer` container)."""
    selector = f"jobset.sigs.k8s.io/jobset-name={p.job_name},jobset.sigs.k8s.io/replicatedjob-name=pathways-head"
    return f"kubectl logs -f -l {selector} -c {TRAINER_CONTAINER}"


def pathways_trainer_env(p: DeployParams) -> list[tuple[str, str]]:
    """What the trainer needs on Pathways besides the proxy address: hosts read and write their own checkpoint
    shards instead of funnelling them through the proxy (large checkpoints otherwise exhaust the proxy's
    memory), and the shared compilation cache."""
    env = [("ENABLE_PATHWAYS_PERSISTENCE", "1")]
    if p.cache_dir:
        env.append(("JAX_COMPILATION_CACHE_DIR", p.cache_dir))
    return env
