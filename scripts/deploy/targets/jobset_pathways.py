"""jobset-pathways: a JobSet manifest running Pathways on GKE without xpk: the head pod (trainer, resource
manager and proxy) and one worker Job per TPU slice, with the whole exit-code contract."""

from __future__ import annotations

from scripts.deploy.artefact import Rendered, artefact_header, comment_lines
from scripts.deploy.capacity import capacity_header, capacity_node_selector, capacity_tolerations
from scripts.deploy.failure_policy import (
    jobset_contract_header,
    jobset_failure_policy,
    preemption_budget_warnings,
    trainer_job_policy,
)
from scripts.deploy.graceful_stop import pod_grace, worker_grace
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
from scripts.deploy.params import DeployParams
from scripts.deploy.pathways import (
    PATHWAYS_PROXY_PORT,
    PATHWAYS_RM_PORT,
    PATHWAYS_WORKER_PORT,
    head_logs_command,
    pathways_trainer_env,
)
from scripts.deploy.resources import PATHWAYS_RM_RESOURCES, guaranteed, pathways_trainer_resources, quantities_text
from scripts.deploy.trainer_command import prepare

# JobSet's annotation: one Job per value of this node label (the head alone on its node, a slice per node pool).
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"


def render_jobset_pathways(p: DeployParams) -> Rendered:
    argv, warnings, stop = prepare(p, single_controller=True, check=p.check_pathways)
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
                **({"ports": metrics_ports(p)} if p.metrics_port else {}),
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
        "metadata": manifest_metadata(p),
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
                                "metadata": {
                                    "annotations": {
                                        EXCLUSIVE_TOPOLOGY: "kubernetes.io/hostname",
                                        **scrape_annotations(p),
                                    }
                                },
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
        *artefact_header("jobset-pathways", p),
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
        *jobset_contract_header(p, "head pod", ""),
        "# A replaced head pod starts a new resource manager and proxy with the trainer; the worker Jobs stay,",
        "# and whatever a worker does when its resource manager goes away counts against its Job's backoffLimit.",
        f"# The trainer stops within stop_timeout_seconds={stop:g} of a SIGTERM; the head pod's",
        f"# terminationGracePeriodSeconds is that plus {p.stop_margin} s, for a saved checkpoint and exit 42"
        " before SIGKILL.",
        *capacity_header(p, "The worker pods (the TPU slices)"),
        *comment_lines(
            "Resources: every container of the head pod has requests == limits (QoS class Guaranteed: evicted "
            f"last): trainer {quantities_text(pathways_trainer_resources(p))} (--trainer-cpu, --trainer-memory, "
            f"--trainer-ephemeral-storage), pathways-rm {quantities_text(guaranteed(PATHWAYS_RM_RESOURCES))}, "
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
