"""Render the deployment artefacts of one run from ONE parameter set.

    python -m scripts.deploy.render TARGET --slices 3 --image IMAGE --run-name R --output-dir gs://B/runs \\
        [--model qwen3-0.6b] [options] [-o FILE_OR_DIR] [-- key=value ...]

TARGET is one of:
  jobset-pathways  JobSet manifest: Pathways head (trainer + resource manager + proxy) + one worker Job per slice
  pathwaysjob      PathwaysJob manifest (pathways-job.pathways.domain/v1): Pathways on GKE through the PathwaysJob
                   controller; it cannot express the trainer's exit-code contract (a warning says what is lost)
  xpk              shell script wrapping `xpk workload create-pathways` (Pathways on GKE, TPU); refused without
                   --accept-xpk-failure-policy: xpk's JobSet fails the workload on any non-zero trainer exit
  jobset-gpu       JobSet manifest: multi-process JAX on GPU (or CPU, --platform cpu) with fault-tolerance settings
  slurm            sbatch script: the same multi-process JAX run under Slurm
  all              every artefact above, written into the directory given by -o (xpk only when accepted)

The trainer command is built once (`trainer_argv`) from the parameters, checked with the project's own
config loader (a bad key fails here, with the loader's message, not on the cluster) and embedded
unchanged in every artefact. Keys after `--` are extra trainer overrides (e.g. steps=5000).
The Kubernetes manifests are Python dicts dumped with PyYAML (`manifest_text`); tests/test_deploy.py checks
them against the vendored CRD schemas (tests/fixtures/crds/) and Kubernetes' own. The shell scripts (xpk,
slurm) are filled from scripts/deploy/templates/, whose `{{name}}` placeholders take a value inline or,
alone on their line, a block of lines indented like the placeholder.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shlex
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
if (
    str(REPO_ROOT) not in sys.path
):  # `python scripts/deploy/render.py` as well as `python -m scripts.deploy.render`
    sys.path.insert(0, str(REPO_ROOT))

from trainer.config import ConfigError, load_config  # noqa: E402
from trainer.distributed.internals import VersionError, check_pathways_image, pathways_image_jax  # noqa: E402
from trainer.errors import (  # noqa: E402
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_GAVE_UP,
    EXIT_PREEMPTED,
    EXIT_TRANSIENT,
)

TEMPLATES = Path(__file__).resolve().parent / "templates"
# The Dockerfile's default TPU build (PYTHON_VERSION=3.11, JAX_EXTRA=tpu) installs these exact versions.
DEFAULT_TPU_CONSTRAINTS = REPO_ROOT / "constraints" / "tpu-py3.11.txt"


def default_trainer_jax() -> str:
    """The JAX the Dockerfile's default TPU image pins (constraints/tpu-py3.11.txt)."""
    for line in DEFAULT_TPU_CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip().lower() == "jax":
            return version.split(";")[0].strip()
    raise DeployError(f"{DEFAULT_TPU_CONSTRAINTS} pins no jax: regenerate it (constraints/README.md)")


TRAINER_ENTRY = ["python", "-m", "trainer.train"]

# The exit-code contract (trainer/errors.py) as every artefact applies it to the trainer's processes:
PREEMPTED_EXIT_CODES = (EXIT_PREEMPTED,)  # stopped from outside, state saved: restart, using no budget
FINAL_EXIT_CODES = (EXIT_BAD_INPUT, EXIT_GAVE_UP)  # a restart cannot help: fail at once
BUG_EXIT_CODES = (EXIT_FAILED,)  # restart the whole run a few times (--max-restarts), then fail
# Every other non-zero code restarts the one process from a generous counted budget (--max-task-restarts):
# EXIT_TRANSIENT, and the codes of a death the trainer did not choose (137 SIGKILL or OOM-kill, 134 SIGABRT,
# 139 SIGSEGV, 143 a SIGTERM that arrived before the trainer's handler).
TRANSIENT_EXIT_CODES = (EXIT_TRANSIENT,)
FOREIGN_EXIT_CODES = (137, 134, 139, 143)
TRAINER_CONTAINER = "trainer"  # the container that runs the trainer in the Kubernetes manifests
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PATHWAYSJOB_API = "pathways-job.pathways.domain/v1"
# The PathwaysJob release whose CRD and controller the pathwaysjob target follows (tests/fixtures/crds/).
PATHWAYSJOB_RELEASE = "v0.1.4"
PATHWAYSJOB_INSTALL = (
    f"https://github.com/google/pathways-job/releases/download/{PATHWAYSJOB_RELEASE}/install.yaml"
)
PATHWAYSJOB_INELASTIC_SLICE_RESTARTS = 4  # its worker backoffLimit is hosts x this without elasticSlices

# The trainer stops within stop_timeout_seconds of a SIGTERM; every pod that runs it gets that much plus a
# margin before Kubernetes kills it (terminationGracePeriodSeconds), and Slurm sends its notice that early.
DEFAULT_STOP_TIMEOUT_SECONDS = 20  # mirrors the default of the trainer key stop_timeout_seconds
STOP_MARGIN_SECONDS = 10
KUBERNETES_DEFAULT_GRACE_SECONDS = 30  # terminationGracePeriodSeconds of a pod that does not set it

# Capacity (--capacity). GKE Spot: "By default, GKE clusters give Pods a 30-second graceful termination period
# after the preemption notice: the first 15 seconds to shut down your Pods, the next 15 for critical system
# Pods" (https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms, Termination and graceful shutdown of
# Spot VMs; GKE 1.35.0-gke.1171000+ Standard node pools and custom ComputeClasses can extend the period to
# 120 s: --spot-grace-seconds). Under Spot the trainer's stop fits that: its pods claim at most the grace
# GKE gives, with a shorter margin.
CAPACITIES = ("on-demand", "spot")
SPOT_NODE_LABEL = "cloud.google.com/gke-spot"  # GKE's node label of Spot nodes (Standard and Autopilot)
DEFAULT_SPOT_GRACE_SECONDS = 15
SPOT_STOP_MARGIN_SECONDS = 5

# xpk (`xpk workload create-pathways`) renders the Pathways JobSet itself; what that costs the exit-code contract.
XPK_ACCEPT_FLAG = "--accept-xpk-failure-policy"
XPK_FAILURE_POLICY = (
    "xpk builds the Pathways JobSet itself with failurePolicy restartStrategy Recreate and no maxRestarts "
    "(templates/pathways_workload_create.yaml.j2): the --max-restarts the script passes does nothing, and any "
    "non-zero exit of the trainer (42 preempted, 75 transient, a crash) or an eviction of its pod fails the whole "
    "workload"
)
XPK_FIX = (
    f"deploy with the jobset-pathways target (the whole exit-code contract), or pass {XPK_ACCEPT_FLAG} to write "
    "the xpk script anyway"
)

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
_QUANTITY_RE = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")

# High-bandwidth GPU networking on GKE (jobset-gpu --gpu-networking); gpu_networking() renders each mode.
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

# Pathways component ports (the defaults the Pathways images and xpk use).
PATHWAYS_PROXY_PORT = 29000
PATHWAYS_RM_PORT = 29001
PATHWAYS_WORKER_PORT = 29005
PATHWAYS_IMAGE_REPO = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways"
# JobSet's annotation: one Job per value of this node label (the head alone on its node, a slice per node pool).
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"

# Trainer keys the renderer sets from its own flags; overriding them after `--` would make the trainer
# disagree with the manifest around it (slice count, controller mode, output location).
MANAGED_KEYS = {
    "model": "--model",
    "num_slices": "--slices",
    "enable_single_controller": "the target (Pathways targets set it true, multi-process targets false)",
    "elastic_enabled": "--no-elastic",
    "elastic_min_slice_count": "--min-slices",
    "elastic_timeout_seconds": "--elastic-timeout",
    "elastic_max_retries": "--elastic-max-retries",
    "checkpoint_period": "--checkpoint-period",
    "base_output_directory": "--output-dir",
    "run_name": "--run-name",
    "jax_cache_dir": "--compile-cache",
}

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LEN = 40  # pod hostnames <name>-pathways-head-0-0 must stay within 63 characters


class DeployError(ValueError):
    """Parameters that cannot make a working deployment."""


# ---------------------------------------------------------------------------------------------------
# TPU slice shapes (xpk's --tpu-type names). Multi-host slices have 4 chips per host.
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TpuSlice:
    tpu_type: str  # xpk --tpu-type, e.g. v5litepod-16
    pathways_version: str  # Pathways resource manager instance type prefix, e.g. tpuv5e
    gke_accelerator: str  # node label cloud.google.com/gke-tpu-accelerator
    topology: str  # node label cloud.google.com/gke-tpu-topology
    machine_type: str  # GKE machine type of a host: PathwaysJob workers[].type (an enum of its CRD)
    chips_per_host: int = 4

    @property
    def chips(self) -> int:
        n = 1
        for d in self.topology.split("x"):
            n *= int(d)
        return n

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self.chips_per_host)

    @property
    def instance_type(self) -> str:
        return f"{self.pathways_version}:{self.topology}"


def _tpu_table() -> dict[str, TpuSlice]:
    table: dict[str, TpuSlice] = {}
    two_d = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
    for chips, topo in two_d.items():
        if chips == 8:  # 8-chip v5e/v6e slices are single 8-chip hosts (different machine type); not listed
            continue
        name = f"v5litepod-{chips}"
        table[name] = TpuSlice(name, "tpuv5e", "tpu-v5-lite-podslice", topo, "ct5lp-hightpu-4t")
        table[f"v6e-{chips}"] = TpuSlice(f"v6e-{chips}", "tpuv6e", "tpu-v6e-slice", topo, "ct6e-standard-4t")
    # v5p / v4 names count TensorCores (2 per chip).
    three_d = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
    for chips, topo in three_d.items():
        table[f"v5p-{2 * chips}"] = TpuSlice(f"v5p-{2 * chips}", "tpuv5", "tpu-v5p-slice", topo, "ct5p-hightpu-4t")
        table[f"v4-{2 * chips}"] = TpuSlice(f"v4-{2 * chips}", "tpuv4", "tpu-v4-podslice", topo, "ct4p-hightpu-4t")
    return table


TPU_TYPES = _tpu_table()


