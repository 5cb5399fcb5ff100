"""High-bandwidth GPU networking on GKE (jobset-gpu --gpu-networking): what GKE's GPUDirect-TCPXO (A3 Mega)
and GPUDirect-RDMA (A3 Ultra, A4) guides add to a pod."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scripts.deploy.manifest import env_list

if TYPE_CHECKING:
    from scripts.deploy.params import DeployParams

# The --gpu-networking modes; gpu_networking() renders each.
GPU_NETWORKING = ("none", "tcpxo", "rdma")
# GPUDirect-TCPXO (A3 Mega): "Maximize GPU network bandwidth in Standard mode clusters",
# https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx
TCPXO_DOC = "https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx"
TCPXO_INSTALLER = (
    "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/master/"
    "gpudirect-tcpxo/nccl-tcpxo-installer.yaml"
)
# The RxDM (tcpxo-daemon) release of GPUDirect-TCPXO's release notes (container-engine-accelerators
# gpudirect-tcpxo/README.md, Jan 9, 2026); it must match the cluster's NCCL plugin installer release.
TCPXO_DAEMON_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.21"
# GPUDirect-RDMA (A3 Ultra, A4): "Create a custom AI-optimized GKE cluster which uses A4 or A3 Ultra",
# https://cloud.google.com/ai-hypercomputer/docs/create/gke-ai-hypercompute-custom
RDMA_DOC = "https://cloud.google.com/ai-hypercomputer/docs/create/gke-ai-hypercompute-custom"
RDMA_INSTALLER = (
    "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/master/"
    "gpudirect-rdma/nccl-rdma-installer.yaml"
)
GPU_NETWORKING_ACCELERATORS = {"tcpxo": ("nvidia-h100-mega-80gb",), "rdma": ("nvidia-h200-141gb", "nvidia-b200")}


@dataclass(frozen=True)
class GpuNetworking:
    """What one --gpu-networking mode adds to a jobset-gpu pod, as the GKE guide of that mode (`doc`) has it:
    the pod annotations that attach the node's GPU NICs (GKE multi-networking: the cluster's Network objects
    `networks`), volumes, native sidecars, the trainer's env and mounts, and the NCCL settings its prelude sources.
    The NCCL plugin itself comes from the guide's installer DaemonSet, applied once per cluster."""

    mode: str
    doc: str = ""
    installer: str = ""
    networks: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    volumes: tuple[dict, ...] = ()
    sidecars: tuple[dict, ...] = ()
    trainer_env: tuple[tuple[str, str], ...] = ()
    trainer_mounts: tuple[dict, ...] = ()
    nccl_profile: str = ""


def _interfaces(networks: Sequence[str]) -> str:
    """The networking.gke.io/interfaces annotation: eth<i> on the i-th network, in GKE's guides' JSON layout."""
    rows = [f'  {{"interfaceName":"eth{i}","network":"{n}"}}' for i, n in enumerate(networks)]
    return "[\n" + ",\n".join(rows) + "\n]\n"


def _host_path(name: str, path: str) -> dict:
    return {"name": name, "hostPath": {"path": path}}


