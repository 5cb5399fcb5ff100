"""pathwaysjob: a PathwaysJob manifest for the PathwaysJob controller, which builds the JobSet itself and cannot
express the trainer's exit-code contract (a warning says what is lost)."""

from __future__ import annotations

import dataclasses

from scripts.deploy.artefact import Rendered, artefact_header
from scripts.deploy.capacity import SPOT_NODE_LABEL, capacity_header, capacity_node_selector
from scripts.deploy.graceful_stop import pod_grace, worker_grace
from scripts.deploy.manifest import (
    TRAINER_CONTAINER,
    env_list,
    job_identity_env,
    manifest_metadata,
    manifest_text,
    metrics_ports,
    scrape_annotations,
)
from scripts.deploy.params import DeployParams
from scripts.deploy.pathways import head_logs_command, pathways_trainer_env
from scripts.deploy.resources import pathways_trainer_resources, quantities_text
from scripts.deploy.trainer_command import prepare

PATHWAYSJOB_API = "pathways-job.pathways.domain/v1"
# The PathwaysJob release whose CRD and controller the pathwaysjob target follows (tests/fixtures/crds/).
PATHWAYSJOB_RELEASE = "v0.1.4"
PATHWAYSJOB_INSTALL = (
    f"https://github.com/google/pathways-job/releases/download/{PATHWAYSJOB_RELEASE}/install.yaml"
)
PATHWAYSJOB_INELASTIC_SLICE_RESTARTS = 4  # its worker backoffLimit is hosts x this without elasticSlices


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
    argv, warnings, stop = prepare(p, single_controller=True, check=p.check_pathways)
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
        **({"ports": metrics_ports(p)} if p.metrics_port else {}),
    }
    controller: dict = {"deploymentMode": "default", "mainContainerName": TRAINER_CONTAINER}
    if p.num_elastic_slices:
        controller["elasticSlices"] = p.num_elastic_slices
    controller["template"] = {
        **({"metadata": {"annotations": scrape_annotations(p)}} if p.metrics_port else {}),
        "spec": {
            # Without it JobSet's webhook defaults the head pod to OnFailure; Never replaces the pod instead.
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": grace,
            "serviceAccountName": p.service_account,
            "nodeSelector": {"cloud.google.com/gke-nodepool": p.head_nodepool},
            "containers": [trainer],
        },
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
        "metadata": manifest_metadata(p),
        "spec": spec,
    }
    backoff = tpu.hosts * (p.max_slice_restarts if p.num_elastic_slices else PATHWAYSJOB_INELASTIC_SLICE_RESTARTS)
    header = [
        *artefact_header("pathwaysjob", p),
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
        f"#            resources have requests == limits ({quantities_text(pathways_trainer_resources(p))}),"
        " and so do the sidecars'",
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
        *capacity_header(p, "The worker pods (workers[0].nodeSelector)", tolerate=False),
    ]
    return Rendered(
        "pathwaysjob", f"{p.job_name}.pathwaysjob.yaml", manifest_text(header, manifest), argv, warnings, manifest
    )