# ---------------------------------------------------------------------------------------------------
# The one parameter object every renderer reads.
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeployParams:
    # The run (all targets).
    slices: int
    image: str
    run_name: str
    output_dir: str
    model: str = "qwen3-0.6b"
    config: str = "base.yml"
    overrides: tuple[str, ...] = ()
    name: str = ""  # Kubernetes / xpk / Slurm job name; "" = derived from run_name
    namespace: str = "default"
    queue: str = ""  # Kueue LocalQueue (adds the kueue.x-k8s.io/queue-name label)
    service_account: str = "default"  # Kubernetes service account (Workload Identity for GCS)
    max_restarts: int = 3  # whole-run restarts after exit 1 (JobSet/PathwaysJob maxRestarts, xpk, Slurm)
    # Restarts of one trainer process after exit 75 or a crash (JobSet backoffLimitPerIndex, Slurm in place).
    max_task_restarts: int = 10
    # Elasticity in the trainer.
    elastic: bool = True
    min_slices: int = -1  # elastic_min_slice_count: -1 pause-and-resume, 1..slices-1 replica-resize
    elastic_timeout_seconds: float = 300.0
    elastic_max_retries: int = 10
    checkpoint_period: int = 100
    compile_cache: str | None = None  # jax_cache_dir; None = <output_dir>/jax_cache, "" = disabled
    # Pathways on GKE (xpk, jobset-pathways, pathwaysjob).
    tpu_type: str = "v5litepod-16"
    elastic_slices: int | None = None  # proxy --num_elastic_slices / xpk --elastic-slices; None = derived
    max_slice_restarts: int = 5  # worker Job backoffLimit = hosts per slice x this
    pathways_gcs_location: str = ""  # Pathways scratch; "" = <output_dir>/pathways
    pathways_version: str = ""  # tag of the Pathways images; "" = jax-<the trainer image's JAX> (pathways_tag)
    trainer_jax: str = ""  # the trainer image's JAX; "" = the pin of the Dockerfile's default TPU build
    server_image: str = ""  # "" = <PATHWAYS_IMAGE_REPO>/server:<pathways_version>
    proxy_image: str = ""  # "" = <PATHWAYS_IMAGE_REPO>/proxy_server:<pathways_version>
    proxy_memory: str = "100G"
    proxy_cpu: str = "16"
    head_nodepool: str = "cpu-np"
    # xpk: write its script despite its JobSet's failure policy (XPK_FAILURE_POLICY); refused without.
    accept_xpk_failure_policy: bool = False
    # Restart budgets and resources of the trainer's pods (Kubernetes targets; Slurm: --max-preemptions).
    # Trainer Job backoffLimit: every counted pod failure of a trainer Job in one JobSet attempt (preemptions
    # and evictions, counted instead of ignored, transient failures, a bug's failed index); 0 = preemptions
    # and evictions unbounded (podFailurePolicy Ignore).
    max_preemptions: int = 0
    trainer_cpu: str = ""  # "" = the target's default (PATHWAYS_TRAINER_RESOURCES, MULTIPROCESS_*_PER_GPU)
    trainer_memory: str = ""
    trainer_ephemeral_storage: str = ""  # "" = Pathways head: the default; jobset-gpu: no request
    capacity: str = "on-demand"  # on-demand | spot (CAPACITIES)
    spot_grace_seconds: int = DEFAULT_SPOT_GRACE_SECONDS  # what GKE gives a Spot pod after the notice
    # Multi-process JAX (jobset-gpu, slurm).
    platform: str = "gpu"  # gpu | cpu
    nodes_per_slice: int = 1
    gpus_per_node: int = 8
    gpu_accelerator: str = "nvidia-h100-80gb"
    coordinator_port: int = 8476
    heartbeat_timeout_seconds: int = 30
    collective_timeout_seconds: int = 120
    restart_backoff_seconds: int = 10
    extra_xla_flags: tuple[str, ...] = ()
    shm_size: str = "64Gi"  # jobset-gpu: sizeLimit of the /dev/shm emptyDir (medium Memory)
    gpu_networking: str = "none"  # jobset-gpu: none | tcpxo (A3 Mega) | rdma (A3 Ultra, A4)
    tcpxo_daemon_image: str = TCPXO_DAEMON_IMAGE

    # --- derived values -------------------------------------------------------------------------
    @property
    def job_name(self) -> str:
        if self.name:
            return self.name
        derived = re.sub(r"[^a-z0-9-]+", "-", self.run_name.lower()).strip("-")
        if derived and not derived[0].isalpha():
            derived = "r-" + derived
        return derived[:MAX_NAME_LEN].rstrip("-")

    @property
    def tpu(self) -> TpuSlice:
        try:
            return TPU_TYPES[self.tpu_type]
        except KeyError:
            raise DeployError(
                f"unknown --tpu-type {self.tpu_type!r}; known: {', '.join(sorted(TPU_TYPES))}"
            ) from None

    @property
    def cache_dir(self) -> str:
        if self.compile_cache is None:
            return self.output_dir.rstrip("/") + "/jax_cache"
        return self.compile_cache

    @property
    def scratch(self) -> str:
        return self.pathways_gcs_location or self.output_dir.rstrip("/") + "/pathways"

    @property
    def num_elastic_slices(self) -> int:
        """Slices Pathways may lose at once; 0 when elasticity is off."""
        if not self.elastic:
            return 0
        if self.elastic_slices is not None:
            return self.elastic_slices
        if self.min_slices > 0:  # replica-resize: as many as the trainer can continue without
            return max(1, self.slices - self.min_slices)
        return 1  # pause-and-resume: one slice down at a time (the reference run's setting)

    @property
    def num_processes(self) -> int:
        return self.slices * self.nodes_per_slice

    @property
    def explicit_stop_timeout(self) -> float | None:
        """The last `stop_timeout_seconds=` override after `--`; None when there is none."""
        value = None
        for o in self.overrides:
            k, sep, v = o.partition("=")
            if sep and k.strip() == "stop_timeout_seconds":
                value = v.strip()
        if value is None:
            return None
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds >= 0):
            raise DeployError(f"stop_timeout_seconds={value!r} must be a number of seconds >= 0")
        return seconds

    @property
    def stop_timeout_seconds(self) -> float:
        """The explicit override, else under Spot the stop that fits its notice, else the trainer key's default
        (the renderer prefers the value the trainer's loader resolves: `trainer_stop_timeout`)."""
        explicit = self.explicit_stop_timeout
        if explicit is not None:
            return explicit
        return float(self.spot_stop_timeout if self.spot else DEFAULT_STOP_TIMEOUT_SECONDS)

    @property
    def spot(self) -> bool:
        return self.capacity == "spot"

    @property
    def stop_margin(self) -> int:
        """Seconds between the trainer's stop timeout and its pod's SIGKILL (terminationGracePeriodSeconds)."""
        return SPOT_STOP_MARGIN_SECONDS if self.spot else STOP_MARGIN_SECONDS

    @property
    def spot_stop_timeout(self) -> int:
        """The longest stop_timeout_seconds whose grace fits what GKE gives a Spot pod."""
        return self.spot_grace_seconds - SPOT_STOP_MARGIN_SECONDS

    @property
    def pathways_tag(self) -> str:
        """The Pathways images' tag: --pathways-version, else the images of the trainer image's JAX."""
        return self.pathways_version or f"jax-{self.trainer_jax or default_trainer_jax()}"

    @property
    def image_server(self) -> str:
        return self.server_image or f"{PATHWAYS_IMAGE_REPO}/server:{self.pathways_tag}"

    @property
    def image_proxy(self) -> str:
        return self.proxy_image or f"{PATHWAYS_IMAGE_REPO}/proxy_server:{self.pathways_tag}"

    # --- checks -------------------------------------------------------------------------------------
    def check_common(self) -> list[str]:
        """Raise DeployError for parameters no target can use; return warnings."""
        problems, warnings = [], []
        if self.slices < 1:
            problems.append(f"--slices must be >= 1, got {self.slices}")
        if not self.image:
            problems.append("--image is required")
        if not self.run_name:
            problems.append("--run-name is required (resuming after a restart needs a fixed run directory)")
        if not self.output_dir:
            problems.append("--output-dir is required")
        name = self.job_name
        if not _NAME_RE.match(name) or len(name) > MAX_NAME_LEN:
            problems.append(
                f"job name {name!r} must be a DNS label ([a-z][-a-z0-9]*, at most {MAX_NAME_LEN} "
                "characters); pass --name"
            )
        for k, v in (
            ("--max-restarts", self.max_restarts),
            ("--max-slice-restarts", self.max_slice_restarts),
            ("--max-task-restarts", self.max_task_restarts),
            ("--max-preemptions", self.max_preemptions),
        ):
            if v < 0:
                problems.append(f"{k} must be >= 0, got {v}")
        if self.capacity not in CAPACITIES:
            problems.append(f"--capacity must be one of {', '.join(CAPACITIES)}, got {self.capacity!r}")
        elif self.spot and self.spot_stop_timeout < 1:
            problems.append(
                f"--spot-grace-seconds={self.spot_grace_seconds} leaves the trainer no time to stop: it needs "
                f"at least {SPOT_STOP_MARGIN_SECONDS + 1} (stop_timeout_seconds >= 1 plus a "
                f"{SPOT_STOP_MARGIN_SECONDS} s margin)"
            )
        for resource, value in (
            ("cpu", self.trainer_cpu),
            ("memory", self.trainer_memory),
            ("ephemeral-storage", self.trainer_ephemeral_storage),
        ):
            if value and not _QUANTITY_RE.match(value):
                problems.append(
                    f"{RESOURCE_FLAGS[resource]}={value!r} is not a Kubernetes quantity (e.g. 16, 500m, 64Gi, "
                    "100G)"
                )
        for o in self.overrides:
            k = o.partition("=")[0].strip()
            if k in MANAGED_KEYS:
                problems.append(f"trainer key {k!r} is set by the renderer; use {MANAGED_KEYS[k]} instead")
        try:
            _ = self.stop_timeout_seconds
        except DeployError as e:
            problems.append(str(e))
        if problems:
            raise DeployError("; ".join(problems))
        return warnings

    def check_pathways(self) -> list[str]:
        warnings: list[str] = []
        tpu = self.tpu  # raises for an unknown type
        problems = []
        if not self.output_dir.startswith("gs://"):
            problems.append(
                f"Pathways runs need --output-dir on Cloud Storage (gs://...), got {self.output_dir!r}: "
                "with ENABLE_PATHWAYS_PERSISTENCE the TPU hosts write checkpoint shards there directly"
            )
        if not self.scratch.startswith("gs://"):
            problems.append(f"--pathways-gcs-location must be gs://..., got {self.scratch!r}")
        n = self.num_elastic_slices
        if self.elastic and not 1 <= n <= self.slices:
            problems.append(f"--elastic-slices must be between 1 and --slices={self.slices}, got {n}")
        same_tag = pathways_image_jax(self.image_proxy) == pathways_image_jax(self.image_server)
        for image in [self.image_server] + ([] if same_tag else [self.image_proxy]):
            try:  # the Pathways servers and the trainer (their client) must run one JAX release
                check_pathways_image(image, self.trainer_jax or default_trainer_jax())
            except VersionError as e:
                problems.append(f"{e} (the trainer image's JAX: --trainer-jax)")
        if problems:
            raise DeployError("; ".join(problems))
        if self.elastic and self.min_slices > 0 and n < self.slices - self.min_slices:
            warnings.append(
                f"--elastic-slices={n} < slices - min_slices = {self.slices - self.min_slices}: losing more "
                f"than {n} slice(s) at once restarts the whole JobSet although the trainer could continue"
            )
        if self.max_slice_restarts * tpu.hosts < 8:
            warnings.append(
                f"worker backoffLimit = {tpu.hosts} host(s) x {self.max_slice_restarts} = "
                f"{tpu.hosts * self.max_slice_restarts} is low: a few pod failures will restart the JobSet"
            )
        return warnings

    def check_multiprocess(self) -> list[str]:
        warnings: list[str] = []
        problems = []
        if self.platform not in ("gpu", "cpu"):
            problems.append(f"--platform must be gpu or cpu, got {self.platform!r}")
        if self.nodes_per_slice < 1:
            problems.append(f"--nodes-per-slice must be >= 1, got {self.nodes_per_slice}")
        if self.platform == "gpu" and self.gpus_per_node < 1:
            problems.append(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if not self.output_dir.startswith(("gs://", "/")):
            problems.append(
                f"--output-dir {self.output_dir!r} must be storage every host sees (gs://... or an "
                "absolute path on a shared filesystem)"
            )
        if self.heartbeat_timeout_seconds < 1 or self.collective_timeout_seconds < 1:
            problems.append("--heartbeat-timeout and --collective-timeout must be >= 1")
        if not _QUANTITY_RE.match(self.shm_size):
            problems.append(f"--shm-size={self.shm_size!r} is not a Kubernetes quantity (e.g. 64Gi)")
        if self.gpu_networking not in GPU_NETWORKING:
            problems.append(
                f"--gpu-networking must be one of {', '.join(GPU_NETWORKING)}, got {self.gpu_networking!r}"
            )
        elif self.gpu_networking != "none" and (self.platform != "gpu" or self.gpus_per_node != 8):
            problems.append(
                f"--gpu-networking={self.gpu_networking} needs --platform gpu and --gpus-per-node 8 (GKE's "
                f"GPUDirect setup gives one pod all 8 GPUs and NICs of a node), got --platform {self.platform} "
                f"--gpus-per-node {self.gpus_per_node}; use --gpu-networking none"
            )
        if problems:
            raise DeployError("; ".join(problems))
        if self.num_processes == 1:
            warnings.append("a single process: the multi-process fault-tolerance settings have nothing to do")
        accelerators = GPU_NETWORKING_ACCELERATORS.get(self.gpu_networking, ())
        if accelerators and self.gpu_accelerator not in accelerators:
            warnings.append(
                f"--gpu-networking={self.gpu_networking} is GKE's setup for {', '.join(accelerators)} nodes, but "
                f"--gpu-accelerator is {self.gpu_accelerator}"
            )
        return warnings


# ---------------------------------------------------------------------------------------------------
# The trainer command: built once, checked with the trainer's own loader, reused by every renderer.
# ---------------------------------------------------------------------------------------------------
def _yaml_bool(b: bool) -> str:
    return "true" if b else "false"


def trainer_argv(p: DeployParams, *, single_controller: bool) -> list[str]:
    """`python -m trainer.train CONFIG key=value ...` for this run, as an argv list."""
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
    ]
    if p.cache_dir:
        argv.append(f"jax_cache_dir={p.cache_dir}")
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