def gpu_networking(p: DeployParams) -> GpuNetworking:
    """--gpu-networking: none, or GKE's GPUDirect setup for the node's machine type.

    tcpxo (A3 Mega, GPUDirect-TCPXO), from "Maximize GPU network bandwidth in Standard mode clusters" (TCPXO_DOC)
    and the GPUDirect-TCPXO release notes and best practices it links (GoogleCloudPlatform/
    container-engine-accelerators gpudirect-tcpxo/): the eight GPU NICs on networks vpc1..vpc8, the RxDM
    (tcpxo-daemon) as a native sidecar so the Job completes when the trainer does, the GPUs' device files
    for it, /dev/aperture_devices for the trainer, and `source ${NCCL_LIB_DIR}/nccl-env-profile.sh`.
    rdma (A3 Ultra, A4, GPUDirect-RDMA), from "Create a custom AI-optimized GKE cluster which uses A4 or A3
    Ultra" (RDMA_DOC): networks gvnic-1 and rdma-0..rdma-7, the host's NVIDIA and gIB libraries, and
    `source /usr/local/gib/scripts/set_nccl_env.sh`.
    """
    if p.gpu_networking == "tcpxo":
        gpus = [f"/dev/nvidia{i}" for i in range(8)]
        devices = [*gpus, "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/dmabuf_import_helper"]
        networks = ("default", *(f"vpc{i}" for i in range(1, 9)))
        rxdm = {
            "name": "tcpxo-daemon",
            "image": p.tcpxo_daemon_image,
            "imagePullPolicy": "Always",
            "restartPolicy": "Always",  # a native sidecar: it stops when the trainer has exited
            "command": ["/bin/sh", "-c"],
            "args": [
                "set -ex\nchmod 755 /fts/entrypoint_rxdm_container.sh\n"
                "/fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics=8\n"
            ],
            "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_BIND_SERVICE"]}},
            "volumeMounts": [
                {"name": "libraries", "mountPath": "/usr/local/nvidia"},
                {"name": "sys", "mountPath": "/hostsysfs"},
                {"name": "proc-sys", "mountPath": "/hostprocsysfs"},
            ],
            "env": env_list([("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64")]),
        }
        return GpuNetworking(
            mode="tcpxo",
            doc=TCPXO_DOC,
            installer=TCPXO_INSTALLER,
            networks=networks[1:],
            annotations={
                "devices.gke.io/container.tcpxo-daemon": "".join(f"- path: {d}\n" for d in devices),
                "networking.gke.io/default-interface": "eth0",
                "networking.gke.io/interfaces": _interfaces(networks),
            },
            volumes=(
                _host_path("libraries", "/home/kubernetes/bin/nvidia"),
                _host_path("sys", "/sys"),
                _host_path("proc-sys", "/proc/sys"),
                _host_path("aperture-devices", "/dev/aperture_devices"),
            ),
            sidecars=(rxdm,),
            trainer_env=(
                ("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"),
                ("NCCL_LIB_DIR", "/usr/local/nvidia/lib64"),
                ("NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY", "/dev/aperture_devices"),
            ),
            trainer_mounts=({"name": "aperture-devices", "mountPath": "/dev/aperture_devices"},),
            nccl_profile='source "${NCCL_LIB_DIR}/nccl-env-profile.sh"',
        )
    if p.gpu_networking == "rdma":
        networks = ("default", "gvnic-1", *(f"rdma-{i}" for i in range(8)))
        return GpuNetworking(
            mode="rdma",
            doc=RDMA_DOC,
            installer=RDMA_INSTALLER,
            networks=networks[1:],
            annotations={
                "networking.gke.io/default-interface": "eth0",
                "networking.gke.io/interfaces": _interfaces(networks),
            },
            volumes=(
                _host_path("library-dir-host", "/home/kubernetes/bin/nvidia"),
                _host_path("gib", "/home/kubernetes/bin/gib"),
            ),
            trainer_env=(("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"),),
            trainer_mounts=(
                {"name": "library-dir-host", "mountPath": "/usr/local/nvidia"},
                {"name": "gib", "mountPath": "/usr/local/gib"},
            ),
            nccl_profile="source /usr/local/gib/scripts/set_nccl_env.sh",
        )
    return GpuNetworking(mode="none")


def networking_header(net: GpuNetworking) -> list[str]:
    if net.mode == "none":
        return [
            "# GPU networking: the pod network only (--gpu-networking: tcpxo on A3 Mega, rdma on A3 Ultra, A4)."
        ]
    return [
        f"# GPU networking: GPUDirect-{net.mode.upper()}, as GKE's guide has it: {net.doc}",
        f"#   once per cluster: the NCCL plugin installer, kubectl apply -f {net.installer}",
        f"#   and the GKE Network objects {', '.join(net.networks)} (their names are the guide's);",
        "#   in the pod: the annotations that attach the node's NICs; the prelude sources",
        f"#   {net.nccl_profile.split()[-1]} (NCCL's settings for the plugin).",
    ]
