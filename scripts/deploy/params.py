"""The one parameter object every renderer reads (DeployParams), its derived values, and the checks that refuse
parameters no deployment can use."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from scripts.deploy.capacity import CAPACITIES, DEFAULT_SPOT_GRACE_SECONDS
from scripts.deploy.errors import DeployError
from scripts.deploy.gpu_networking import GPU_NETWORKING, GPU_NETWORKING_ACCELERATORS, TCPXO_DAEMON_IMAGE
from scripts.deploy.graceful_stop import (
    DEFAULT_STOP_TIMEOUT_SECONDS,
    SPOT_STOP_MARGIN_SECONDS,
    STOP_MARGIN_SECONDS,
)
from scripts.deploy.pathways import PATHWAYS_IMAGE_REPO, default_trainer_jax
from scripts.deploy.resources import QUANTITY_RE, RESOURCE_FLAGS
from scripts.deploy.tpu import TPU_TYPES, TpuSlice
from trainer.distributed.internals import VersionError, check_pathways_image, pathways_image_jax

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
    "metrics_port": "--metrics-port",
}

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LEN = 40  # pod hostnames <name>-pathways-head-0-0 must stay within 63 characters


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
    # metrics_port: the trainer's live metrics for Prometheus, the trainer container's port `metrics` and the
    # pod's prometheus.io scrape annotations (Kubernetes targets); 0 = off.
    metrics_port: int = 0
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
            if value and not QUANTITY_RE.match(value):
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
        if not QUANTITY_RE.match(self.shm_size):
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