def grace_seconds(stop_timeout_seconds: float, margin: int = STOP_MARGIN_SECONDS) -> int:
    """Slurm's notice before the time limit, and (with the parameters' margin: `pod_grace`) the
    terminationGracePeriodSeconds of every pod that runs the trainer: the trainer's stop timeout plus a margin."""
    return math.ceil(stop_timeout_seconds) + margin


def pod_grace(p: DeployParams, stop_timeout_seconds: float) -> int:
    """terminationGracePeriodSeconds of a pod that runs the trainer: its stop timeout plus the margin of the
    capacity (10 s; 5 s under Spot, whose notice is short)."""
    return grace_seconds(stop_timeout_seconds, p.stop_margin)


def check_spot_fit(p: DeployParams, stop_timeout_seconds: float) -> None:
    """Under Spot the trainer's pods may claim no more grace than GKE gives them (--spot-grace-seconds)."""
    if p.spot and pod_grace(p, stop_timeout_seconds) > p.spot_grace_seconds:
        raise DeployError(
            f"stop_timeout_seconds={stop_timeout_seconds:g} cannot fit Spot's notice: GKE gives a Spot pod "
            f"{p.spot_grace_seconds} s (--spot-grace-seconds) and the trainer needs its stop timeout plus "
            f"{SPOT_STOP_MARGIN_SECONDS} s; use stop_timeout_seconds<={p.spot_stop_timeout} (or leave it out: "
            "the renderer sets it), or raise --spot-grace-seconds to what your node pools give (GKE can extend it "
            "to 120 s: docs/running_at_scale.md, Spot capacity)"
        )


def _prepare(p: DeployParams, *, single_controller: bool, check: Callable[[], list[str]]):
    """Common checks, then the trainer command through the trainer's loader (its message wins), then the
    target's own checks. Returns (argv, warnings, the trainer's stop_timeout_seconds)."""
    warnings = p.check_common()
    argv = trainer_argv(p, single_controller=single_controller)
    cfg = check_trainer_argv(argv, p)
    stop = trainer_stop_timeout(p, cfg)
    check_spot_fit(p, stop)
    return argv, warnings + check(), stop


