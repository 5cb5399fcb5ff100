"""Resources of the trainer container (--trainer-cpu, --trainer-memory, --trainer-ephemeral-storage): the
Pathways head's Guaranteed QoS (requests == limits) and the multi-process pods' requests."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scripts.deploy.params import DeployParams

# Resources of the trainer container. Pathways head (jobset-pathways, pathwaysjob): requests == limits, with
# the sidecars' (resource manager PATHWAYS_RM_RESOURCES, proxy --proxy-cpu/--proxy-memory) the head pod is
# Guaranteed QoS; 16 + 8 + 16 CPUs and 64 + 32 + 100 GB fit an n2-standard-64 node of the CPU node pool.
# Multi-process (jobset-gpu): requests only (the pod may use the rest of its node), per GPU on GPU nodes.
PATHWAYS_TRAINER_RESOURCES = {"cpu": "16", "memory": "64G", "ephemeral-storage": "20Gi"}
PATHWAYS_RM_RESOURCES = {"cpu": "8", "memory": "32G"}
MULTIPROCESS_CPU_PER_GPU = 2
MULTIPROCESS_MEMORY_GI_PER_GPU = 8
RESOURCE_FLAGS = {
    "cpu": "--trainer-cpu",
    "memory": "--trainer-memory",
    "ephemeral-storage": "--trainer-ephemeral-storage",
}
QUANTITY_RE = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")


def guaranteed(quantities: Mapping[str, str]) -> dict:
    """Container resources with requests == limits (a pod whose every container has them for cpu and memory
    is of QoS class Guaranteed: evicted last under node pressure)."""
    return {"requests": dict(quantities), "limits": dict(quantities)}


def pathways_trainer_resources(p: DeployParams) -> dict:
    """The trainer on the Pathways head pod: requests == limits (--trainer-cpu, --trainer-memory,
    --trainer-ephemeral-storage; PATHWAYS_TRAINER_RESOURCES by default)."""
    d = PATHWAYS_TRAINER_RESOURCES
    return guaranteed(
        {
            "cpu": p.trainer_cpu or d["cpu"],
            "memory": p.trainer_memory or d["memory"],
            "ephemeral-storage": p.trainer_ephemeral_storage or d["ephemeral-storage"],
        }
    )


def multiprocess_trainer_resources(p: DeployParams) -> dict:
    """A multi-process trainer pod (jobset-gpu): cpu and memory requests (by default MULTIPROCESS_*_PER_GPU per
    GPU, as for one GPU on CPU nodes), ephemeral-storage only when given, and on GPU nodes the GPUs as a limit."""
    n = p.gpus_per_node if p.platform == "gpu" else 1
    requests = {
        "cpu": p.trainer_cpu or str(MULTIPROCESS_CPU_PER_GPU * n),
        "memory": p.trainer_memory or f"{MULTIPROCESS_MEMORY_GI_PER_GPU * n}Gi",
    }
    if p.trainer_ephemeral_storage:
        requests["ephemeral-storage"] = p.trainer_ephemeral_storage
    resources: dict = {"requests": requests}
    if p.platform == "gpu":
        resources["limits"] = {"nvidia.com/gpu": str(p.gpus_per_node)}
    return resources


def quantities_text(resources: Mapping) -> str:
    """`cpu=16 memory=64G` from a container's resources (its limits, else its requests)."""
    values = resources.get("limits") or resources.get("requests") or {}
    return " ".join(f"{k}={v}" for k, v in values.items() if k != "nvidia.com/gpu")
