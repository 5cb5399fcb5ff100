"""Running the rendered deploy scripts against stub commands (`xpk`, `srun`, `scontrol`, ...) on PATH, and a stub
PathwaysJob controller (the JobSet it would create for a rendered PathwaysJob)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

BASH = shutil.which("bash")


def stub(bin_dir: Path, name: str, body: str) -> None:
    """An executable `bin_dir/name` running the bash `body`."""
    bin_dir.mkdir(exist_ok=True)
    f = bin_dir / name
    f.write_text("#!/usr/bin/env bash\n" + body)
    f.chmod(0o755)


def run_xpk_script(tmp_path: Path, text: str, *args: str, cluster: tuple[str, str, str]) -> dict[str, list[str]]:
    """Run an xpk submit script (`text`) against a stub `xpk` that records its argv; the flags it passed to
    `xpk workload create-pathways`, as {flag: [values]}. `cluster`: PROJECT, ZONE, CLUSTER."""
    script = tmp_path / "submit.sh"
    script.write_text(text)
    record = tmp_path / "xpk_argv.json"
    stub(
        tmp_path / "bin",
        "xpk",
        f'python3 -c \'import json, sys; json.dump(sys.argv[1:], open("{record}", "w"))\' "$@"\n',
    )
    project, zone, name = cluster
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PROJECT": project, "ZONE": zone}
    env["CLUSTER"] = name
    out = subprocess.run([BASH, str(script), *args], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    argv = json.loads(record.read_text())
    assert argv[:2] == ["workload", "create-pathways"]
    flags: dict[str, list[str]] = {}
    for a in argv[2:]:
        k, _, v = a.partition("=")
        flags.setdefault(k, []).append(v)
    return flags


# ------------------------------------------------------------------------------------------------
# A stub PathwaysJob controller: the JobSet it would create for a rendered PathwaysJob.
# ------------------------------------------------------------------------------------------------
# google/pathways-job v0.1.4 (c0cc7594c9d03a1d96a89110008a0f2d3c9ef189), internal/controller/
# pathwaysjob_controller.go: MachineTypeToGKEAcceleratorTypeMap, and ChipsPerVM (8 for the *-8t types, else 4).
PATHWAYSJOB_MACHINE_TYPES = {
    "tpu7x-standard-4t": ("tpu7x", 4),
    "ct6e-standard-4t": ("tpu-v6e-slice", 4),
    "ct6e-standard-8t": ("tpu-v6e-slice", 8),
    "ct5p-hightpu-4t": ("tpu-v5p-slice", 4),
    "ct5lp-hightpu-4t": ("tpu-v5-lite-podslice", 4),
    "ct5lp-hightpu-8t": ("tpu-v5-lite-podslice", 8),
    "ct4p-hightpu-4t": ("tpu-v4-podslice", 4),
}
_TPU_VERSIONS = {  # MachineTypeToTPUVersionMap
    "tpu7x-standard-4t": "tpu7x",
    "ct6e-standard-4t": "tpuv6e",
    "ct6e-standard-8t": "tpuv6e1t",
    "ct5p-hightpu-4t": "tpuv5",
    "ct5lp-hightpu-4t": "tpuv5e",
    "ct5lp-hightpu-8t": "tpuv5e1t",
    "ct4p-hightpu-4t": "tpuv4",
}
# ValidTpuTopologiesMap, for the machine types the renderer uses (the controller rejects any other topology).
PATHWAYSJOB_TOPOLOGIES = {
    "ct5lp-hightpu-4t": "2x2 2x4 4x4 4x8 8x8 8x16 16x16".split(),
    "ct6e-standard-4t": "1x1 2x2 2x4 4x4 4x8 8x8 8x16 16x16".split(),
    "ct5p-hightpu-4t": (
        "2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x4x12 4x8x8 4x4x20 4x8x12 4x4x28 8x8x8 4x12x12 4x8x20 4x4x44 "
        "8x8x12 4x4x52 4x8x28 4x12x20 8x8x16 4x4x68 8x12x12 4x4x76 8x8x20 4x12x28 4x8x44 4x4x92 8x12x16 "
        "4x20x20 4x8x52 12x12x12 8x8x28 4x4x116 8x12x20 4x4x124 8x16x16 4x12x44 4x8x68 4x20x28 12x12x16 "
        "4x4x148 4x8x76 4x12x52 8x16x20 4x4x164 8x12x28 4x4x172 8x8x44 12x12x20 4x8x92 4x4x188 12x16x16 "
        "4x28x28 8x20x20 4x12x68 8x8x52 4x4x212 12x12x24 4x20x44 8x16x28 4x12x76 4x8x116 4x4x236 12x16x20 "
        "4x4x244 4x8x124 12x12x28 16x16x16 4x20x52 8x12x44 8x8x68 4x12x92 8x20x28 12x16x24 4x8x148 12x20x20 "
        "8x8x76 4x28x44 8x12x52 16x16x20 12x12x36 4x8x164 12x16x28 4x20x68 4x8x172 4x12x116 8x16x44 12x20x24 "
        "4x28x52 8x8x92 4x12x124 4x8x188 4x20x76 16x16x24 12x24x24 16x20x28"
    ).split(),
    "ct4p-hightpu-4t": (
        "2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x8x8 4x4x16 8x8x8 8x8x12 8x8x16 4x16x16 8x16x16"
    ).split(),
}
PATHWAYS_IMAGES = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"


def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def pathwaysjob_jobset(pw: dict) -> dict:
    """The JobSet the PathwaysJob controller creates for `pw` (deploymentMode default, a user pod template),
    rebuilt from its source: createJobSet, MakePathwaysHeadPodSpec, MakeResourceManagerContainer,
    MakeProxyContainer, injectJAXBackendTargetIntoMainContainer, MakePathwaysHeadReplicatedJob, MakeWorkerJob,
    MakeSuccessPolicy. Two values come from JobSet's webhook instead (it defaults a pod's restartPolicy to
    OnFailure) where the controller leaves them unset."""
    spec = pw["spec"]
    controller = spec["controller"]
    assert controller["deploymentMode"] == "default" and "template" in controller
    (worker,) = spec["workers"]
    accelerator, chips_per_vm = PATHWAYSJOB_MACHINE_TYPES[worker["type"]]
    chips = 1
    for d in worker["topology"].split("x"):
        chips *= int(d)
    vms = chips // chips_per_vm if chips >= chips_per_vm else 1
    elastic = controller.get("elasticSlices", 0)
    scratch = spec.get("pathwaysDir", "")
    version = spec.get("pathwaysVersion") or "latest"
    custom = {c["componentType"]: c for c in spec.get("customComponents", [])}

    def image(component: str, default: str) -> str:
        return custom.get(component, {}).get("image") or f"{PATHWAYS_IMAGES}/{default}:{version}"

    def flags(component: str, args: list[str]) -> list[str]:
        return args + custom.get(component, {}).get("customFlags", [])

    head = _field_env("PATHWAYS_HEAD", "metadata.labels['jobset.sigs.k8s.io/coordinator']")
    rm = {
        "name": "pathways-rm",
        "image": image("pathways_server", "server"),
        "imagePullPolicy": "Always",
        "args": flags(
            "pathways_server",
            [
                "--server_port=29001",
                f"--gcs_scratch_location={scratch}",
                "--node_type=resource_manager",
                f"--instance_count={worker['numSlices']}",
                f"--instance_type={_TPU_VERSIONS[worker['type']]}:{worker['topology']}",
            ],
        ),
        "env": [
            _field_env("REPLICATED_JOB_NAME", "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"),
            _field_env("JOBSET_NAME", "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"),
            _field_env("HOST_ADDRESS", "metadata.labels['jobset.sigs.k8s.io/coordinator']"),
            {"name": "TPU_SKIP_MDS_QUERY", "value": "true"},
        ],
        "ports": [{"containerPort": 29001}, {"containerPort": 29002}],
        "resources": {"limits": {"cpu": "8", "memory": "32G"}},
        "restartPolicy": "Always",
    }
    proxy_args = ["--server_port=29000", "--resource_manager_address=$(PATHWAYS_HEAD):29001"]
    proxy_args = flags("proxy_server", [*proxy_args, f"--gcs_scratch_location={scratch}"])
    if elastic > 0:
        proxy_args.append(f"--num_elastic_slices={elastic}")
    proxy = {
        "name": "pathways-proxy",
        "image": image("proxy_server", "proxy_server"),
        "imagePullPolicy": "Always",
        "args": proxy_args,
        "env": [head],
        "ports": [{"containerPort": 29000}],
        "resources": {"limits": {"cpu": "16", "memory": "100G"}},
        "restartPolicy": "Always",
    }
    head_pod = copy.deepcopy(controller["template"]["spec"])
    head_pod["hostNetwork"] = True
    head_pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    head_pod["initContainers"] = head_pod.get("initContainers", []) + [rm, proxy]
    head_pod.setdefault("restartPolicy", "OnFailure")  # JobSet's webhook default
    injected = [
        head,
        {"name": "JAX_PLATFORMS", "value": "proxy"},
        {"name": "XCLOUD_ENVIRONMENT", "value": "GCP"},
        {"name": "JAX_BACKEND_TARGET", "value": "grpc://$(PATHWAYS_HEAD):29000"},
    ]
    for c in head_pod["containers"]:
        if c["name"] == controller.get("mainContainerName", "main"):
            c["env"] = c.get("env", []) + copy.deepcopy(injected)
    annotations = {**pw["metadata"].get("annotations", {})}
    annotations[EXCLUSIVE_TOPOLOGY] = "kubernetes.io/hostname"
    worker_env = [
        {"name": "TPU_MIN_LOG_LEVEL", "value": "0"},
        {"name": "TF_CPP_MIN_LOG_LEVEL", "value": "0"},
        {"name": "XCLOUD_ENVIRONMENT", "value": "GCP"},
        {"name": "MEGASCALE_GRPC_ENABLE_XOR_TRACER", "value": "false"},
        _field_env("MEGASCALE_NUM_SLICES", "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"),
        _field_env("JOBSET_NAME", "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"),
        _field_env("REPLICATED_JOB_NAME", "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"),
        _field_env("MEGASCALE_SLICE_ID", "metadata.labels['jobset.sigs.k8s.io/job-index']"),
        head,
        _field_env("MEGASCALE_COORDINATOR_ADDRESS", "metadata.labels['jobset.sigs.k8s.io/coordinator']"),
    ]
    worker_pod = {
        "restartPolicy": "OnFailure",  # JobSet's webhook default
        "containers": [
            {
                "name": "pathways-worker",
                "image": image("worker", "server"),
                "imagePullPolicy": "Always",
                "args": flags(
                    "worker",
                    [
                        "--server_port=29005",
                        "--resource_manager_address=$(PATHWAYS_HEAD):29001",
                        f"--gcs_scratch_location={scratch}",
                    ],
                ),
                "env": worker_env,
                "ports": [{"containerPort": p} for p in (29005, 29006, 8471, 8080)],
                "volumeMounts": [{"name": "shared-tmp", "mountPath": "/tmp"}],
                "resources": {"limits": {"google.com/tpu": str(chips_per_vm)}},
            }
        ],
        "nodeSelector": {
            **worker.get("nodeSelector", {}),
            "cloud.google.com/gke-tpu-accelerator": accelerator,
            "cloud.google.com/gke-tpu-topology": worker["topology"],
        },
        "volumes": [{"name": "shared-tmp", "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}}],
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
    }
    if "terminationGracePeriodSeconds" in worker:
        worker_pod["terminationGracePeriodSeconds"] = worker["terminationGracePeriodSeconds"]
    slice_restarts = worker.get("maxSliceRestarts", 1)  # the CRD's default
    backoff = vms * (slice_restarts if elastic > 0 and slice_restarts > 0 else 4)
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            k: v for k, v in pw["metadata"].items() if k in ("name", "namespace", "labels", "annotations")
        },
        "spec": {
            "startupPolicy": {"startupPolicyOrder": "InOrder"},
            "failurePolicy": {"maxRestarts": spec.get("maxRestarts", 0)},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["pathways-head"]},
            "coordinator": {"replicatedJob": "pathways-head", "jobIndex": 0, "podIndex": 0},
            "replicatedJobs": [
                {
                    "name": "pathways-head",
                    "replicas": 1,
                    "template": {
                        "metadata": {"annotations": annotations},
                        "spec": {
                            "backoffLimit": 0,
                            "completions": 1,
                            "parallelism": 1,
                            "template": {"metadata": {"annotations": annotations}, "spec": head_pod},
                        },
                    },
                },
                {
                    "name": "worker",
                    "replicas": worker["numSlices"],
                    "template": {
                        "spec": {
                            "backoffLimit": backoff,
                            "completions": vms,
                            "parallelism": vms,
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