# ---------------------------------------------------------------------------------------------------
# Environment shared by the multi-process targets (JobSet GPU and Slurm).
# ---------------------------------------------------------------------------------------------------
GPU_FT_XLA_FLAGS = (
    # From JAX's fault-tolerance guide: do not abort the process on an NCCL error, and use
    # non-blocking, asynchronously executed communicators so failed collectives can be aborted.
    "--xla_gpu_nccl_terminate_on_error=false",
    "--xla_gpu_nccl_async_execution=true",
    "--xla_gpu_nccl_blocking_communicators=false",
)
GPU_FT_ENV = (
    # Abort in-flight collectives when the coordination service reports a dead peer (JAX FT guide).
    ("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "1"),
    # The FT guide's recipe runs on the TFRT GPU client.
    ("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "1"),
)


def xla_flags(p: DeployParams) -> list[str]:
    t = p.collective_timeout_seconds
    if p.platform == "gpu":
        # Bounds a stuck NCCL rendezvous; a dead peer is detected by the heartbeat and its collectives
        # aborted (XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE), not by this timeout.
        flags = [*GPU_FT_XLA_FLAGS, f"--xla_gpu_nccl_termination_timeout_seconds={t}"]
    else:
        # gloo: without a bound a survivor waiting on a dead peer's recv hangs for 30 min (the default).
        # The in-process rendezvous terminate timeout (default 40 s) must stay above it.
        flags = [
            f"--xla_cpu_collective_timeout_seconds={t}",
            f"--xla_cpu_collective_call_terminate_timeout_seconds={t + 60}",
        ]
    return flags + list(p.extra_xla_flags)


def multiprocess_env(p: DeployParams) -> list[tuple[str, str]]:
    """Environment every process of a multi-process run gets (the per-process ids are set by the launcher)."""
    env = [
        ("JAX_NUM_PROCESSES", str(p.num_processes)),
        ("NODES_PER_SLICE", str(p.nodes_per_slice)),
        # Read by JAX when it is imported, so it is in effect before jax.distributed.initialize.
        ("JAX_ENABLE_RECOVERABILITY", "true"),
        # For the trainer's jax.distributed.initialize(heartbeat_timeout_seconds=...).
        ("JAX_HEARTBEAT_TIMEOUT_SECONDS", str(p.heartbeat_timeout_seconds)),
        ("JAX_PLATFORMS", "cuda" if p.platform == "gpu" else "cpu"),
        ("XLA_FLAGS", " ".join(xla_flags(p))),
    ]
    if p.platform == "gpu":
        env += list(GPU_FT_ENV)
    if p.cache_dir:
        env.append(("JAX_COMPILATION_CACHE_DIR", p.cache_dir))
    return env


# ---------------------------------------------------------------------------------------------------
# Shell-script templates (xpk, slurm).
# ---------------------------------------------------------------------------------------------------
_PLACEHOLDER = re.compile(r"\{\{\s*([a-z_][a-z0-9_]*)\s*\}\}")
_BLOCK_LINE = re.compile(r"^(\s*)\{\{\s*([a-z_][a-z0-9_]*)\s*\}\}\s*$")


def fill(template: str, values: Mapping[str, str | list[str]]) -> str:
    """Replace `{{name}}` placeholders. A str value goes inline; a list value (block) must be alone on its
    line and each of its lines is indented like the placeholder (an empty block removes the line).
    Every placeholder must have a value and every value must be used."""
    used: set[str] = set()
    out: list[str] = []
    for line in template.splitlines():
        m = _BLOCK_LINE.match(line)
        if m and isinstance(values.get(m.group(2)), list):
            used.add(m.group(2))
            out += [m.group(1) + item for item in values[m.group(2)]]
            continue

        def inline(mm: re.Match) -> str:
            key = mm.group(1)
            if key not in values:
                raise KeyError(f"template placeholder {{{{{key}}}}} has no value")
            if isinstance(values[key], list):
                raise KeyError(f"block placeholder {{{{{key}}}}} must be alone on its line")
            used.add(key)
            return values[key]

        out.append(_PLACEHOLDER.sub(inline, line))
    unused = set(values) - used
    if unused:
        raise KeyError(f"values not used by the template: {sorted(unused)}")
    return "\n".join(out) + "\n"


def load_template(name: str) -> str:
    return (TEMPLATES / name).read_text()


# ---------------------------------------------------------------------------------------------------
# Kubernetes manifests (jobset-pathways, jobset-gpu, pathwaysjob): Python dicts dumped with PyYAML.
# ---------------------------------------------------------------------------------------------------
class ManifestDumper(yaml.SafeDumper):
    """`yaml.safe_dump`'s dumper with two changes for files kubectl reads:

    - a string that Kubernetes' YAML parser (go-yaml: YAML 1.1, whose floats need no dot) or a YAML 1.2
      parser would read as a number (`1e3`, `0o17`) is quoted, as PyYAML already quotes `true`, `007`, `1.5`
      (an env value or a label must stay a string);
    - a string of several lines is a literal block (`|`), so a script in a command reads as written;
    - an object used twice is written out twice, not as a YAML alias.
    """

    def ignore_aliases(self, data) -> bool:
        return True


ManifestDumper.add_implicit_resolver(  # only decides quoting: a plain scalar matching it would not be a string
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    list("-+.0123456789"),
)


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_str(value)


ManifestDumper.add_representer(str, _represent_str)


def manifest_text(header: Sequence[str], manifest: Mapping) -> str:
    """The file of one Kubernetes object: its comment lines, then the object as YAML (keys in the order built,
    no line folding)."""
    assert all(line.startswith("#") for line in header), header
    body = yaml.dump(dict(manifest), Dumper=ManifestDumper, sort_keys=False, width=2**31 - 1)
    return "\n".join(header) + "\n" + body


def env_list(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in pairs]


def field_env(name: str, field_path: str) -> dict:
    """An environment variable from the downward API."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def job_identity_env() -> list[dict]:
    """The job's name and namespace from the downward API: the trainer names its run after them and takes
    the run's lease as that job, so a restarted pod of the same JobSet takes it over at once
    (trainer/checkpoint/lease.py)."""
    return [
        field_env("JOBSET_NAME", "metadata.labels['jobset.sigs.k8s.io/jobset-name']"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
    ]


def _on_trainer_exit(codes: Sequence[int]) -> dict:
    return {"containerName": TRAINER_CONTAINER, "operator": "In", "values": list(codes)}


def trainer_job_policy(p: DeployParams, completions: int) -> dict:
    """The spec fields of a Job whose pods each run one trainer process: how Kubernetes answers each exit code.

    Kubernetes evaluates the podFailurePolicy rules of a failed pod in order; the first match decides, and a
    failure no rule matches is counted (Count): exit 75, 137 (SIGKILL, OOM-kill), 134, 139, 143, or a pod that
    failed without a trainer exit code. A counted failure replaces the pod (same index: the same process id)
    with Kubernetes' backoff (10 s doubling, at most 6 min), up to backoffLimitPerIndex times; one more fails
    the index, and one failed index fails the Job (maxFailedIndexes 0: MaxFailedIndexesExceeded). FailIndex
    needs backoffLimitPerIndex, which needs an Indexed Job whose pods have restartPolicy Never
    (https://kubernetes.io/docs/concepts/workloads/controllers/job/).

    The preemption budget (--max-preemptions N > 0): the two preemption rules say Count instead of Ignore, and
    the Job's backoffLimit is N. Kubernetes keeps one failure count per Job (status.failed: every failed pod
    no rule ignores, Count, FailIndex and FailJob alike) and one per index (what backoffLimitPerIndex limits);
    the Job controller checks, in this order, a FailJob rule (reason PodFailurePolicy), then the Job's count
    against backoffLimit (BackoffLimitExceeded), then the failed indexes (MaxFailedIndexesExceeded)
    (pkg/controller/job/job_controller.go, syncJob). So the (N+1)-th counted pod failure of the Job in one
    JobSet attempt fails it with BackoffLimitExceeded, whatever its cause, and `jobset_failure_policy` fails
    the JobSet on that; a process's (--max-task-restarts + 1)-th counted failure, preemptions included, still
    restarts the JobSet first when it comes first (`preemption_budget_warnings`). The preemption rules stay
    first: an evicted pod whose trainer exited 1 while stopping is a preemption, not a bug. N = 0 keeps them
    Ignore: no bound.
    """
    budget = p.max_preemptions > 0
    preempted = "Count" if budget else "Ignore"
    spec: dict = {
        "completionMode": "Indexed",
        "completions": completions,
        "parallelism": completions,
        "backoffLimitPerIndex": p.max_task_restarts,
        "maxFailedIndexes": 0,
    }
    if budget:
        spec["backoffLimit"] = p.max_preemptions
    spec["podFailurePolicy"] = {
        "rules": [
            # Preempted (SIGTERM: drain, Spot, maintenance; state saved): replace the pod; no budget used, or,
            # with --max-preemptions, counted against the Job's backoffLimit.
            {"action": preempted, "onExitCodes": _on_trainer_exit(PREEMPTED_EXIT_CODES)},
            # An evicted or preempted pod, whatever its exit code (killed at the end of the grace period, or
            # never started): the same.
            {"action": preempted, "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # Bad input or gave up: fail the Job (reason PodFailurePolicy); the JobSet fails at once.
            {"action": "FailJob", "onExitCodes": _on_trainer_exit(FINAL_EXIT_CODES)},
            # A bug: fail the index without retrying the pod; the JobSet restarts, counted (maxRestarts).
            {"action": "FailIndex", "onExitCodes": _on_trainer_exit(BUG_EXIT_CODES)},
        ]
    }
    return spec


def jobset_failure_policy(p: DeployParams, trainer_job: str) -> dict:
    """The JobSet's failurePolicy: what a failed child Job does to the JobSet, by the Job's failure reason.

    The JobSet controller (v0.6.0+) evaluates the rules in order, runs the first that matches the failed Job's
    reason and replicatedJob, and restarts the JobSet counted against maxRestarts (RestartJobSet) when none
    matches: exit 1, a used-up per-process budget, any other child Job failure; one restart more than
    maxRestarts fails the JobSet (https://jobset.sigs.k8s.io/docs/reference/jobset.v1alpha2/). With
    --max-preemptions, a trainer Job past its backoffLimit fails the JobSet (`preemption_budget_rule`).
    """
    return {
        "maxRestarts": p.max_restarts,
        "rules": [
            # A trainer pod exited 2 or 3 (podFailurePolicy FailJob): a restart of the same command cannot help.
            {
                "name": "trainerBadInputOrGaveUp",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "targetReplicatedJobs": [trainer_job],
            },
            # A trainer pod exited 1 (FailIndex), or a process used up backoffLimitPerIndex: restart all.
            {
                "name": "trainerFailedOrOutOfRetries",
                "action": "RestartJobSet",
                "onJobFailureReasons": ["MaxFailedIndexesExceeded"],
                "targetReplicatedJobs": [trainer_job],
            },
            *preemption_budget_rule(p, trainer_job),
        ],
    }


def preemption_budget_warnings(p: DeployParams, processes: int) -> list[str]:
    """A budget no run can reach: a counted preemption also uses its process's backoffLimitPerIndex, whose
    (--max-task-restarts + 1)-th failure restarts the JobSet (fresh counts) before the Job's count passes N."""
    reachable = p.max_task_restarts * processes
    if p.max_preemptions > reachable:
        return [
            f"--max-preemptions={p.max_preemptions} cannot be reached: a counted preemption also uses its "
            f"process's --max-task-restarts={p.max_task_restarts}, and {processes} process(es) per trainer Job "
            f"restart the JobSet (with fresh counts) before {reachable + 1} counted failures; use "
            f"--max-preemptions <= {reachable}"
        ]
    return []


def preemption_budget_rule(p: DeployParams, trainer_job: str) -> list[dict]:
    """With --max-preemptions: a trainer Job past its backoffLimit (BackoffLimitExceeded; `trainer_job_policy`)
    used up the run's budget of preemptions: the JobSet fails instead of restarting (a restart would recreate the
    Job with a fresh count)."""
    if p.max_preemptions <= 0:
        return []
    return [
        {
            "name": "trainerOutOfPreemptions",
            "action": "FailJobSet",
            "onJobFailureReasons": ["BackoffLimitExceeded"],
            "targetReplicatedJobs": [trainer_job],
        }
    ]


def _header(target: str, p: DeployParams) -> list[str]:
    return [
        f"# Rendered by scripts/deploy/render.py (target: {target}); re-render instead of editing.",
        f"# slices={p.slices} image={p.image} run_name={p.run_name} output_dir={p.output_dir} model={p.model}",
    ]


def _metadata(p: DeployParams) -> dict:
    labels = {"app.kubernetes.io/part-of": "elastic-trainer", "elastic-trainer/job": p.job_name}
    if p.queue:
        labels["kueue.x-k8s.io/queue-name"] = p.queue
    return {"name": p.job_name, "namespace": p.namespace, "labels": labels}


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


def capacity_node_selector(p: DeployParams) -> dict:
    """The node label that puts a pod on Spot nodes under --capacity spot (GKE labels every Spot node with it)."""
    return {SPOT_NODE_LABEL: "true"} if p.spot else {}


def spot_tolerations(p: DeployParams) -> list[dict]:
    """The toleration of GKE's Spot taint (cloud.google.com/gke-spot=true:NoSchedule: Autopilot puts it on Spot
    nodes, and GKE's Spot guide suggests it for Standard Spot node pools); harmless on an untainted pool."""
    if not p.spot:
        return []
    return [{"key": SPOT_NODE_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}]


def capacity_tolerations(p: DeployParams) -> dict:
    return {"tolerations": spot_tolerations(p)} if p.spot else {}


def worker_grace(p: DeployParams) -> int:
    """terminationGracePeriodSeconds of a Pathways worker pod: Kubernetes' default, no more than Spot gives."""
    if p.spot:
        return min(KUBERNETES_DEFAULT_GRACE_SECONDS, p.spot_grace_seconds)
    return KUBERNETES_DEFAULT_GRACE_SECONDS


def head_logs_command(p: DeployParams) -> str:
    """`kubectl logs` of the trainer: the head pod only (the worker pods have no `trainer` container)."""
    selector = f"jobset.sigs.k8s.io/jobset-name={p.job_name},jobset.sigs.k8s.io/replicatedjob-name=pathways-head"
    return f"kubectl logs -f -l {selector} -c {TRAINER_CONTAINER}"


def gpu_logs_command(p: DeployParams) -> str:
    """`kubectl logs` of process 0 of a jobset-gpu run (Kubernetes labels a pod with its completion index)."""
    selector = (
        f"jobset.sigs.k8s.io/jobset-name={p.job_name},jobset.sigs.k8s.io/job-index=0,"
        "batch.kubernetes.io/job-completion-index=0"
    )
    return f"kubectl logs -f -l {selector} -c {TRAINER_CONTAINER}"


def pathways_trainer_env(p: DeployParams) -> list[tuple[str, str]]:
    """What the trainer needs on Pathways besides the proxy address: hosts read and write their own checkpoint
    shards instead of funnelling them through the proxy (large checkpoints otherwise exhaust the proxy's
    memory), and the shared compilation cache."""
    env = [("ENABLE_PATHWAYS_PERSISTENCE", "1")]
    if p.cache_dir:
        env.append(("JAX_COMPILATION_CACHE_DIR", p.cache_dir))
    return env


# ---------------------------------------------------------------------------------------------------
# Renderers.
# ---------------------------------------------------------------------------------------------------
@dataclass
class Rendered:
    target: str
    filename: str
    text: str
    trainer_argv: list[str]
    warnings: list[str] = field(default_factory=list)
    manifest: dict | None = None  # the Kubernetes object `text` holds (manifest targets only)


# The trainer's exit codes and what a JobSet manifest makes of them; {pods} and {budget} differ by target.
_JOBSET_CONTRACT = """\
#   42        preempted, state saved (SIGTERM: drain, Spot, maintenance), and any evicted {pod} (condition
{preempted}
#   75, crash transient (storage, peers), or a death the trainer did not choose (137 SIGKILL or
#             OOM-kill, 134, 139, 143): the {pod} is replaced, up to {budget} times{per}
#             (backoffLimitPerIndex); one more restarts the JobSet (counted)
#   1         a bug: the JobSet restarts at once, counted against maxRestarts={max_restarts}; one more
#             fails the JobSet
#   2, 3      bad input, gave up: the JobSet fails at once"""


def _comment(text: str, indent: str = "") -> list[str]:
    """`text` as comment lines of at most 110 characters, each after `# ` and `indent`."""
    return textwrap.wrap(
        text, 110, initial_indent="# " + indent, subsequent_indent="# " + indent, break_on_hyphens=False
    )


def _preempted_outcome(p: DeployParams, pod: str) -> str:
    """What the JobSet manifests make of a preemption (exit 42 or DisruptionTarget): the header's lines."""
    if p.max_preemptions <= 0:
        text = f"DisruptionTarget): the {pod} is replaced, no budget used (--max-preemptions 0: no bound)"
    else:
        text = (
            f"DisruptionTarget): the {pod} is replaced, counted against the trainer Job's backoffLimit="
            f"{p.max_preemptions} (--max-preemptions), which every counted pod failure of the Job in one JobSet "
            "attempt uses (75, crashes and 1 too); the failure past it fails the JobSet (BackoffLimitExceeded: "
            "FailJobSet). A counted preemption also uses its process's backoffLimitPerIndex (below)"
        )
    return "\n".join(_comment(text, " " * 12))


def _jobset_contract(p: DeployParams, pod: str, per: str) -> list[str]:
    text = _JOBSET_CONTRACT.format(
        pod=pod,
        budget=p.max_task_restarts,
        per=per,
        max_restarts=p.max_restarts,
        preempted=_preempted_outcome(p, pod),
    )
    return text.splitlines()


def render_jobset_pathways(p: DeployParams) -> Rendered:
    argv, warnings, stop = _prepare(p, single_controller=True, check=p.check_pathways)
    warnings += preemption_budget_warnings(p, 1)
    tpu = p.tpu
    head = f"{p.job_name}-pathways-head-0-0.{p.job_name}"
    rm_args = [
        f"--server_port={PATHWAYS_RM_PORT}",
        f"--gcs_scratch_location={p.scratch}",
        "--node_type=resource_manager",
        f"--instance_count={p.slices}",
        f"--instance_type={tpu.instance_type}",
    ]
    proxy_args = [
        f"--server_port={PATHWAYS_PROXY_PORT}",
        f"--resource_manager_address={head}:{PATHWAYS_RM_PORT}",
        f"--gcs_scratch_location={p.scratch}",
    ]
    if p.num_elastic_slices:
        proxy_args.append(f"--num_elastic_slices={p.num_elastic_slices}")
    worker_args = [
        f"--server_port={PATHWAYS_WORKER_PORT}",
        f"--resource_manager_address={head}:{PATHWAYS_RM_PORT}",
        f"--gcs_scratch_location={p.scratch}",
    ]
    trainer_env = [
        ("JAX_PLATFORMS", "proxy"),
        ("JAX_BACKEND_TARGET", f"grpc://127.0.0.1:{PATHWAYS_PROXY_PORT}"),
        ("XCLOUD_ENVIRONMENT", "GCP"),
        *pathways_trainer_env(p),
    ]
    worker_env = env_list(
        [
            ("TPU_MIN_LOG_LEVEL", "0"),
            ("TF_CPP_MIN_LOG_LEVEL", "0"),
            ("XCLOUD_ENVIRONMENT", "GCP"),
            ("MEGASCALE_NUM_SLICES", str(p.slices)),
            ("MEGASCALE_COORDINATOR_ADDRESS", head),
        ]
    ) + [field_env("MEGASCALE_SLICE_ID", "metadata.labels['jobset.sigs.k8s.io/job-index']")]
    worker_backoff_limit = tpu.hosts * p.max_slice_restarts
    grace = pod_grace(p, stop)
    head_pod = {
        "restartPolicy": "Never",  # the Job replaces the pod; the podFailurePolicy needs it
        "terminationGracePeriodSeconds": grace,
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "serviceAccountName": p.service_account,
        "nodeSelector": {"cloud.google.com/gke-nodepool": p.head_nodepool},
        # Native sidecars (init containers with restartPolicy Always): they start before the trainer and stop
        # when it exits.
        "initContainers": [
            {
                "name": "pathways-rm",
                "image": p.image_server,
                "imagePullPolicy": "Always",
                "restartPolicy": "Always",
                "args": rm_args,
                "env": env_list([("TPU_SKIP_MDS_QUERY", "true")]),
                "ports": [{"containerPort": PATHWAYS_RM_PORT, "protocol": "TCP"}],
                "resources": guaranteed(PATHWAYS_RM_RESOURCES),
            },
            {
                "name": "pathways-proxy",
                "image": p.image_proxy,
                "imagePullPolicy": "Always",
                "restartPolicy": "Always",
                "args": proxy_args,
                "ports": [{"containerPort": PATHWAYS_PROXY_PORT, "protocol": "TCP"}],
                "resources": guaranteed({"cpu": p.proxy_cpu, "memory": p.proxy_memory}),
            },
        ],
        "containers": [
            {
                "name": TRAINER_CONTAINER,
                "image": p.image,
                "imagePullPolicy": "Always",
                "command": list(argv),
                "env": env_list(trainer_env) + job_identity_env(),
                "resources": pathways_trainer_resources(p),
            }
        ],
    }
    worker_pod = {
        "restartPolicy": "OnFailure",
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "terminationGracePeriodSeconds": worker_grace(p),
        "serviceAccountName": p.service_account,
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": tpu.topology,
            **capacity_node_selector(p),
        },
        **capacity_tolerations(p),
        "containers": [
            {
                "name": "pathways-worker",
                "image": p.image_server,
                "imagePullPolicy": "Always",
                "args": worker_args,
                "env": worker_env,
                "ports": [{"containerPort": PATHWAYS_WORKER_PORT, "protocol": "TCP"}],
                "resources": {"limits": {"google.com/tpu": str(tpu.chips_per_host)}},
            }
        ],
    }
    manifest = {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(p),
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["pathways-head"]},
            "failurePolicy": jobset_failure_policy(p, "pathways-head"),
            "replicatedJobs": [
                {
                    "name": "pathways-head",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            **trainer_job_policy(p, 1),
                            "template": {
                                "metadata": {"annotations": {EXCLUSIVE_TOPOLOGY: "kubernetes.io/hostname"}},
                                "spec": head_pod,
                            },
                        }
                    },
                },
                {
                    "name": "worker",
                    "replicas": p.slices,
                    "template": {
                        "spec": {
                            "completionMode": "Indexed",
                            "completions": tpu.hosts,
                            "parallelism": tpu.hosts,
                            "backoffLimit": worker_backoff_limit,
                            "template": {
                                "metadata": {"annotations": {EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}},
                                "spec": worker_pod,
                            },
                        }
                    },
                },
            ],
        },
    }
    header = [
        *_header("jobset-pathways", p),
        "#",
        "# Pathways on GKE without xpk: one head pod (the trainer, i.e. the single JAX controller, next to",
        "# the Pathways resource manager and proxy) and one worker Job per TPU slice.",
        "#   kubectl apply -f THIS_FILE",
        f"#   {head_logs_command(p)}",
        "# Needs Kubernetes >= 1.29 (backoffLimitPerIndex, maxFailedIndexes and the FailIndex action: beta and on",
        "# by default in 1.29, GA in 1.33; podFailurePolicy: on by default since 1.26, GA in 1.31; native",
        "# sidecars: beta and on by default in 1.29) and the JobSet controller >= v0.6.0 (failurePolicy.rules).",
        "#",
        "# Layers of recovery, innermost first:",
        "#   1. trainer (elastic_* keys): a lost slice is an exception in the controller; it waits for the",
        "#      slice (elastic_min_slice_count=-1) or continues on the survivors, without exiting.",
        f"#   2. worker Job backoffLimit = {tpu.hosts} host(s) per slice x --max-slice-restarts="
        f"{p.max_slice_restarts} = {worker_backoff_limit}:",
        "#      the slice's pods restart in place; the JobSet is untouched. Workers run Pathways, not the",
        "#      trainer, and keep the kubelet's in-place restart (restartPolicy OnFailure); Kubernetes allows a",
        "#      podFailurePolicy only with restartPolicy Never, so an evicted worker pod counts against it too.",
        "#   3. head pod: the trainer's exit code decides (trainer/errors.py), see below.",
        "#   4. JobSet failurePolicy.maxRestarts: tear everything down and start again (minutes). A worker Job",
        "#      past its backoffLimit takes the default action (RestartJobSet, counted).",
        "#",
        "# The trainer's exit code (container `trainer` of the head pod) and what this manifest makes of it:",
        "#   0         the head Job succeeds; successPolicy completes the JobSet (the workers are torn down:",
        "#             Pathways workers never exit on their own)",
        *_jobset_contract(p, "head pod", ""),
        "# A replaced head pod starts a new resource manager and proxy with the trainer; the worker Jobs stay,",
        "# and whatever a worker does when its resource manager goes away counts against its Job's backoffLimit.",
        f"# The trainer stops within stop_timeout_seconds={stop:g} of a SIGTERM; the head pod's",
        f"# terminationGracePeriodSeconds is that plus {p.stop_margin} s, for a saved checkpoint and exit 42"
        " before SIGKILL.",
        *_capacity_header(p, "The worker pods (the TPU slices)"),
        *_comment(
            "Resources: every container of the head pod has requests == limits (QoS class Guaranteed: evicted "
            f"last): trainer {_quantities(pathways_trainer_resources(p))} (--trainer-cpu, --trainer-memory, "
            f"--trainer-ephemeral-storage), pathways-rm {_quantities(guaranteed(PATHWAYS_RM_RESOURCES))}, "
            f"pathways-proxy cpu={p.proxy_cpu} memory={p.proxy_memory} (--proxy-cpu, --proxy-memory)."
        ),
        "# The resource manager and the proxy run as native sidecars (init containers with restartPolicy Always):",
        "# they start before the trainer and stop when it exits. Pods are reachable as",
        "# <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<jobset> even before they are Ready",
        "# (publishNotReadyAddresses), so the workers and the proxy find the resource manager while it starts.",
        "# ENABLE_PATHWAYS_PERSISTENCE=1 on the trainer: the hosts read and write their own checkpoint shards;",
        "# without it every checkpoint byte passes through the proxy and its memory limit.",
    ]
    return Rendered(
        "jobset-pathways", f"{p.job_name}.pathways.yaml", manifest_text(header, manifest), argv, warnings, manifest
    )


