"""jobset-gpu: a JobSet manifest for multi-process JAX on GKE (GPU, or CPU with --platform cpu): one pod per JAX
process, the exit-code contract, and GKE's GPUDirect networking (gpu_networking.py)."""

from __future__ import annotations

from scripts.deploy.artefact import Rendered, artefact_header, comment_lines
from scripts.deploy.capacity import capacity_header, capacity_node_selector, spot_tolerations
from scripts.deploy.failure_policy import (
    jobset_contract_header,
    jobset_failure_policy,
    preemption_budget_warnings,
    trainer_job_policy,
)
from scripts.deploy.gpu_networking import gpu_networking, networking_header
from scripts.deploy.graceful_stop import pod_grace
from scripts.deploy.manifest import (
    JOBSET_API,
    TRAINER_CONTAINER,
    env_list,
    field_env,
    job_identity_env,
    manifest_metadata,
    manifest_text,
    metrics_ports,
    scrape_annotations,
)
from scripts.deploy.multiprocess_env import multiprocess_env
from scripts.deploy.params import DeployParams
from scripts.deploy.resources import multiprocess_trainer_resources, quantities_text
from scripts.deploy.trainer_command import prepare

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


def gpu_logs_command(p: DeployParams) -> str:
    """`kubectl logs` of process 0 of a jobset-gpu run (Kubernetes labels a pod with its completion index)."""
    selector = (
        f"jobset.sigs.k8s.io/jobset-name={p.job_name},jobset.sigs.k8s.io/job-index=0,"
        "batch.kubernetes.io/job-completion-index=0"
    )
    return f"kubectl logs -f -l {selector} -c {TRAINER_CONTAINER}"


def render_jobset_gpu(p: DeployParams) -> Rendered:
    argv, warnings, stop = prepare(p, single_controller=False, check=p.check_multiprocess)
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
        "ports": [{"containerPort": p.coordinator_port, "protocol": "TCP"}, *metrics_ports(p)],
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
    annotations = {**net.annotations, **scrape_annotations(p)}
    if annotations:
        pod_template = {"metadata": {"annotations": annotations}, "spec": pod}
    manifest = {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": manifest_metadata(p),
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
        *artefact_header("jobset-gpu", p),
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
        *jobset_contract_header(p, "pod", " per process"),
        f"# The trainer stops within stop_timeout_seconds={stop:g} of a SIGTERM; each pod's",
        f"# terminationGracePeriodSeconds is that plus {p.stop_margin} s, for a saved checkpoint and exit 42"
        " before SIGKILL.",
        *capacity_header(p, "The pods"),
        *comment_lines(
            f"Resources: the trainer requests {quantities_text({'requests': gpu_resources['requests']})}"
            + (f" and limits nvidia.com/gpu={p.gpus_per_node}" if p.platform == "gpu" else "")
            + " (--trainer-cpu, --trainer-memory, --trainer-ephemeral-storage; no cpu or memory limit: the rest "
            f"of the node is the trainer's); /dev/shm is an emptyDir in memory of at most {p.shm_size} "
            "(--shm-size)."
        ),
        *networking_header(net),
        "# The container's command is a bash prelude that derives the pod's JAX process id, then execs the",
        "# trainer (args).",
    ]
    return Rendered(
        "jobset-gpu", f"{p.job_name}.{p.platform}.yaml", manifest_text(header, manifest), argv, warnings, manifest
    )