def _quantities(resources: Mapping) -> str:
    """`cpu=16 memory=64G` from a container's resources (its limits, else its requests)."""
    values = resources.get("limits") or resources.get("requests") or {}
    return " ".join(f"{k}={v}" for k, v in values.items() if k != "nvidia.com/gpu")


def _capacity_header(p: DeployParams, spot_pods: str, *, tolerate: bool = True) -> list[str]:
    """The header's lines on --capacity."""
    if not p.spot:
        return ["# Capacity: on-demand (--capacity spot: Spot nodes, and a stop that fits their notice)."]
    return _comment(
        f"Capacity: Spot. {spot_pods} select {SPOT_NODE_LABEL}=true"
        + (" and tolerate its taint" if tolerate else " (a PathwaysJob cannot give them tolerations)")
        + ". GKE gives a "
        f"Spot pod {p.spot_grace_seconds} s after the notice (--spot-grace-seconds): the trainer's "
        f"stop_timeout_seconds is at most {p.spot_stop_timeout} s ({p.spot_grace_seconds} s less a "
        f"{SPOT_STOP_MARGIN_SECONDS} s margin) and no pod's terminationGracePeriodSeconds exceeds "
        f"{p.spot_grace_seconds} s."
    )


def pathwaysjob_contract_warning(p: DeployParams) -> str:
    return (
        "the PathwaysJob controller gives the head Job backoffLimit 0 and no podFailurePolicy, and its JobSet "
        f"no failure rules: every non-zero trainer exit restarts the whole run counted against maxRestarts="
        f"{p.max_restarts}, so preemptions (exit 42) and evictions use that budget, exit 75 and crashes get no "
        "per-process budget, and exits 2 and 3 are retried until it is used up; the jobset-pathways target "
        "keeps the whole exit-code contract"
    )


def render_pathwaysjob(p: DeployParams) -> Rendered:
    """A PathwaysJob (https://github.com/google/pathways-job, API pathways-job.pathways.domain/v1): the
    GKE-documented way to run Pathways training. Its controller (v0.1.4, internal/controller/
    pathwaysjob_controller.go) builds the JobSet from these fields:

    - maxRestarts: the JobSet's failurePolicy.maxRestarts, with no rules;
    - workers[0]: one worker Job per slice on nodes of that machine type and topology; its backoffLimit is
      hosts per slice x maxSliceRestarts when elasticSlices > 0, else hosts x 4;
    - controller.elasticSlices: the proxy's --num_elastic_slices;
    - controller.template: the head pod; the controller copies its spec, sets hostNetwork, adds the resource
      manager and the proxy as native sidecars (fixed resources: 16 CPUs and 100 GB for the proxy) and appends
      JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET to the env of the container named mainContainerName. The head
      Job gets backoffLimit 0 and no podFailurePolicy, so the trainer's exit-code contract cannot be expressed:
      every non-zero exit fails the head Job and restarts the JobSet, counted (`pathwaysjob_contract_warning`).
    """
    argv, warnings, stop = _prepare(p, single_controller=True, check=p.check_pathways)
    tpu = p.tpu
    warnings.append(pathwaysjob_contract_warning(p))
    defaults = {f.name: f.default for f in dataclasses.fields(DeployParams)}
    if (p.proxy_memory, p.proxy_cpu) != (defaults["proxy_memory"], defaults["proxy_cpu"]):
        warnings.append(
            f"--proxy-memory={p.proxy_memory} / --proxy-cpu={p.proxy_cpu} are not applied: the PathwaysJob "
            "controller fixes the proxy at 16 CPUs and 100 GB; use the jobset-pathways target to change them"
        )
    if not p.num_elastic_slices and p.max_slice_restarts != PATHWAYSJOB_INELASTIC_SLICE_RESTARTS:
        warnings.append(
            f"--max-slice-restarts={p.max_slice_restarts} is not applied without elasticity: the PathwaysJob "
            f"controller sets the worker backoffLimit to hosts x {PATHWAYSJOB_INELASTIC_SLICE_RESTARTS} "
            "unless elasticSlices > 0"
        )
    if p.max_preemptions > 0:
        warnings.append(
            f"--max-preemptions={p.max_preemptions} is not applied: the PathwaysJob controller gives the head Job "
            "no podFailurePolicy, so every preemption restarts the JobSet, counted against "
            f"maxRestarts={p.max_restarts}"
        )
    if p.spot:
        warnings.append(
            "--capacity spot: the workers select Spot nodes (workers[0].nodeSelector), but a PathwaysJob cannot "
            f"give them tolerations: Spot node pools tainted {SPOT_NODE_LABEL}=true:NoSchedule will not take them"
        )
    grace = pod_grace(p, stop)
    worker = {
        "type": tpu.machine_type,
        "topology": tpu.topology,
        "numSlices": p.slices,
        "maxSliceRestarts": p.max_slice_restarts,
    }
    if p.spot:  # the controller merges workers[0].nodeSelector into the worker pods' and copies the grace
        worker["nodeSelector"] = capacity_node_selector(p)
        worker["terminationGracePeriodSeconds"] = worker_grace(p)
    trainer = {
        "name": TRAINER_CONTAINER,
        "image": p.image,
        "imagePullPolicy": "Always",
        "command": list(argv),
        # The controller appends JAX_PLATFORMS=proxy, XCLOUD_ENVIRONMENT and JAX_BACKEND_TARGET (the proxy).
        "env": env_list(pathways_trainer_env(p)) + job_identity_env(),
        "resources": pathways_trainer_resources(p),
    }
    controller: dict = {"deploymentMode": "default", "mainContainerName": TRAINER_CONTAINER}
    if p.num_elastic_slices:
        controller["elasticSlices"] = p.num_elastic_slices
    controller["template"] = {
        "spec": {
            # Without it JobSet's webhook defaults the head pod to OnFailure; Never replaces the pod instead.
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": grace,
            "serviceAccountName": p.service_account,
            "nodeSelector": {"cloud.google.com/gke-nodepool": p.head_nodepool},
            "containers": [trainer],
        }
    }
    spec: dict = {
        "maxRestarts": p.max_restarts,
        "pathwaysDir": p.scratch,
        "pathwaysVersion": p.pathways_tag,
        "workers": [worker],
        "controller": controller,
    }
    custom = [("pathways_server", p.server_image), ("worker", p.server_image), ("proxy_server", p.proxy_image)]
    if any(image for _, image in custom):
        spec["customComponents"] = [{"componentType": kind, "image": image} for kind, image in custom if image]
    manifest = {
        "apiVersion": PATHWAYSJOB_API,
        "kind": "PathwaysJob",
        "metadata": _metadata(p),
        "spec": spec,
    }
    backoff = tpu.hosts * (p.max_slice_restarts if p.num_elastic_slices else PATHWAYSJOB_INELASTIC_SLICE_RESTARTS)
    header = [
        *_header("pathwaysjob", p),
        "#",
        f"# Pathways on GKE as a PathwaysJob ({PATHWAYSJOB_API}, https://github.com/google/pathways-job):",
        "# its controller builds the JobSet: a pathways-head pod (the trainer container below, next to the",
        "# Pathways resource manager and proxy the controller adds) and one worker Job per TPU slice.",
        f"#   kubectl apply --server-side -f {PATHWAYSJOB_INSTALL}   # once per cluster",
        "#   kubectl apply -f THIS_FILE",
        f"#   {head_logs_command(p)}",
        f"# Needs the PathwaysJob controller (checked against {PATHWAYSJOB_RELEASE}) and the JobSet controller.",
        "#",
        "# What the controller makes of it:",
        f"#   workers: {p.slices} worker Job(s) of {tpu.hosts} {tpu.machine_type} host(s), topology "
        f"{tpu.topology}; backoffLimit {backoff}",
        "#            (hosts x maxSliceRestarts with elasticSlices > 0, else hosts x 4): a slice's pods restart",
        "#            in place before the failure escalates to a JobSet restart.",
        "#   elasticSlices: the proxy's --num_elastic_slices"
        f" ({p.num_elastic_slices or 'absent: elasticity off'}).",
        "#   controller.template: the head pod, with the resource manager and the proxy as native sidecars and",
        "#            JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET appended to the `trainer` container's env; its",
        f"#            terminationGracePeriodSeconds is the trainer's stop_timeout_seconds={stop:g} plus"
        f" {p.stop_margin} s; the trainer's",
        f"#            resources have requests == limits ({_quantities(pathways_trainer_resources(p))}), and so do"
        " the sidecars'",
        "#            (the controller's limits), so the head pod is of QoS class Guaranteed.",
        "#   maxRestarts: the JobSet's failurePolicy.maxRestarts, with no rules.",
        "#",
        "# The trainer's exit-code contract (trainer/errors.py) is NOT fully kept: the controller gives the head",
        "# Job backoffLimit 0 and no podFailurePolicy, so every non-zero exit fails it and restarts the JobSet:",
        "#   code                  PathwaysJob                           the contract              gap",
        "#   0                     the head Job succeeds; successPolicy  the run completes         -",
        "#                         (All, pathways-head) completes it",
        "#   42, an evicted pod    JobSet restart, counted               pod restart, no budget    counted",
        "#   75, 137, 134, 139,    JobSet restart, counted               pod restart, generous     whole JobSet,",
        "#   143                                                         counted budget            small budget",
        "#   1                     JobSet restart, counted               JobSet restart, counted   -",
        "#   2, 3                  JobSet restart, counted, until        JobSet fails at once      retried",
        f"#                         maxRestarts={p.max_restarts} is used up",
        "# For the whole contract, deploy the same run with the jobset-pathways target. --max-preemptions does",
        "# not apply here (every preemption is already counted against maxRestarts).",
        "# The proxy's resources are the controller's (16 CPUs, 100 GB): --proxy-memory and --proxy-cpu do not",
        "# apply.",
        *_capacity_header(p, "The worker pods (workers[0].nodeSelector)", tolerate=False),
    ]
    return Rendered(
        "pathwaysjob", f"{p.job_name}.pathwaysjob.yaml", manifest_text(header, manifest), argv, warnings, manifest
    )


def check_xpk_accepted(p: DeployParams) -> None:
    """xpk is refused unless the operator accepts what its JobSet does with the trainer's exit codes."""
    if not p.accept_xpk_failure_policy:
        raise DeployError(f"the xpk target is refused: {XPK_FAILURE_POLICY}. Fix: {XPK_FIX}")


def render_xpk(p: DeployParams) -> Rendered:
    check_xpk_accepted(p)
    argv, warnings, stop = _prepare(p, single_controller=True, check=p.check_pathways)
    warnings.insert(0, f"{XPK_FAILURE_POLICY} (accepted with {XPK_ACCEPT_FLAG})")
    if p.max_preemptions > 0:
        warnings.append(
            f"--max-preemptions={p.max_preemptions} is not applied: under xpk the first preemption already ends "
            "the workload"
        )
    if p.spot:
        warnings.append(
            "--capacity spot: xpk takes the capacity from the cluster (`xpk cluster create-pathways --spot`) and "
            "adds its own node selectors; the script passes none"
        )
    command = shlex.join(argv)
    if any(shlex.quote(a) != a for a in argv):
        warnings.append("some trainer arguments need shell quoting; check that xpk passes them through intact")
    elastic_flags = []
    if p.num_elastic_slices:
        elastic_flags = [
            f"--elastic-slices={p.num_elastic_slices} \\",
            f"--max-slice-restarts={p.max_slice_restarts} \\",
        ]
    env = [("ENABLE_PATHWAYS_PERSISTENCE", "1")]
    if p.cache_dir:
        env.append(("JAX_COMPILATION_CACHE_DIR", p.cache_dir))
    grace = pod_grace(p, stop)
    if grace > KUBERNETES_DEFAULT_GRACE_SECONDS:
        warnings.append(
            f"stop_timeout_seconds={stop:g} needs {grace} s of grace, but xpk leaves "
            f"the head pod (the trainer) at Kubernetes' default of {KUBERNETES_DEFAULT_GRACE_SECONDS} s: a longer "
            "stop is killed (exit 137); use the jobset-pathways target or a shorter stop_timeout_seconds"
        )
    values = {
        "header": _header("xpk", p),
        "workload": shlex.quote(p.job_name),
        "image": shlex.quote(p.image),
        "trainer_cmd": shlex.quote(command),
        "tpu_type": shlex.quote(p.tpu_type),
        "slices": str(p.slices),
        "scratch": shlex.quote(p.scratch),
        "elastic_flags": elastic_flags,
        "max_restarts": str(p.max_restarts),
        "grace_seconds": str(grace),
        "stop_timeout": f"{stop:g}",
        "stop_margin": str(p.stop_margin),
        "env_flags": [f"--env={shlex.quote(f'{k}={v}')} \\" for k, v in env],
    }
    text = fill(load_template("xpk_submit.sh.tmpl"), values)
    return Rendered("xpk", f"{p.job_name}.xpk.sh", text, argv, warnings)


# The slice pods' prelude: derive this pod's process id, then exec the trainer (the container's args).
# JOB_COMPLETION_INDEX is set by Kubernetes for Indexed Jobs; a process's slice is
# JAX_PROCESS_ID / NODES_PER_SLICE.
GPU_PRELUDE = "\n".join(
    [
        "set -euo pipefail",
        "export JAX_PROCESS_ID=$(( JOB_INDEX * NODES_PER_SLICE + JOB_COMPLETION_INDEX ))",
        'echo "JAX process ${JAX_PROCESS_ID}/${JAX_NUM_PROCESSES} (slice ${JOB_INDEX}), coordinator '
        '${JAX_COORDINATOR_ADDRESS}" >&2',
        'exec "$@"',
        "",
    ]
)


def gpu_prelude(nccl_profile: str) -> str:
    """GPU_PRELUDE, sourcing first the NCCL settings a GPUDirect mode's guide requires (not under `set -u`: the
    profile is GKE's script)."""
    if not nccl_profile:
        return GPU_PRELUDE
    return "\n".join(["set -eo pipefail", nccl_profile, "set -u", *GPU_PRELUDE.splitlines()[1:], ""])


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


def _networking_header(net: GpuNetworking) -> list[str]:
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


def render_jobset_gpu(p: DeployParams) -> Rendered:
    argv, warnings, stop = _prepare(p, single_controller=False, check=p.check_multiprocess)
    warnings += preemption_budget_warnings(p, p.nodes_per_slice)
    net = gpu_networking(p)
    gpu_resources = multiprocess_trainer_resources(p)
    coordinator = f"{p.job_name}-slice-0-0.{p.job_name}:{p.coordinator_port}"
    env = [("JAX_COORDINATOR_ADDRESS", coordinator)] + multiprocess_env(p) + list(net.trainer_env)
    trainer: dict = {
        "name": TRAINER_CONTAINER,
        "image": p.image,
        "imagePullPolicy": "Always",
        "command": ["bash", "-c", gpu_prelude(net.nccl_profile), "bash"],
        "args": list(argv),
        "env": [field_env("JOB_INDEX", "metadata.labels['jobset.sigs.k8s.io/job-index']")]
        + env_list(env)
        + job_identity_env(),
        "ports": [{"containerPort": p.coordinator_port, "protocol": "TCP"}],
        "resources": gpu_resources,
        # /dev/shm: a container's default is 64 MiB, too small for NCCL and the input pipeline's processes.
        "volumeMounts": [{"name": "shared-memory", "mountPath": "/dev/shm"}, *net.trainer_mounts],
    }
    pod: dict = {
        "restartPolicy": "Never",  # the Job replaces the pod; the podFailurePolicy needs it
        "serviceAccountName": p.service_account,
        "terminationGracePeriodSeconds": pod_grace(p, stop),
    }
    selector = capacity_node_selector(p)
    tolerations = spot_tolerations(p)
    if p.platform == "gpu":
        selector = {"cloud.google.com/gke-accelerator": p.gpu_accelerator, **selector}
        tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, *tolerations]
    if selector:
        pod["nodeSelector"] = selector
    if tolerations:
        pod["tolerations"] = tolerations
    if net.sidecars:
        pod["initContainers"] = list(net.sidecars)
    pod["containers"] = [trainer]
    pod["volumes"] = [
        {"name": "shared-memory", "emptyDir": {"medium": "Memory", "sizeLimit": p.shm_size}},
        *net.volumes,
    ]
    pod_template: dict = {"spec": pod}
    if net.annotations:
        pod_template = {"metadata": {"annotations": dict(net.annotations)}, "spec": pod}
    manifest = {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(p),
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": jobset_failure_policy(p, "slice"),
            # No successPolicy: the JobSet completes when every slice Job has.
            "replicatedJobs": [
                {
                    "name": "slice",
                    "replicas": p.slices,
                    "template": {"spec": {**trainer_job_policy(p, p.nodes_per_slice), "template": pod_template}},
                }
            ],
        },
    }
    header = [
        *_header("jobset-gpu", p),
        "#",
        f"# Multi-process JAX on GKE ({p.platform}): {p.slices} slice Job(s) x {p.nodes_per_slice} pod(s), one JAX"
        " process per",
        "# pod, process id = slice index x nodes_per_slice + pod index; process 0 hosts the coordination service.",
        "#   kubectl apply -f THIS_FILE",
        f"#   {gpu_logs_command(p)}   # process 0",
        "# Needs Kubernetes >= 1.29 (backoffLimitPerIndex, maxFailedIndexes and the FailIndex action: beta and on",
        "# by default in 1.29, GA in 1.33; podFailurePolicy: on by default since 1.26, GA in 1.31) and the JobSet",
        "# controller >= v0.6.0 (failurePolicy.rules).",
        "#",
        "# Fault tolerance: JAX_ENABLE_RECOVERABILITY=true (read by JAX at import, i.e. before",
        "# jax.distributed.initialize) keeps survivors alive when a peer dies; the Job replaces the dead pod",
        "# with the same process id, which rejoins. Losing process 0 ends every process; the Jobs then",
        "# replace all pods and the trainer resumes from its last checkpoint. With a podFailurePolicy a",
        "# replacement pod is created only once the old one has terminated, so no process id runs twice.",
        "#",
        "# The trainer's exit code (trainer/errors.py; every process exits with the same code for the same cause)",
        "# and what this manifest makes of it:",
        "#   0         every pod succeeds, every slice Job completes, and so does the JobSet (no successPolicy)",
        *_jobset_contract(p, "pod", " per process"),
        f"# The trainer stops within stop_timeout_seconds={stop:g} of a SIGTERM; each pod's",
        f"# terminationGracePeriodSeconds is that plus {p.stop_margin} s, for a saved checkpoint and exit 42"
        " before SIGKILL.",
        *_capacity_header(p, "The pods"),
        *_comment(
            f"Resources: the trainer requests {_quantities({'requests': gpu_resources['requests']})}"
            + (f" and limits nvidia.com/gpu={p.gpus_per_node}" if p.platform == "gpu" else "")
            + " (--trainer-cpu, --trainer-memory, --trainer-ephemeral-storage; no cpu or memory limit: the rest "
            f"of the node is the trainer's); /dev/shm is an emptyDir in memory of at most {p.shm_size} "
            "(--shm-size)."
        ),
        *_networking_header(net),
        "# The container's command is a bash prelude that derives the pod's JAX process id, then execs the",
        "# trainer (args).",
    ]
    return Rendered(
        "jobset-gpu", f"{p.job_name}.{p.platform}.yaml", manifest_text(header, manifest), argv, warnings, manifest
    )


def pyxis_image(image: str) -> str:
    """pyxis/enroot spell a registry image `registry#repository:tag` (e.g. nvcr.io#nvidia/jax:25.04)."""
    first, sep, rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost") and "#" not in image:
        return f"{first}#{rest}"
    return image


def render_slurm(p: DeployParams) -> Rendered:
    argv, warnings, stop = _prepare(p, single_controller=False, check=p.check_multiprocess)
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
        "header": _header("slurm", p),
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


RENDERERS: dict[str, Callable[[DeployParams], Rendered]] = {
    "jobset-pathways": render_jobset_pathways,
    "pathwaysjob": render_pathwaysjob,
    "xpk": render_xpk,
    "jobset-gpu": render_jobset_gpu,
    "slurm": render_slurm,
}


def all_targets(p: DeployParams, notes: list[str]) -> list[str]:
    """The targets `all` writes: every one, xpk only when accepted (else a note says why it is left out)."""
    if p.accept_xpk_failure_policy:
        return list(RENDERERS)
    notes.append(f"note (xpk): not written: {XPK_FAILURE_POLICY}. To write it too, pass {XPK_ACCEPT_FLAG}")
    return [t for t in RENDERERS if t != "xpk"]


def render(target: str, p: DeployParams) -> Rendered:
    if target not in RENDERERS:
        raise DeployError(f"unknown target {target!r}; choose from {', '.join(RENDERERS)}")
    return RENDERERS[target](p)


# ---------------------------------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    d = {f.name: f.default for f in dataclasses.fields(DeployParams)}
    ap = argparse.ArgumentParser(
        prog="python -m scripts.deploy.render",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Keys after `--` are extra trainer overrides, e.g. -- steps=5000 "
        "dataset_type=arrayrecord grain_train_files='gs://b/data/*.arrayrecord'",
    )
    ap.add_argument(
        "target",
        choices=[*RENDERERS, "all"],
        help="jobset-pathways (JobSet: the whole exit-code contract), pathwaysjob (PathwaysJob for its "
        f"controller: every non-zero exit restarts the run, counted), xpk (submit script; refused without "
        f"{XPK_ACCEPT_FLAG}: any non-zero exit fails the workload), jobset-gpu, slurm, or all of them (-o "
        f"DIRECTORY; xpk only with {XPK_ACCEPT_FLAG})",
    )
    ap.add_argument("-o", "--output", default="-", help="file to write (default stdout); a directory for `all`")
    run = ap.add_argument_group("the run (all targets)")
    run.add_argument("--slices", type=int, required=True, help="slices (TPU slices; GPU/CPU: groups of nodes)")
    run.add_argument(
        "--image", required=True, help="trainer image, e.g. us-docker.pkg.dev/PROJECT/REPO/trainer:TAG"
    )
    run.add_argument("--run-name", required=True, help="trainer run_name (fixed, so restarts resume the same run)")
    run.add_argument("--output-dir", required=True, help="trainer base_output_directory (gs://... for Pathways)")
    run.add_argument("--model", default=d["model"], help="model preset (configs/models/)")
    run.add_argument("--config", default=d["config"], help="trainer config file or name in configs/")
    run.add_argument("--name", default=d["name"], help="job/workload name (default: from --run-name)")
    run.add_argument("--namespace", default=d["namespace"])
    run.add_argument("--queue", default=d["queue"], help="Kueue LocalQueue name (Kubernetes targets)")
    run.add_argument("--service-account", default=d["service_account"])
    run.add_argument(
        "--max-restarts",
        type=int,
        default=d["max_restarts"],
        help="whole-run restarts after exit 1 (a bug) or a used-up --max-task-restarts: JobSet "
        "failurePolicy.maxRestarts, PathwaysJob maxRestarts, Slurm MAX_RESTARTS; under xpk and pathwaysjob "
        "every non-zero exit uses one",
    )
    run.add_argument(
        "--max-task-restarts",
        type=int,
        default=d["max_task_restarts"],
        help="restarts of one trainer process after exit 75 or a crash: JobSet backoffLimitPerIndex, "
        "Slurm MAX_TASK_RESTARTS (in place); xpk and pathwaysjob cannot express it",
    )
    run.add_argument(
        "--max-preemptions",
        type=int,
        default=d["max_preemptions"],
        help="budget of preemptions and evictions (exit 42, DisruptionTarget). JobSet targets: they are counted "
        "(podFailurePolicy Count) and the trainer Job's backoffLimit is this, which every counted pod failure of "
        "that Job in one JobSet attempt uses (75, crashes and 1 too); one more fails the JobSet. Slurm: requeues "
        "(SLURM_RESTART_COUNT). 0 (default): no bound",
    )
    run.add_argument(
        "--compile-cache",
        default=None,
        help="JAX persistent compilation cache dir (jax_cache_dir); default <output-dir>/jax_cache, '' disables",
    )
    k8s = ap.add_argument_group("Kubernetes pods (jobset-pathways, pathwaysjob, jobset-gpu)")
    k8s.add_argument(
        "--trainer-cpu",
        default=d["trainer_cpu"],
        help="trainer container's cpu: Pathways head requests == limits (default "
        f"{PATHWAYS_TRAINER_RESOURCES['cpu']}), jobset-gpu request (default {MULTIPROCESS_CPU_PER_GPU} per GPU)",
    )
    k8s.add_argument(
        "--trainer-memory",
        default=d["trainer_memory"],
        help="trainer container's memory: Pathways head requests == limits (default "
        f"{PATHWAYS_TRAINER_RESOURCES['memory']}), jobset-gpu request (default {MULTIPROCESS_MEMORY_GI_PER_GPU}Gi "
        "per GPU)",
    )
    k8s.add_argument(
        "--trainer-ephemeral-storage",
        default=d["trainer_ephemeral_storage"],
        help="trainer container's ephemeral-storage: Pathways head requests == limits (default "
        f"{PATHWAYS_TRAINER_RESOURCES['ephemeral-storage']}), jobset-gpu request (default none)",
    )
    k8s.add_argument(
        "--capacity",
        choices=CAPACITIES,
        default=d["capacity"],
        help=f"spot: the accelerator pods select GKE Spot nodes ({SPOT_NODE_LABEL}=true, with its toleration) and "
        "the trainer's stop_timeout_seconds fits Spot's notice (--spot-grace-seconds)",
    )
    k8s.add_argument(
        "--spot-grace-seconds",
        type=int,
        default=d["spot_grace_seconds"],
        help="seconds GKE gives a Spot pod after the preemption notice (default 15; raise it only to what your "
        "node pools' extended graceful termination gives)",
    )
    el = ap.add_argument_group("elasticity in the trainer")
    el.add_argument("--no-elastic", dest="elastic", action="store_false", help="elastic_enabled=false")
    el.add_argument(
        "--min-slices",
        type=int,
        default=d["min_slices"],
        help="elastic_min_slice_count: -1 = wait for all (pause-and-resume); 1..slices-1 = replica-resize",
    )
    el.add_argument("--elastic-timeout", type=float, default=d["elastic_timeout_seconds"])
    el.add_argument("--elastic-max-retries", type=int, default=d["elastic_max_retries"])
    el.add_argument("--checkpoint-period", type=int, default=d["checkpoint_period"])
    pw = ap.add_argument_group("Pathways on GKE (xpk, jobset-pathways, pathwaysjob)")
    pw.add_argument("--tpu-type", default=d["tpu_type"], help=f"one of {', '.join(sorted(TPU_TYPES))}")
    pw.add_argument(
        "--elastic-slices",
        type=int,
        default=None,
        help="slices Pathways may lose at once (default: 1 for pause-and-resume, slices - min-slices "
        "for replica-resize)",
    )
    pw.add_argument(
        "--max-slice-restarts",
        type=int,
        default=d["max_slice_restarts"],
        help="in-place restarts per slice: worker backoffLimit = hosts per slice x this (xpk and pathwaysjob: "
        "with elasticity only)",
    )
    pw.add_argument(
        "--pathways-gcs-location",
        default=d["pathways_gcs_location"],
        help="Pathways scratch (default <output-dir>/pathways)",
    )
    pw.add_argument(
        "--pathways-version",
        default=d["pathways_version"],
        help="tag of the Pathways images (default jax-<the trainer image's JAX>, --trainer-jax)",
    )
    pw.add_argument(
        "--trainer-jax",
        default=d["trainer_jax"],
        help="JAX version in the trainer image, checked against a Pathways image tag that names one "
        "(default: the pin of the Dockerfile's default TPU build, constraints/tpu-py3.11.txt)",
    )
    pw.add_argument("--server-image", default=d["server_image"])
    pw.add_argument("--proxy-image", default=d["proxy_image"])
    pw.add_argument("--proxy-memory", default=d["proxy_memory"], help="proxy memory limit (jobset-pathways)")
    pw.add_argument("--proxy-cpu", default=d["proxy_cpu"], help="proxy CPU limit (jobset-pathways)")
    pw.add_argument("--head-nodepool", default=d["head_nodepool"], help="CPU node pool of the head pod")
    pw.add_argument(
        XPK_ACCEPT_FLAG,
        dest="accept_xpk_failure_policy",
        action="store_true",
        help="write the xpk script although xpk's JobSet fails the workload on any non-zero trainer exit",
    )
    mp = ap.add_argument_group("multi-process JAX (jobset-gpu, slurm)")
    mp.add_argument("--platform", choices=("gpu", "cpu"), default=d["platform"])
    mp.add_argument("--nodes-per-slice", type=int, default=d["nodes_per_slice"])
    mp.add_argument("--gpus-per-node", type=int, default=d["gpus_per_node"])
    mp.add_argument("--gpu-accelerator", default=d["gpu_accelerator"], help="GKE cloud.google.com/gke-accelerator")
    mp.add_argument("--coordinator-port", type=int, default=d["coordinator_port"])
    mp.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=d["heartbeat_timeout_seconds"],
        help="seconds without a heartbeat before a process is declared dead",
    )
    mp.add_argument(
        "--collective-timeout",
        type=int,
        default=d["collective_timeout_seconds"],
        help="bound on a collective stuck waiting for a dead peer",
    )
    mp.add_argument(
        "--restart-backoff",
        type=int,
        default=d["restart_backoff_seconds"],
        help="Slurm: first in-place restart delay in seconds, doubling up to 600",
    )
    mp.add_argument("--xla-flag", action="append", default=[], help="extra XLA flag (repeatable)")
    mp.add_argument("--shm-size", default=d["shm_size"], help="jobset-gpu: sizeLimit of the in-memory /dev/shm")
    mp.add_argument(
        "--gpu-networking",
        choices=GPU_NETWORKING,
        default=d["gpu_networking"],
        help="jobset-gpu: GKE's GPUDirect setup, tcpxo (A3 Mega) or rdma (A3 Ultra, A4); default none",
    )
    mp.add_argument("--tcpxo-daemon-image", default=d["tcpxo_daemon_image"], help="tcpxo: the RxDM sidecar image")
    return ap


def params_from_args(ns: argparse.Namespace, overrides: Sequence[str]) -> DeployParams:
    return DeployParams(
        slices=ns.slices,
        image=ns.image,
        run_name=ns.run_name,
        output_dir=ns.output_dir,
        model=ns.model,
        config=ns.config,
        overrides=tuple(overrides),
        name=ns.name,
        namespace=ns.namespace,
        queue=ns.queue,
        service_account=ns.service_account,
        max_restarts=ns.max_restarts,
        elastic=ns.elastic,
        min_slices=ns.min_slices,
        elastic_timeout_seconds=ns.elastic_timeout,
        elastic_max_retries=ns.elastic_max_retries,
        checkpoint_period=ns.checkpoint_period,
        compile_cache=ns.compile_cache,
        tpu_type=ns.tpu_type,
        elastic_slices=ns.elastic_slices,
        max_slice_restarts=ns.max_slice_restarts,
        pathways_gcs_location=ns.pathways_gcs_location,
        pathways_version=ns.pathways_version,
        trainer_jax=ns.trainer_jax,
        server_image=ns.server_image,
        proxy_image=ns.proxy_image,
        proxy_memory=ns.proxy_memory,
        proxy_cpu=ns.proxy_cpu,
        head_nodepool=ns.head_nodepool,
        platform=ns.platform,
        nodes_per_slice=ns.nodes_per_slice,
        gpus_per_node=ns.gpus_per_node,
        gpu_accelerator=ns.gpu_accelerator,
        coordinator_port=ns.coordinator_port,
        heartbeat_timeout_seconds=ns.heartbeat_timeout,
        collective_timeout_seconds=ns.collective_timeout,
        max_task_restarts=ns.max_task_restarts,
        restart_backoff_seconds=ns.restart_backoff,
        extra_xla_flags=tuple(ns.xla_flag),
        accept_xpk_failure_policy=ns.accept_xpk_failure_policy,
        max_preemptions=ns.max_preemptions,
        trainer_cpu=ns.trainer_cpu,
        trainer_memory=ns.trainer_memory,
        trainer_ephemeral_storage=ns.trainer_ephemeral_storage,
        capacity=ns.capacity,
        spot_grace_seconds=ns.spot_grace_seconds,
        shm_size=ns.shm_size,
        gpu_networking=ns.gpu_networking,
        tcpxo_daemon_image=ns.tcpxo_daemon_image,
    )


def _write(r: Rendered, path: Path) -> None:
    path.write_text(r.text)
    if r.text.startswith("#!"):
        path.chmod(0o755)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1 :]
    ns = _parser().parse_args(argv)
    notes: list[str] = []
    try:
        p = params_from_args(ns, overrides)
        targets = all_targets(p, notes) if ns.target == "all" else [ns.target]
        results = [render(t, p) for t in targets]
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except DeployError as e:
        print(f"deploy error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    for r in results:
        for w in r.warnings:
            print(f"warning ({r.target}): {w}", file=sys.stderr)
    if ns.target == "all":
        if ns.output == "-":
            print("deploy error: `all` needs -o DIRECTORY", file=sys.stderr)
            return 2
        out = Path(ns.output)
        out.mkdir(parents=True, exist_ok=True)
        for r in results:
            _write(r, out / r.filename)
            print(out / r.filename)
    elif ns.output == "-":
        sys.stdout.write(results[0].text)
    else:
        _write(results[0], Path(ns.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
