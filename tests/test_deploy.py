"""Deployment artefacts, checked without a cluster or a Docker engine.

Every artefact is rendered from the same parameters by the scripts/deploy/ package (its command line:
scripts/deploy/render.py); here each one is parsed back (YAML, bash), its required structure checked, the
trainer command extracted from the rendered text and loaded with the trainer's own config loader, and the
shell scripts executed against stub `xpk` / `srun` / `python` commands to check the quoting and the restart
policy end to end.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_stubs import (
    BASH,
    PATHWAYSJOB_MACHINE_TYPES,
    PATHWAYSJOB_TOPOLOGIES,
    pathwaysjob_jobset,
    run_xpk_script,
    stub,
)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.deploy import render as R  # noqa: E402
from scripts.deploy.artefact import Rendered  # noqa: E402
from scripts.deploy.errors import DeployError  # noqa: E402
from scripts.deploy.failure_policy import BUG_EXIT_CODES, FINAL_EXIT_CODES, PREEMPTED_EXIT_CODES  # noqa: E402
from scripts.deploy.gpu_networking import RDMA_DOC, RDMA_INSTALLER, TCPXO_DAEMON_IMAGE, TCPXO_DOC, TCPXO_INSTALLER  # noqa: E402
from scripts.deploy.graceful_stop import DEFAULT_STOP_TIMEOUT_SECONDS  # noqa: E402
from scripts.deploy.manifest import manifest_text  # noqa: E402
from scripts.deploy.multiprocess_env import xla_flags  # noqa: E402
from scripts.deploy.params import DeployParams  # noqa: E402
from scripts.deploy.pathways import (  # noqa: E402
    DEFAULT_TPU_CONSTRAINTS,
    PATHWAYS_IMAGE_REPO,
    PATHWAYS_PROXY_PORT,
    PATHWAYS_RM_PORT,
    default_trainer_jax,
    head_logs_command,
)
from scripts.deploy.resources import PATHWAYS_TRAINER_RESOURCES  # noqa: E402
from scripts.deploy.shell_template import TEMPLATES, fill  # noqa: E402
from scripts.deploy.targets import render  # noqa: E402
from scripts.deploy.targets.slurm import pyxis_image  # noqa: E402
from scripts.deploy.targets.xpk import XPK_ACCEPT_FLAG, XPK_FAILURE_POLICY  # noqa: E402
from scripts.deploy.tpu import TPU_TYPES  # noqa: E402
from scripts.deploy.trainer_command import trainer_argv  # noqa: E402
from trainer.config import ConfigError, load_config  # noqa: E402

needs_bash = pytest.mark.skipif(BASH is None, reason="bash not installed")

IMAGE = "us-docker.pkg.dev/my-proj/trainer/trainer:v1"

# Two parameter sets: the reference run (3 x v5e-16, pause-and-resume) and a replica-resize run with
# extra trainer overrides, a larger model, a Kueue queue and 2 nodes per slice for the GPU targets. Both accept
# xpk's failure policy, so that the xpk target renders (test_xpk_is_refused_without_the_acknowledgement).
PARAM_SETS = {
    "reference": DeployParams(
        slices=3,
        image=IMAGE,
        run_name="qwen3-0.6b-elastic",
        output_dir="gs://my-bucket/runs",
        accept_xpk_failure_policy=True,
    ),
    "resize": DeployParams(
        slices=4,
        image=IMAGE + "-b",
        run_name="resize_run_2",
        output_dir="gs://other/exp",
        model="qwen3-4b",
        min_slices=2,
        tpu_type="v6e-32",
        max_slice_restarts=10,
        queue="team-queue",
        nodes_per_slice=2,
        compile_cache="gs://other/cache",
        elastic_timeout_seconds=600,
        checkpoint_period=50,
        accept_xpk_failure_policy=True,
        overrides=(
            "steps=5000",
            "dataset_type=arrayrecord",
            "grain_train_files=gs://other/data/*.arrayrecord",
            "learning_rate=1e-4",
        ),
    ),
}
PATHWAYS_TARGETS = ("xpk", "jobset-pathways", "pathwaysjob")
MULTIPROCESS_TARGETS = ("jobset-gpu", "slurm")
MANIFEST_TARGETS = ("jobset-pathways", "pathwaysjob", "jobset-gpu")  # Kubernetes objects, built as data


def _params(pset: str, **changes) -> DeployParams:
    import dataclasses

    return dataclasses.replace(PARAM_SETS[pset], **changes)


# ------------------------------------------------------------------------------------------------
# Extracting the trainer argv back out of each artefact's text.
# ------------------------------------------------------------------------------------------------
def _one_doc(text: str) -> dict:
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    assert len(docs) == 1, f"expected one YAML document, got {len(docs)}"
    return docs[0]


def _rjob(doc: dict, name: str) -> dict:
    jobs = {j["name"]: j for j in doc["spec"]["replicatedJobs"]}
    assert name in jobs, f"replicatedJob {name!r} missing; have {sorted(jobs)}"
    return jobs[name]


def _pod(rjob: dict) -> dict:
    return rjob["template"]["spec"]["template"]["spec"]


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _pathwaysjob_trainer(doc: dict) -> dict:
    """The PathwaysJob's main container: the one named by controller.mainContainerName."""
    controller = doc["spec"]["controller"]
    containers = {c["name"]: c for c in controller["template"]["spec"]["containers"]}
    return containers[controller["mainContainerName"]]


def extract_argv(target: str, text: str) -> list[str]:
    if target == "jobset-pathways":
        return _containers(_pod(_rjob(_one_doc(text), "pathways-head")))["trainer"]["command"]
    if target == "jobset-gpu":
        return _containers(_pod(_rjob(_one_doc(text), "slice")))["trainer"]["args"]
    if target == "pathwaysjob":
        return _pathwaysjob_trainer(_one_doc(text))["command"]
    if target == "xpk":
        (line,) = [l for l in text.splitlines() if l.startswith("TRAINER_CMD=")]
        (cmd,) = shlex.split(line[len("TRAINER_CMD=") :])  # the bash assignment's value: one word
        return shlex.split(cmd)  # xpk runs it through a shell
    if target == "slurm":
        (line,) = [l for l in text.splitlines() if l.startswith("TRAINER_ARGV=(")]
        assert line.endswith(")")
        return shlex.split(line[len("TRAINER_ARGV=(") : -1])
    raise AssertionError(target)


def _load(argv: list[str]):
    assert argv[:3] == ["python", "-m", "trainer.train"], argv
    return load_config(argv[3], argv[4:])


ALL = [(t, s) for t in (*PATHWAYS_TARGETS, *MULTIPROCESS_TARGETS) for s in PARAM_SETS]


# ------------------------------------------------------------------------------------------------
# Every artefact: the trainer command inside parses as a valid config with the expected keys.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target,pset", ALL)
def test_trainer_command_inside_every_artefact_loads(target, pset):
    p = PARAM_SETS[pset]
    r = render(target, p)
    argv = extract_argv(target, r.text)
    assert argv == r.trainer_argv
    cfg = _load(argv)
    assert cfg.mesh.enable_single_controller is (target in PATHWAYS_TARGETS)
    assert cfg.elastic.elastic_enabled is True
    assert cfg.elastic.elastic_min_slice_count == p.min_slices
    assert cfg.elastic.elastic_timeout_seconds == p.elastic_timeout_seconds
    assert cfg.mesh.num_slices == p.slices
    assert cfg.model.model == p.model
    assert cfg.train.run_name == p.run_name
    assert cfg.train.base_output_directory == p.output_dir
    assert cfg.train.jax_cache_dir == p.cache_dir
    assert cfg.checkpoint.checkpoint_period == p.checkpoint_period
    assert cfg.observe.log_format == "json"  # INFO on stdout, each line a JSON object with its severity
    if pset == "resize":
        assert cfg.train.steps == 5000 and cfg.data.dataset_type == "arrayrecord"
        assert cfg.optim.learning_rate == pytest.approx(1e-4)


@pytest.mark.parametrize("pset", PARAM_SETS)
def test_one_trainer_command_shared_by_all_artefacts(pset):
    """The same argv everywhere, except the controller mode that each target fixes."""
    p = PARAM_SETS[pset]
    argvs = {t: extract_argv(t, render(t, p).text) for t in (*PATHWAYS_TARGETS, *MULTIPROCESS_TARGETS)}
    assert (
        argvs["xpk"] == argvs["jobset-pathways"] == argvs["pathwaysjob"] == trainer_argv(p, single_controller=True)
    )
    assert argvs["jobset-gpu"] == argvs["slurm"] == trainer_argv(p, single_controller=False)
    swap = [a.replace("enable_single_controller=false", "enable_single_controller=true") for a in argvs["slurm"]]
    assert swap == argvs["xpk"]


# ------------------------------------------------------------------------------------------------
# JobSet for Pathways.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pset", PARAM_SETS)
def test_jobset_pathways_structure(pset):
    p = PARAM_SETS[pset]
    doc = _one_doc(render("jobset-pathways", p).text)
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert doc["kind"] == "JobSet"
    assert doc["metadata"]["name"] == p.job_name
    names = [j["name"] for j in doc["spec"]["replicatedJobs"]]
    assert len(names) == len(set(names)) and all(names)
    assert doc["spec"]["failurePolicy"]["maxRestarts"] == p.max_restarts
    assert doc["spec"]["successPolicy"]["targetReplicatedJobs"] == ["pathways-head"]
    if p.queue:
        assert doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == p.queue

    tpu = TPU_TYPES[p.tpu_type]
    head, worker = _rjob(doc, "pathways-head"), _rjob(doc, "worker")
    assert head["replicas"] == 1
    assert worker["replicas"] == p.slices  # one worker Job per slice
    wspec = worker["template"]["spec"]
    assert wspec["completions"] == wspec["parallelism"] == tpu.hosts
    # High backoffLimit: a slice's pods restart in place instead of escalating to a JobSet restart.
    assert wspec["backoffLimit"] == tpu.hosts * p.max_slice_restarts >= 20
    wpod = _pod(worker)
    assert wpod["restartPolicy"] == "OnFailure"
    assert wpod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
        "cloud.google.com/gke-tpu-topology": tpu.topology,
    }
    wc = _containers(wpod)["pathways-worker"]
    assert wc["resources"]["limits"]["google.com/tpu"] == str(tpu.chips_per_host)

    hpod = _pod(head)
    hc = _containers(hpod)
    assert {"trainer", "pathways-rm", "pathways-proxy"} <= set(hc)
    assert [c["name"] for c in hpod["containers"]] == ["trainer"]
    for sidecar in ("pathways-rm", "pathways-proxy"):  # native sidecars: stop when the trainer exits
        assert hc[sidecar]["restartPolicy"] == "Always"
    proxy_args = hc["pathways-proxy"]["args"]
    assert f"--num_elastic_slices={p.num_elastic_slices}" in proxy_args
    assert hc["pathways-proxy"]["resources"]["limits"]["memory"] == p.proxy_memory
    rm_args = hc["pathways-rm"]["args"]
    assert f"--instance_count={p.slices}" in rm_args
    assert f"--instance_type={tpu.instance_type}" in rm_args
    rm_address = f"--resource_manager_address={p.job_name}-pathways-head-0-0.{p.job_name}:{PATHWAYS_RM_PORT}"
    assert rm_address in proxy_args and rm_address in wc["args"]
    for args in (proxy_args, rm_args, wc["args"]):
        assert f"--gcs_scratch_location={p.scratch}" in args

    trainer = hc["trainer"]
    assert trainer["image"] == p.image
    env = _env(trainer)
    assert env["ENABLE_PATHWAYS_PERSISTENCE"] == "1"
    assert env["JAX_PLATFORMS"] == "proxy"
    assert env["JAX_BACKEND_TARGET"] == f"grpc://127.0.0.1:{PATHWAYS_PROXY_PORT}"
    assert env["JAX_COMPILATION_CACHE_DIR"] == p.cache_dir
    assert f"jax_cache_dir={p.cache_dir}" in trainer["command"]
    # The trainer's exit codes (tests/test_manifest_semantics.py checks what Kubernetes makes of them).
    hspec = head["template"]["spec"]
    assert hspec["completions"] == 1 and hspec["backoffLimitPerIndex"] == p.max_task_restarts
    actions = {r["action"]: r for r in hspec["podFailurePolicy"]["rules"]}
    assert actions["FailJob"]["onExitCodes"]["values"] == list(FINAL_EXIT_CODES)
    assert actions["FailIndex"]["onExitCodes"]["values"] == list(BUG_EXIT_CODES)
    assert hpod["restartPolicy"] == "Never"
    assert hpod["terminationGracePeriodSeconds"] == DEFAULT_STOP_TIMEOUT_SECONDS + 10


def test_elastic_slices_defaults_and_override():
    assert PARAM_SETS["reference"].num_elastic_slices == 1  # pause-and-resume
    assert PARAM_SETS["resize"].num_elastic_slices == 4 - 2  # replica-resize: slices - min
    p = _params("reference", elastic_slices=2)
    text = render("jobset-pathways", p).text
    assert "--num_elastic_slices=2" in text
    assert "--elastic-slices=2" in render("xpk", p).text


def test_no_elastic_drops_the_elastic_flags():
    p = _params("reference", elastic=False)
    doc = _one_doc(render("jobset-pathways", p).text)
    proxy = _containers(_pod(_rjob(doc, "pathways-head")))["pathways-proxy"]
    assert not any(a.startswith("--num_elastic_slices") for a in proxy["args"])
    assert "--elastic-slices=" not in render("xpk", p).text
    assert _load(render("xpk", p).trainer_argv).elastic.elastic_enabled is False


# ------------------------------------------------------------------------------------------------
# PathwaysJob (the PathwaysJob controller builds the JobSet; tests/deploy_stubs.py rebuilds it).
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pset", PARAM_SETS)
def test_pathwaysjob_structure(pset):
    p = PARAM_SETS[pset]
    r = render("pathwaysjob", p)
    doc = _one_doc(r.text)
    assert doc["apiVersion"] == "pathways-job.pathways.domain/v1" and doc["kind"] == "PathwaysJob"
    assert doc["metadata"]["name"] == p.job_name and doc["metadata"]["namespace"] == p.namespace
    if p.queue:  # the controller copies the labels to its JobSet, where Kueue reads them
        assert doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == p.queue
    spec = doc["spec"]
    tpu = TPU_TYPES[p.tpu_type]
    assert spec["maxRestarts"] == p.max_restarts
    assert spec["pathwaysDir"] == p.scratch and spec["pathwaysDir"].startswith("gs://")
    assert spec["pathwaysVersion"] == p.pathways_tag == f"jax-{default_trainer_jax()}"
    assert spec["workers"] == [
        {
            "type": tpu.machine_type,
            "topology": tpu.topology,
            "numSlices": p.slices,
            "maxSliceRestarts": p.max_slice_restarts,
        }
    ]
    controller = spec["controller"]
    assert controller["deploymentMode"] == "default"  # the head on CPU nodes, the TPUs for the workers
    assert controller["elasticSlices"] == p.num_elastic_slices >= 1
    assert "customComponents" not in spec  # the controller's images for pathwaysVersion
    pod = controller["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == DEFAULT_STOP_TIMEOUT_SECONDS + 10  # as the JobSet head
    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": p.head_nodepool}
    assert pod["serviceAccountName"] == p.service_account
    trainer = _pathwaysjob_trainer(doc)
    assert trainer["name"] == "trainer" and [c["name"] for c in pod["containers"]] == ["trainer"]
    assert trainer["image"] == p.image and trainer["command"] == r.trainer_argv
    env = _env(trainer)
    assert env["ENABLE_PATHWAYS_PERSISTENCE"] == "1" and env["JAX_COMPILATION_CACHE_DIR"] == p.cache_dir
    assert env["JOBSET_NAME"] == {"fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-name']"}}
    # The controller appends these to the main container; a second entry would be a duplicate key.
    assert not {"JAX_PLATFORMS", "JAX_BACKEND_TARGET", "XCLOUD_ENVIRONMENT", "PATHWAYS_HEAD"} & set(env)
    # The JobSet the controller makes of it: one worker Job per slice, in-place restarts per slice.
    js = pathwaysjob_jobset(doc)
    worker = _rjob(js, "worker")["template"]["spec"]
    assert _rjob(js, "worker")["replicas"] == p.slices and worker["completions"] == tpu.hosts
    assert worker["backoffLimit"] == tpu.hosts * p.max_slice_restarts
    head = _rjob(js, "pathways-head")["template"]["spec"]
    assert (
        f"--num_elastic_slices={p.num_elastic_slices}"
        in _containers(_pod(_rjob(js, "pathways-head")))["pathways-proxy"]["args"]
    )
    assert head["backoffLimit"] == 0 and "podFailurePolicy" not in head  # why the contract is lost


def test_pathwaysjob_warns_what_the_operator_loses(capsys):
    """The controller cannot express the exit-code contract: one line on stderr says what is lost."""
    p = PARAM_SETS["reference"]
    (warning,) = render("pathwaysjob", p).warnings
    for lost in ("exit 42", "evictions", "exit 75", "2 and 3", f"maxRestarts={p.max_restarts}", "jobset-pathways"):
        assert lost in warning, lost
    argv = ["pathwaysjob", "--slices", "3", "--image", IMAGE, "--run-name", "r", "--output-dir", "gs://b/r"]
    assert R.main(argv) == 0
    out = capsys.readouterr()
    (line,) = out.err.splitlines()
    assert line == f"warning (pathwaysjob): {warning}"
    assert _one_doc(out.out)["kind"] == "PathwaysJob"
    text = render("pathwaysjob", p).text  # and the file says it too
    assert "exit-code contract (trainer/errors.py) is NOT fully kept" in text
    assert head_logs_command(p) in text


def test_pathwaysjob_without_elasticity_and_with_own_images():
    p = _params("reference", elastic=False, max_slice_restarts=2, server_image="s:1", proxy_image="x:2")
    r = render("pathwaysjob", p)
    spec = _one_doc(r.text)["spec"]
    assert "elasticSlices" not in spec["controller"]
    assert spec["customComponents"] == [
        {"componentType": "pathways_server", "image": "s:1"},
        {"componentType": "worker", "image": "s:1"},
        {"componentType": "proxy_server", "image": "x:2"},
    ]
    # Without elasticSlices the controller ignores maxSliceRestarts (backoffLimit = hosts x 4): said so.
    assert any("--max-slice-restarts=2 is not applied" in w for w in r.warnings)
    js = pathwaysjob_jobset(_one_doc(r.text))
    assert _rjob(js, "worker")["template"]["spec"]["backoffLimit"] == TPU_TYPES[p.tpu_type].hosts * 4
    assert _load(r.trainer_argv).elastic.elastic_enabled is False
    proxy_limits = render("pathwaysjob", _params("reference", proxy_memory="200G")).warnings
    assert any("--proxy-memory=200G" in w and "100 GB" in w for w in proxy_limits)


def test_every_tpu_type_is_a_pathwaysjob_machine_type_and_topology():
    """The CRD's workers[].type enum, and the controller's topologies per machine type (v0.1.4)."""
    crd = _crd("PathwaysJob")
    types = crd["properties"]["spec"]["properties"]["workers"]["items"]["properties"]["type"]["enum"]
    for name, tpu in TPU_TYPES.items():
        assert tpu.machine_type in types, name
        accelerator, chips_per_vm = PATHWAYSJOB_MACHINE_TYPES[tpu.machine_type]
        assert (accelerator, chips_per_vm) == (tpu.gke_accelerator, tpu.chips_per_host), name
        assert tpu.topology in PATHWAYSJOB_TOPOLOGIES[tpu.machine_type], name


# ------------------------------------------------------------------------------------------------
# xpk submit script.
# ------------------------------------------------------------------------------------------------
def _bash_n(text: str, tmp_path: Path) -> None:
    f = tmp_path / "script.sh"
    f.write_text(text)
    out = subprocess.run([BASH, "-n", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@needs_bash
@pytest.mark.parametrize("target", ("xpk", "slurm"))
@pytest.mark.parametrize("pset", PARAM_SETS)
def test_shell_scripts_pass_bash_n(target, pset, tmp_path):
    _bash_n(render(target, PARAM_SETS[pset]).text, tmp_path)


@needs_bash
@pytest.mark.parametrize("pset", PARAM_SETS)
def test_xpk_script_runs_against_a_stub_xpk(pset, tmp_path):
    """Run the script with a fake `xpk` that records its argv: checks the flags and that the trainer
    command survives the shell quoting intact."""
    p = PARAM_SETS[pset]
    r = render("xpk", p)
    flags = run_xpk_script(tmp_path, r.text, "--priority=high", cluster=("my-proj", "us-east5-b", "my-cluster"))
    assert flags["--num-slices"] == [str(p.slices)]
    assert flags["--tpu-type"] == [p.tpu_type]
    assert flags["--docker-image"] == [p.image]
    assert flags["--workload"] == [p.job_name]
    assert flags["--project"] == ["my-proj"] and flags["--cluster"] == ["my-cluster"]
    assert flags["--elastic-slices"] == [str(p.num_elastic_slices)]
    assert flags["--max-slice-restarts"] == [str(p.max_slice_restarts)]
    assert flags["--max-restarts"] == [str(p.max_restarts)]
    assert flags["--termination-grace-period-seconds"] == [str(DEFAULT_STOP_TIMEOUT_SECONDS + 10)]
    assert flags["--pathways-gcs-location"] == [p.scratch]
    assert "ENABLE_PATHWAYS_PERSISTENCE=1" in flags["--env"]
    assert f"JAX_COMPILATION_CACHE_DIR={p.cache_dir}" in flags["--env"]
    assert flags["--priority"] == ["high"]  # extra flags pass through
    (command,) = flags["--command"]
    argv = shlex.split(command)
    assert argv == r.trainer_argv
    assert _load(argv).mesh.enable_single_controller is True


@needs_bash
def test_xpk_script_refuses_to_run_without_cluster_settings(tmp_path):
    script = tmp_path / "submit.sh"
    script.write_text(render("xpk", PARAM_SETS["reference"]).text)
    env = {k: v for k, v in os.environ.items() if k not in ("PROJECT", "ZONE", "CLUSTER")}
    out = subprocess.run([BASH, str(script)], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "PROJECT" in out.stderr


# ------------------------------------------------------------------------------------------------
# JobSet for multi-process JAX (GPU / CPU).
# ------------------------------------------------------------------------------------------------
def _trainer_codes(codes) -> dict:
    return {"containerName": "trainer", "operator": "In", "values": list(codes)}


@pytest.mark.parametrize("platform", ("gpu", "cpu"))
@pytest.mark.parametrize("pset", PARAM_SETS)
def test_jobset_gpu_structure(pset, platform):
    p = _params(pset, platform=platform)
    doc = _one_doc(render("jobset-gpu", p).text)
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    job = _rjob(doc, "slice")
    assert job["replicas"] == p.slices
    spec = job["template"]["spec"]
    assert spec["completions"] == spec["parallelism"] == p.nodes_per_slice
    assert spec["completionMode"] == "Indexed"
    # A budget per process (index), and one failed index fails the slice Job.
    assert spec["backoffLimitPerIndex"] == p.max_task_restarts >= 5 and spec["maxFailedIndexes"] == 0
    assert "backoffLimit" not in spec
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": _trainer_codes(FINAL_EXIT_CODES)} in rules
    assert {"action": "FailIndex", "onExitCodes": _trainer_codes(BUG_EXIT_CODES)} in rules
    assert {"action": "Ignore", "onExitCodes": _trainer_codes(PREEMPTED_EXIT_CODES)} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert doc["spec"]["failurePolicy"]["maxRestarts"] == p.max_restarts
    pod = _pod(job)
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == DEFAULT_STOP_TIMEOUT_SECONDS + 10
    trainer = _containers(pod)["trainer"]
    assert trainer["image"] == p.image
    env = _env(trainer)
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{p.job_name}-slice-0-0.{p.job_name}:{p.coordinator_port}"
    assert env["JAX_NUM_PROCESSES"] == str(p.slices * p.nodes_per_slice)
    assert env["JAX_ENABLE_RECOVERABILITY"] == "true"
    assert env["JAX_HEARTBEAT_TIMEOUT_SECONDS"] == str(p.heartbeat_timeout_seconds)
    assert env["JAX_COMPILATION_CACHE_DIR"] == p.cache_dir
    flags = env["XLA_FLAGS"].split()
    if platform == "gpu":
        assert "--xla_gpu_nccl_terminate_on_error=false" in flags
        assert env["XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"] == "1"
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == str(p.gpus_per_node)
        assert env["JAX_PLATFORMS"] == "cuda"
    else:
        assert f"--xla_cpu_collective_timeout_seconds={p.collective_timeout_seconds}" in flags
        assert "limits" not in trainer["resources"] and env["JAX_PLATFORMS"] == "cpu"
    assert _load(trainer["args"]).mesh.enable_single_controller is False


@pytest.mark.parametrize(
    "target,container", [("jobset-gpu", ("slice", "trainer")), ("jobset-pathways", ("pathways-head", "trainer"))]
)
def test_the_trainer_knows_its_job_so_a_restarted_pod_takes_over_the_runs_lease(target, container):
    doc = _one_doc(render(target, _params("reference")).text)
    env = _env(_containers(_pod(_rjob(doc, container[0])))[container[1]])
    assert env["JOBSET_NAME"] == {"fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-name']"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


@needs_bash
def test_jobset_gpu_prelude_computes_process_ids(tmp_path):
    """Run the container's command (bash prelude) with the env a pod would get, `env` as the program."""
    p = PARAM_SETS["resize"]  # 4 slices x 2 nodes
    trainer = _containers(_pod(_rjob(_one_doc(render("jobset-gpu", p).text), "slice")))["trainer"]
    command = trainer["command"]
    assert command[:2] == ["bash", "-c"]
    static_env = {k: v for k, v in _env(trainer).items() if isinstance(v, str)}
    seen = set()
    for job_index in range(p.slices):
        for pod_index in range(p.nodes_per_slice):
            env = {
                "PATH": os.environ["PATH"],
                **static_env,
                "JOB_INDEX": str(job_index),
                "JOB_COMPLETION_INDEX": str(pod_index),
            }
            out = subprocess.run([BASH, *command[1:], "env"], env=env, capture_output=True, text=True)
            assert out.returncode == 0, out.stderr
            got = dict(l.split("=", 1) for l in out.stdout.splitlines() if "=" in l)
            pid = int(got["JAX_PROCESS_ID"])
            seen.add(pid)
            assert pid // int(got["NODES_PER_SLICE"]) == job_index  # the trainer's slice of this process
    assert seen == set(range(p.slices * p.nodes_per_slice))


# ------------------------------------------------------------------------------------------------
# Slurm.
# ------------------------------------------------------------------------------------------------
def _sbatch(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            k, _, v = line[len("#SBATCH ") :].partition("=")
            out[k] = v
    return out


@pytest.mark.parametrize("platform", ("gpu", "cpu"))
@pytest.mark.parametrize("pset", PARAM_SETS)
def test_slurm_directives_and_env(pset, platform):
    p = _params(pset, platform=platform)
    text = render("slurm", p).text
    d = _sbatch(text)
    assert d["--nodes"] == str(p.slices * p.nodes_per_slice)
    assert d["--ntasks-per-node"] == "1"
    assert "--requeue" in d
    assert d["--signal"] == f"TERM@{DEFAULT_STOP_TIMEOUT_SECONDS + 10}"
    assert ("--gpus-per-node" in d) is (platform == "gpu")
    assert "export JAX_ENABLE_RECOVERABILITY=true" in text
    assert f"export JAX_COMPILATION_CACHE_DIR={shlex.quote(p.cache_dir)}" in text
    assert "CONTAINER_MOUNTS=${CONTAINER_MOUNTS-''}" in text  # gs:// outputs need no bind mount
    if platform == "gpu":
        assert "--xla_gpu_nccl_terminate_on_error=false" in text
        assert "export XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE=1" in text
    else:
        assert "--xla_cpu_collective_timeout_seconds=" in text


def _fake_slurm(tmp_path: Path, script_text: str, python_body: str, extra_env: dict | None = None):
    """Run the sbatch script with stub srun/scontrol (N tasks, one after the other) and a stub python."""
    stub(tmp_path / "bin", "scontrol", 'printf "node-a\\nnode-b\\nnode-c\\nnode-d\\n"\n')
    # srun: skip its own options, then run the command once per task with SLURM_PROCID set.
    stub(
        tmp_path / "bin",
        "srun",
        r"""
while [[ "$1" == --* ]]; do shift; done
rc=0
for (( i = 0; i < SLURM_NTASKS; i++ )); do
  SLURM_PROCID=$i "$@" || rc=$?
done
exit $rc
""",
    )
    stub(tmp_path / "bin", "python", python_body)
    script = tmp_path / "job.sbatch"
    script.write_text(script_text)
    env = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-[a-d]",
        "SLURM_NTASKS": "2",
        "CONTAINER_IMAGE": "",
        "RESTART_BACKOFF_SECONDS": "0",
        "LOG": str(tmp_path / "log"),
        **(extra_env or {}),
    }
    return subprocess.run([BASH, str(script)], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)


@needs_bash
def test_slurm_tasks_get_process_ids_and_restart_in_place(tmp_path):
    p = _params("reference", nodes_per_slice=1)
    text = render("slurm", p).text
    # The fake trainer is killed once per task (exit 137: SIGKILL), then succeeds; it logs its ids and argv.
    body = r"""
echo "$SLURM_PROCID $JAX_PROCESS_ID $JAX_NUM_PROCESSES $JAX_COORDINATOR_ADDRESS $NODES_PER_SLICE $*" >> "$LOG"
marker="$LOG.$SLURM_PROCID"
if [[ ! -e "$marker" ]]; then touch "$marker"; exit 137; fi
exit 0
"""
    out = _fake_slurm(tmp_path, text, body)
    assert out.returncode == 0, out.stderr
    runs = [l.split(" ", 5) for l in (tmp_path / "log").read_text().splitlines()]
    assert [r[0] for r in runs] == ["0", "0", "1", "1"]  # each task restarted once, in place
    for procid, pid, nprocs, coord, nodes_per_slice, rest in runs:
        assert pid == procid and nprocs == "2" and coord == f"node-a:{p.coordinator_port}"
        assert nodes_per_slice == "1"
        assert ["python", *shlex.split(rest)] == trainer_argv(p, single_controller=False)
    assert "restart 1/" in out.stderr


@needs_bash
@pytest.mark.parametrize("code", FINAL_EXIT_CODES)
def test_slurm_does_not_restart_final_exits(tmp_path, code):
    text = render("slurm", PARAM_SETS["reference"]).text
    out = _fake_slurm(tmp_path, text, f'echo run >> "$LOG"; exit {code}\n')
    assert out.returncode == code
    assert (tmp_path / "log").read_text().count("run") == 2  # once per task, no restart
    assert "not restarted" in out.stderr


@needs_bash
def test_slurm_gives_up_after_max_task_restarts(tmp_path):
    text = render("slurm", PARAM_SETS["reference"]).text
    out = _fake_slurm(
        tmp_path, text, 'echo run >> "$LOG"; exit 137\n', {"SLURM_NTASKS": "1", "MAX_TASK_RESTARTS": "2"}
    )
    assert out.returncode == 137
    assert (tmp_path / "log").read_text().count("run") == 3  # first run + 2 restarts
    assert "no restarts left" in out.stderr


@needs_bash
def test_slurm_mounts_shared_output_dirs_into_the_container(tmp_path):
    shared = tmp_path / "shared"
    p = _params("reference", output_dir=str(shared / "runs"))
    text = render("slurm", p).text
    stub(tmp_path / "bin", "srun", 'printf "%s\\n" "$@" > "$LOG"\n')
    stub(tmp_path / "bin", "scontrol", "echo node-a\n")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_NTASKS": "1",
        "LOG": str(tmp_path / "srun_args"),
    }
    out = subprocess.run([BASH, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    args = (tmp_path / "srun_args").read_text().splitlines()
    runs, cache = shared / "runs", shared / "runs" / "jax_cache"
    assert f"--container-mounts={runs}:{runs}" in args  # the cache lives inside it
    assert f"--container-image={pyxis_image(p.image)}" in args
    assert runs.is_dir() and cache.is_dir()


def test_pyxis_image_names():
    assert pyxis_image("us-docker.pkg.dev/p/r/t:v1") == "us-docker.pkg.dev#p/r/t:v1"
    assert pyxis_image("nvcr.io/nvidia/jax:25.04") == "nvcr.io#nvidia/jax:25.04"
    assert pyxis_image("ubuntu:22.04") == "ubuntu:22.04"
    assert pyxis_image("myuser/trainer:v1") == "myuser/trainer:v1"


# ------------------------------------------------------------------------------------------------
# Bad input fails at render time, with the trainer loader's own message.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", (*PATHWAYS_TARGETS, *MULTIPROCESS_TARGETS))
def test_bad_trainer_key_fails_rendering(target):
    p = _params("reference", overrides=("learning_rat=1e-4",))
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rat'.*did you mean 'learning_rate'"):
        render(target, p)


def test_bad_trainer_value_fails_rendering():
    with pytest.raises(ConfigError, match="elastic_min_slice_count"):
        render("jobset-pathways", _params("reference", min_slices=7))
    with pytest.raises(ConfigError, match="unknown model preset"):
        render("slurm", _params("reference", model="qwen9-1t"))


def test_cli_reports_config_errors_with_exit_2(capsys):
    rc = R.main(
        ["jobset-pathways", "--slices", "3", "--image", IMAGE, "--run-name", "r", "--output-dir", "gs://b/r"]
        + ["--", "stepz=10"]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "config error: unknown config key 'stepz'" in err and "did you mean 'steps'" in err


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"overrides": ("num_slices=4",)}, "num_slices.*--slices"),
        ({"overrides": ("enable_single_controller=false",)}, "enable_single_controller"),
        ({"output_dir": "runs"}, "Cloud Storage"),
        ({"tpu_type": "v9-16"}, "unknown --tpu-type"),
        ({"elastic_slices": 5}, "between 1 and --slices=3"),
        ({"run_name": "", "name": "x"}, "--run-name is required"),
        (
            {"run_name": "Run_With_A_Very_Long_Name_That_Does_Not_Fit_In_A_Pod_Hostname_At_All", "name": "-bad"},
            "DNS label",
        ),
    ],
)
def test_pathways_parameter_errors(changes, match):
    with pytest.raises(DeployError, match=match):
        render("jobset-pathways", _params("reference", **changes))


@pytest.mark.parametrize("target", ["xpk", "jobset-pathways", "pathwaysjob"])
def test_a_pathways_image_for_another_jax_than_the_trainers_is_refused(target, capsys):
    """The Pathways servers and the trainer (their client) run one JAX release: an image tag naming another
    is refused before anything is written (exit 2); `latest` and a matching tag render."""
    trainer_jax = default_trainer_jax()
    assert trainer_jax == re.search(r"^jax==(\S+)$", DEFAULT_TPU_CONSTRAINTS.read_text(), re.M).group(1)
    with pytest.raises(DeployError, match=f"built for JAX 0.1.0, but the trainer .* runs JAX {trainer_jax}"):
        render(target, _params("reference", pathways_version="jax-0.1.0"))
    render(target, _params("reference", pathways_version=f"jax-{trainer_jax}"))
    render(target, _params("reference", pathways_version="jax-0.1.0", trainer_jax="0.1.0"))
    render(target, _params("reference", pathways_version="latest"))  # no version to compare
    argv = [target, "--slices", "3", "--image", IMAGE, "--run-name", "r", "--output-dir", "gs://b/r"]
    argv += [XPK_ACCEPT_FLAG] if target == "xpk" else []
    assert R.main([*argv, "--pathways-version", "jax-0.1.0", "-o", os.devnull]) == 2
    assert "--pathways-version=jax-" in capsys.readouterr().err


def test_multiprocess_output_dir_must_be_shared():
    with pytest.raises(DeployError, match="every host sees"):
        render("slurm", _params("reference", output_dir="runs"))
    render("slurm", _params("reference", output_dir="/lustre/runs"))  # a shared filesystem is fine


def test_values_yaml_would_reinterpret_reach_the_trainer_unchanged():
    """Text keys are literal to the trainer, so a run name like 'true' or '1e3' is not turned into
    another value on the way (render checks it reads back the same)."""
    for name in ("true", "1e3", "007"):
        out = render("jobset-gpu", _params("reference", run_name=name, name="r"))
        assert f"run_name={name}" in out.trainer_argv


def test_job_name_derivation():
    assert PARAM_SETS["resize"].job_name == "resize-run-2"
    assert _params("reference", run_name="2025_Qwen.Run").job_name == "r-2025-qwen-run"


ALL_ARGV = ["--slices", "2", "--image", IMAGE, "--run-name", "cli-run", "--output-dir", "gs://b/runs"]
ALL_ARGV += ["--min-slices", "1"]


def test_cli_all_writes_every_artefact(tmp_path):
    rc = R.main(["all", "-o", str(tmp_path), *ALL_ARGV, XPK_ACCEPT_FLAG, "--", "steps=20"])
    assert rc == 0
    files = sorted(f.name for f in tmp_path.iterdir())
    assert files == sorted(
        [
            "cli-run.xpk.sh",
            "cli-run.pathways.yaml",
            "cli-run.pathwaysjob.yaml",
            "cli-run.gpu.yaml",
            "cli-run.sbatch",
        ]
    )
    assert os.access(tmp_path / "cli-run.xpk.sh", os.X_OK)
    for target, fname in (
        ("xpk", "cli-run.xpk.sh"),
        ("jobset-pathways", "cli-run.pathways.yaml"),
        ("pathwaysjob", "cli-run.pathwaysjob.yaml"),
        ("jobset-gpu", "cli-run.gpu.yaml"),
        ("slurm", "cli-run.sbatch"),
    ):
        cfg = _load(extract_argv(target, (tmp_path / fname).read_text()))
        assert cfg.train.steps == 20 and cfg.elastic.elastic_min_slice_count == 1


def test_cli_all_leaves_out_xpk_without_the_acknowledgement_and_says_so(tmp_path, capsys):
    """`all` writes every other artefact; xpk only with --accept-xpk-failure-policy (a note says why not)."""
    assert R.main(["all", "-o", str(tmp_path), *ALL_ARGV]) == 0
    files = sorted(f.name for f in tmp_path.iterdir())
    assert files == sorted(
        ["cli-run.pathways.yaml", "cli-run.pathwaysjob.yaml", "cli-run.gpu.yaml", "cli-run.sbatch"]
    )
    err = capsys.readouterr().err
    (note,) = [line for line in err.splitlines() if line.startswith("note (xpk)")]
    assert "not written" in note and XPK_ACCEPT_FLAG in note and "restartStrategy Recreate" in note


def test_xpk_is_refused_without_the_acknowledgement(capsys):
    """Current xpk builds its JobSet with restartStrategy Recreate and no maxRestarts: any non-zero exit fails the
    workload. `render xpk` refuses (exit 2) naming that and the fix; with the flag it renders, with a warning."""
    p = _params("reference", accept_xpk_failure_policy=False)
    with pytest.raises(DeployError, match="restartStrategy Recreate and no maxRestarts") as caught:
        render("xpk", p)
    assert "jobset-pathways" in str(caught.value) and XPK_ACCEPT_FLAG in str(caught.value)
    argv = ["xpk", "--slices", "3", "--image", IMAGE, "--run-name", "r", "--output-dir", "gs://b/r"]
    assert R.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("deploy error: the xpk target is refused") and XPK_ACCEPT_FLAG in err
    assert R.main([*argv, XPK_ACCEPT_FLAG]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("#!") and f"warning (xpk): {XPK_FAILURE_POLICY}" in out.err
    assert "restartStrategy Recreate" in out.out
    assert render("xpk", PARAM_SETS["reference"]).warnings[0].startswith(XPK_FAILURE_POLICY)


def test_template_filler():
    assert fill("a: {{x}}\n  {{blk}}\nb\n", {"x": "1", "blk": ["- p", "- q"]}) == "a: 1\n  - p\n  - q\nb\n"
    assert fill("a\n  {{blk}}\nb\n", {"blk": []}) == "a\nb\n"
    with pytest.raises(KeyError, match="no value"):
        fill("{{missing}}", {})
    with pytest.raises(KeyError, match="not used"):
        fill("x", {"extra": "1"})
    with pytest.raises(KeyError, match="alone on its line"):
        fill("a: {{blk}}", {"blk": ["x"]})


# ------------------------------------------------------------------------------------------------
# Manifests as data: the YAML text is the dict the renderer built.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", MANIFEST_TARGETS)
@pytest.mark.parametrize("pset", PARAM_SETS)
def test_manifest_text_is_the_built_object(target, pset):
    r = render(target, PARAM_SETS[pset])
    assert r.manifest is not None and _one_doc(r.text) == r.manifest
    assert all(line.startswith("#") for line in r.text[: r.text.index("apiVersion:")].splitlines())


def test_strings_that_look_like_numbers_stay_strings():
    """A YAML 1.1 reader (PyYAML) and Kubernetes' (go-yaml: 1e3 is a float there) read every string back as
    a string: label and selector values, env values, resource quantities."""
    p = _params("reference", queue="1e3", head_nodepool="0o17", service_account="true", proxy_cpu="16")
    for target in ("jobset-pathways", "pathwaysjob"):
        text = render(target, p).text
        assert "queue-name: '1e3'" in text and "gke-nodepool: '0o17'" in text
        doc = _one_doc(text)
        assert doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "1e3"
    dumped = manifest_text(["# x"], {"a": "1e3", "b": "+1.5e-3", "c": "0x1F", "d": 7, "e": "7", "f": "a\nb\n"})
    assert dumped == "# x\na: '1e3'\nb: '+1.5e-3'\nc: '0x1F'\nd: 7\ne: '7'\nf: |\n  a\n  b\n"


def test_only_the_shell_scripts_are_templates():
    assert sorted(t.name for t in TEMPLATES.iterdir()) == ["slurm.sbatch.tmpl", "xpk_submit.sh.tmpl"]


# ------------------------------------------------------------------------------------------------
# Schema validation: every rendered JobSet and PathwaysJob against its CRD's openAPIV3Schema (vendored in
# tests/fixtures/crds/, see its README), and the Job and pod templates inside against Kubernetes' own schemas
# (kubernetes-validate). The CRD schemas are adapted for jsonschema as the README explains: strict
# (unknown fields are errors, as under `kubectl apply`'s default --validate=strict), x-kubernetes-list-type
# checked, int32/int64 ranges checked; CEL rules (x-kubernetes-validations) are not evaluated.
# ------------------------------------------------------------------------------------------------
CRDS = REPO / "tests" / "fixtures" / "crds"
CRD_FILES = {
    "JobSet": ("jobset.x-k8s.io_jobsets.yaml", "jobset.x-k8s.io", "v1alpha2"),
    "PathwaysJob": ("pathways-job.pathways.domain_pathwaysjobs.yaml", "pathways-job.pathways.domain", "v1"),
}
# Kubernetes versions the Job and pod templates are validated against besides the newest one that
# kubernetes-validate bundles: the oldest the manifests are documented for (backoffLimitPerIndex, FailIndex,
# native sidecars: beta and on by default in 1.29).
KUBERNETES_VERSIONS = ("1.29",)


def _needs(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"{module} is missing: install the test extra (pip install -e '.[test]')")


@functools.cache
def _crd(kind: str) -> dict:
    """The openAPIV3Schema of the served version of the vendored CRD for `kind`."""
    filename, group, version = CRD_FILES[kind]
    crd = yaml.load((CRDS / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == group
    assert crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"] and served["storage"]
    return served["schema"]["openAPIV3Schema"]


def strict_schema(node, *, strict: bool = True):
    """A CRD's structural schema as a JSON schema for jsonschema (the README of tests/fixtures/crds/):

    - an object with `properties` and no `additionalProperties` gets `additionalProperties: false`: the
      API server's strict field validation (kubectl's default) rejects an unknown field; with `strict=False`
      the schema is left open, as the API server treats `x-kubernetes-preserve-unknown-fields` (prune nothing,
      reject nothing), which this adaptation does NOT apply below such a node either: the one such node here,
      the PathwaysJob's controller.template, is decoded by its controller into a Kubernetes PodTemplateSpec,
      which drops an unknown field silently, so a misspelt field there must fail here;
    - `x-kubernetes-int-or-string` without its `anyOf` becomes `anyOf: [integer, string]`; `nullable` allows
      null.
    """
    if isinstance(node, list):
        return [strict_schema(n, strict=strict) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v, strict=strict) for k, v in node.items()}
    if strict and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _list_type(validator, list_type, instance, schema):
    """x-kubernetes-list-type: `set` items and `map` keys (x-kubernetes-list-map-keys) must be unique."""
    jsonschema = _needs("jsonschema")
    if not validator.is_type(instance, "array") or list_type not in ("set", "map"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    seen = set()
    for item in instance:
        key = json.dumps(item if list_type == "set" else [item.get(k) for k in keys], sort_keys=True)
        if key in seen:
            what = "item" if list_type == "set" else f"entry with {'/'.join(keys)}"
            yield jsonschema.ValidationError(f"duplicate {what} {key} in a list of type {list_type}")
        seen.add(key)


@functools.cache
def crd_validator(kind: str):
    jsonschema = _needs("jsonschema")
    formats = jsonschema.FormatChecker(formats=())
    for name, bits in (("int32", 32), ("int64", 64)):
        formats.checks(name)(
            lambda v, bits=bits: not isinstance(v, int) or -(2 ** (bits - 1)) <= v < 2 ** (bits - 1)
        )
    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-kubernetes-list-type": _list_type})
    schema = strict_schema(_crd(kind))
    cls.check_schema(schema)
    return cls(schema, format_checker=formats)


def core_objects(doc: dict) -> list[dict]:
    """The Kubernetes core objects inside a manifest: a batch/v1 Job per replicatedJob of a JobSet, a v1
    PodTemplate around a PathwaysJob's controller.template."""
    name = doc["metadata"]["name"]
    if doc["kind"] == "JobSet":
        return [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {**rj["template"].get("metadata", {}), "name": f"{name}-{rj['name']}"},
                "spec": rj["template"]["spec"],
            }
            for rj in doc["spec"]["replicatedJobs"]
        ]
    assert doc["kind"] == "PathwaysJob", doc["kind"]
    template = doc["spec"]["controller"]["template"]
    return [
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-head"}, "template": template}
    ]


def validate_manifest(doc: dict) -> list[str]:
    """Raise on the first schema violation; otherwise return what was validated."""
    kv = _needs("kubernetes_validate")
    crd_validator(doc["kind"]).validate(doc)
    checked = [f"{doc['kind']} {doc['metadata']['name']} (CRD)"]
    for version in (*KUBERNETES_VERSIONS, kv.latest_version()):
        for obj in core_objects(doc):
            got = kv.validate(obj, version, strict=True)
            checked.append(f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {got})")
    return checked


SCHEMA_CASES = [
    (target, pset, platform)
    for target in MANIFEST_TARGETS
    for pset in PARAM_SETS
    for platform in (("gpu", "cpu") if target == "jobset-gpu" else ("gpu",))
]


@pytest.mark.parametrize("target,pset,platform", SCHEMA_CASES)
def test_rendered_manifests_validate_against_their_schemas(target, pset, platform):
    p = _params(pset, platform=platform, overrides=(*PARAM_SETS[pset].overrides, "stop_timeout_seconds=45"))
    doc = _one_doc(render(target, p).text)
    kv = _needs("kubernetes_validate")
    versions = [*KUBERNETES_VERSIONS, kv.latest_version().rsplit(".", 1)[0]]
    parts = {"jobset-pathways": ["pathways-head", "worker"], "jobset-gpu": ["slice"], "pathwaysjob": ["head"]}[
        target
    ]
    kind = "PodTemplate" if target == "pathwaysjob" else "Job"
    want = [f"{doc['kind']} {p.job_name} (CRD)"]
    want += [f"{kind} {p.job_name}-{part} (Kubernetes {v})" for v in versions for part in parts]
    assert validate_manifest(doc) == want
    if target == "pathwaysjob":  # and the JobSet its controller creates from it (duplicate env names, ...)
        assert validate_manifest(pathwaysjob_jobset(doc))[0] == f"JobSet {p.job_name} (CRD)"


def _rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def _mutations() -> list:
    """(name, target, mutate, what the error says): each breaks a rendered object the way a typo would."""

    def rename(get, old, new):
        return lambda doc: _rename(get(doc), old, new)

    def update(get, **values):
        return lambda doc: get(doc).update(values)

    def head_pod(doc):
        return _pod(_rjob(doc, "pathways-head"))

    def slice_job(doc):
        return _rjob(doc, "slice")["template"]["spec"]

    def worker(doc):
        return doc["spec"]["workers"][0]

    def user_pod(doc):
        return doc["spec"]["controller"]["template"]["spec"]

    def duplicate_env(doc):
        head_pod(doc)["containers"][0]["env"].append({"name": "JAX_PLATFORMS", "value": "cpu"})

    duplicate = "duplicate entry with name"
    return [
        (
            "misspelt JobSet field",
            "jobset-pathways",
            rename(lambda d: d["spec"]["failurePolicy"], "maxRestarts", "maxRestart"),
            "maxRestart",
        ),
        (
            "misspelt pod field",
            "jobset-pathways",
            rename(head_pod, "terminationGracePeriodSeconds", "terminationGracePeriodSecond"),
            "terminationGracePeriodSecond",
        ),
        (
            "misspelt container field",
            "jobset-gpu",
            rename(lambda d: slice_job(d)["template"]["spec"]["containers"][0], "args", "arg"),
            "'arg' was unexpected",
        ),
        (
            "a count as a string",
            "jobset-gpu",
            update(slice_job, backoffLimitPerIndex="10"),
            "'10' is not of type 'integer'",
        ),
        (
            "an int32 overflow",
            "jobset-gpu",
            update(lambda d: d["spec"]["failurePolicy"], maxRestarts=2**31),
            "int32",
        ),
        (
            "a duplicate container name",
            "jobset-pathways",
            update(lambda d: head_pod(d)["initContainers"][1], name="pathways-rm"),
            duplicate,
        ),
        ("a duplicate env name", "jobset-pathways", duplicate_env, duplicate),
        (
            "a bad enum value",
            "jobset-pathways",
            update(lambda d: d["spec"]["successPolicy"], operator="Some"),
            "'Some' is not one of",
        ),
        (
            "misspelt PathwaysJob field",
            "pathwaysjob",
            rename(worker, "maxSliceRestarts", "maxSliceRestart"),
            "maxSliceRestart",
        ),
        (
            "a TPU type that is no machine type",
            "pathwaysjob",
            update(worker, type="v5litepod-16"),
            "'v5litepod-16' is not one of",
        ),
        (
            "a required field missing",
            "pathwaysjob",
            lambda d: d["spec"].pop("workers"),
            "'workers' is a required property",
        ),
        (
            "misspelt field in the user pod template",
            "pathwaysjob",
            rename(user_pod, "restartPolicy", "restartPolicyy"),
            "restartPolicyy",
        ),
    ]


@pytest.mark.parametrize("name,target,mutate,message", _mutations(), ids=[m[0] for m in _mutations()])
def test_schema_validation_catches_a_broken_manifest(name, target, mutate, message):
    jsonschema = _needs("jsonschema")
    doc = copy.deepcopy(render(target, PARAM_SETS["reference"]).manifest)
    crd_validator(doc["kind"]).validate(doc)  # the unbroken object passes
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError) as caught:
        crd_validator(doc["kind"]).validate(doc)
    assert message in str(caught.value.message), caught.value.message


def test_kubernetes_schemas_catch_a_misspelt_field_inside_a_template():
    """The second layer on its own: kubernetes-validate's strict schemas reject what the CRD test does."""
    jsonschema, kv = _needs("jsonschema"), _needs("kubernetes_validate")
    for target, mutate in (
        ("jobset-gpu", lambda d: _rename(_pod(_rjob(d, "slice")), "restartPolicy", "restartpolicy")),
        (
            "pathwaysjob",
            lambda d: _rename(d["spec"]["controller"]["template"]["spec"]["containers"][0], "image", "img"),
        ),
    ):
        doc = copy.deepcopy(render(target, PARAM_SETS["reference"]).manifest)
        mutate(doc)
        with pytest.raises(jsonschema.ValidationError):
            kv.validate(core_objects(doc)[0], KUBERNETES_VERSIONS[0], strict=True)


def test_the_crd_rules_jsonschema_cannot_evaluate_hold_for_the_rendered_objects():
    """CEL rules (x-kubernetes-validations) are not evaluated by jsonschema. On create only the rules without
    `oldSelf` apply; the vendored CRDs have two, both about fields no rendered object sets."""
    rules = []

    def walk(node, path):
        if isinstance(node, dict):
            rules.extend((path, r["rule"]) for r in node.get("x-kubernetes-validations", []))
            for k, v in node.get("properties", {}).items():
                walk(v, f"{path}.{k}")
            walk(node.get("items"), f"{path}[]")

    for kind in CRD_FILES:
        walk(_crd(kind), kind)
    on_create = {path for path, rule in rules if "oldSelf" not in rule}
    assert on_create == {"JobSet.spec", "JobSet.spec.volumeClaimPolicies[]"}
    for target in ("jobset-pathways", "jobset-gpu"):
        for p in PARAM_SETS.values():
            spec = render(target, p).manifest["spec"]
            assert "volumeClaimPolicies" not in spec and "startupPolicy" not in spec
            assert not any("dependsOn" in rj for rj in spec["replicatedJobs"])
    # The JobSet the PathwaysJob controller creates sets startupPolicy InOrder but no dependsOn: rule holds.
    js = pathwaysjob_jobset(render("pathwaysjob", PARAM_SETS["reference"]).manifest)
    assert js["spec"]["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert not any("dependsOn" in rj for rj in js["spec"]["replicatedJobs"])


def test_the_fixture_readme_names_each_crd_source():
    readme = (CRDS / "README.md").read_text()
    for filename, _, _ in CRD_FILES.values():
        assert (CRDS / filename).is_file() and filename in readme
    assert re.search(r"kubernetes-sigs/jobset.*v0\.12\.0.*[0-9a-f]{40}", readme, re.S)
    assert re.search(r"google/pathways-job.*v0\.1\.4.*c0cc7594c9d03a1d96a89110008a0f2d3c9ef189", readme, re.S)


# ------------------------------------------------------------------------------------------------
# XLA flags: unknown flags abort XLA at start-up, so check the rendered ones with the installed jaxlib.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("platform", ("gpu", "cpu"))
def test_rendered_xla_flags_are_known_to_jaxlib(platform):
    flags = " ".join(xla_flags(_params("reference", platform=platform)))
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; jnp.ones(2).block_until_ready()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Dockerfile and .dockerignore (no Docker engine here: static checks).
# ------------------------------------------------------------------------------------------------
def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_layout():
    ins = _dockerfile_instructions()
    ops = [op for op, _ in ins]
    args = {rest.split("=")[0] for op, rest in ins if op == "ARG"}
    assert "JAX_EXTRA" in args
    # The base: a slim Python pinned by digest (a rebuild gets the same OS and Python); the comment above it
    # gives the pin of the other tested Python.
    base = next(rest.split("=", 1)[1] for op, rest in ins if op == "ARG" and rest.startswith("BASE_IMAGE="))
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", base), base
    other = re.findall(r"BASE_IMAGE=(python:3\.12-slim@sha256:[0-9a-f]{64})", (REPO / "Dockerfile").read_text())
    assert len(other) == 1
    assert ("FROM", "${BASE_IMAGE}") in ins
    assert ("ENTRYPOINT", '["python", "-m", "trainer.train"]') in ins
    assert ("CMD", '["base.yml"]') in ins  # default config, replaced by any docker run args
    copies = [rest for op, rest in ins if op == "COPY"]
    first_code = next(i for i, c in enumerate(copies) if c.startswith("trainer"))
    assert copies[0].startswith("pyproject.toml")  # deps layer first, code later (caching)
    runs = [i for i, (op, rest) in enumerate(ins) if op == "RUN" and "jax[${JAX_EXTRA}]" in rest]
    code_copy = [i for i, (op, rest) in enumerate(ins) if op == "COPY" and rest.startswith("trainer")]
    assert runs and runs[0] < code_copy[0]
    assert first_code > 0
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ops.index("USER") < ops.index("ENTRYPOINT")


def test_dockerfile_copies_exist_and_are_not_ignored():
    ignored = [
        l.strip() for l in (REPO / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")
    ]
    for must in (".git", "tests", "runs", "**/__pycache__"):
        assert must in ignored
    missing = []
    for op, rest in _dockerfile_instructions():
        if op != "COPY":
            continue
        *sources, _dest = rest.split()
        for src in sources:
            assert src not in ignored, f"COPY source {src} is excluded by .dockerignore"
            if not (REPO / src).exists():
                missing.append(src)
    assert not missing, f"COPY sources missing: {missing}"


def test_dockerfile_requirement_extraction_matches_pyproject():
    """The Dockerfile installs dependencies from pyproject.toml before the code; check the snippet."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    jax_pins = [d for d in deps if re.match(r"^jax[<>=! ]", d)]
    assert len(jax_pins) == 1, "the Dockerfile pins jax[<extra>] with the one `jax...` requirement"
    text = (REPO / "Dockerfile").read_text()
    assert "tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']" in text


# ------------------------------------------------------------------------------------------------
# The guide's render commands work as written.
# ------------------------------------------------------------------------------------------------
def _doc_render_commands() -> list[tuple[str, int]]:
    """(command, expected exit code) for each `python -m scripts.deploy.render` line of the guide, with the
    guide's `export NAME=value` variables expanded; a command followed by a `# config error` line must fail."""
    text = (REPO / "docs" / "running_at_scale.md").read_text().replace("\\\n", " ")
    lines = [l.strip() for l in text.splitlines()]
    env: dict[str, str] = {}
    out = []
    for i, line in enumerate(lines):
        if line.startswith("export "):
            for word in shlex.split(line[len("export ") :]):
                k, _, v = word.partition("=")
                env[k] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), v)
        if line.startswith("python -m scripts.deploy.render "):
            cmd = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), line)
            nxt = next((l for l in lines[i + 1 :] if l), "")
            out.append((cmd, 2 if nxt.startswith("# config error") else 0))
    return out


def test_docs_render_commands_work(tmp_path, capsys):
    cmds = _doc_render_commands()
    assert {"xpk", "jobset-pathways", "pathwaysjob", "jobset-gpu", "slurm"} <= {shlex.split(c)[3] for c, _ in cmds}
    for cmd, expected in cmds:
        argv = shlex.split(cmd, comments=True)[3:]
        if "-o" in argv:
            i = argv.index("-o")
            argv[i + 1] = str(tmp_path / Path(argv[i + 1]).name)
        assert R.main(argv) == expected, (cmd, capsys.readouterr().err)
        if expected == 2:
            assert "unknown config key 'learning_rat'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Resources, capacity and GPU networking (issue #42).
# ------------------------------------------------------------------------------------------------
def qos_class(pod: dict) -> str:
    """The pod's QoS class, by Kubernetes' rules: Guaranteed when every container (init containers included) has
    cpu and memory limits and its requests, where given, equal them (a missing request defaults to the limit);
    BestEffort when no container has any cpu or memory request or limit; Burstable otherwise."""
    guaranteed, any_set = True, False
    for c in pod.get("initContainers", []) + pod["containers"]:
        requests = c.get("resources", {}).get("requests", {})
        limits = c.get("resources", {}).get("limits", {})
        for r in ("cpu", "memory"):
            any_set = any_set or r in requests or r in limits
            if r not in limits or requests.get(r, limits[r]) != limits[r]:
                guaranteed = False
    return "Guaranteed" if guaranteed else "Burstable" if any_set else "BestEffort"


def test_qos_class_rules():
    c = {"name": "c", "resources": {"limits": {"cpu": "1", "memory": "1G"}}}
    assert qos_class({"containers": [c]}) == "Guaranteed"
    assert qos_class({"containers": [c], "initContainers": [{"name": "s"}]}) == "Burstable"
    assert qos_class({"containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]}) == "Burstable"
    assert qos_class({"containers": [{"name": "c"}]}) == "BestEffort"


@pytest.mark.parametrize("pset", PARAM_SETS)
def test_the_pathways_head_pod_is_guaranteed_qos(pset):
    """Every container of the head pod, the sidecars included, has requests == limits for cpu and memory; the
    trainer's ephemeral-storage too. The same holds for the head pod the PathwaysJob controller builds."""
    p = PARAM_SETS[pset]
    head = _pod(_rjob(_one_doc(render("jobset-pathways", p).text), "pathways-head"))
    assert qos_class(head) == "Guaranteed"
    trainer = _containers(head)["trainer"]["resources"]
    assert trainer["requests"] == trainer["limits"] == PATHWAYS_TRAINER_RESOURCES
    pw = render("pathwaysjob", p).manifest
    assert _pathwaysjob_trainer(pw)["resources"] == trainer
    assert qos_class(_pod(_rjob(pathwaysjob_jobset(pw), "pathways-head"))) == "Guaranteed"
    flags = {"trainer_cpu": "30", "trainer_memory": "120Gi", "trainer_ephemeral_storage": "50Gi"}
    head = _pod(_rjob(render("jobset-pathways", _params(pset, **flags)).manifest, "pathways-head"))
    want = {"cpu": "30", "memory": "120Gi", "ephemeral-storage": "50Gi"}
    assert _containers(head)["trainer"]["resources"] == {"requests": want, "limits": want}
    assert qos_class(head) == "Guaranteed"


@pytest.mark.parametrize("platform", ("gpu", "cpu"))
def test_the_multiprocess_trainer_requests_cpu_and_memory(platform):
    p = _params("reference", platform=platform)
    trainer = _containers(_pod(_rjob(render("jobset-gpu", p).manifest, "slice")))["trainer"]
    n = p.gpus_per_node if platform == "gpu" else 1
    assert trainer["resources"]["requests"] == {"cpu": str(2 * n), "memory": f"{8 * n}Gi"}
    assert trainer["resources"].get("limits") == ({"nvidia.com/gpu": "8"} if platform == "gpu" else None)
    q = _params("reference", platform=platform, trainer_cpu="200", trainer_memory="1500Gi")
    q = dataclasses.replace(q, trainer_ephemeral_storage="100Gi")
    trainer = _containers(_pod(_rjob(render("jobset-gpu", q).manifest, "slice")))["trainer"]
    assert trainer["resources"]["requests"] == {"cpu": "200", "memory": "1500Gi", "ephemeral-storage": "100Gi"}


def test_a_resource_that_is_no_quantity_is_refused(capsys):
    with pytest.raises(DeployError, match=r"--trainer-memory='64 GB' is not a Kubernetes quantity"):
        render("jobset-pathways", _params("reference", trainer_memory="64 GB"))
    with pytest.raises(DeployError, match=r"--shm-size='lots' is not a Kubernetes quantity"):
        render("jobset-gpu", _params("reference", shm_size="lots"))
    argv = ["jobset-gpu", "--slices", "2", "--image", IMAGE, "--run-name", "r", "--output-dir", "gs://b/r"]
    assert R.main([*argv, "--trainer-cpu", "x"]) == 2 and "--trainer-cpu='x'" in capsys.readouterr().err


def test_the_gpu_pods_get_an_in_memory_dev_shm():
    for changes, size in (({}, "64Gi"), ({"shm_size": "200Gi"}, "200Gi")):
        pod = _pod(_rjob(render("jobset-gpu", _params("reference", **changes)).manifest, "slice"))
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shared-memory"] == {
            "name": "shared-memory",
            "emptyDir": {"medium": "Memory", "sizeLimit": size},
        }
        mounts = {m["mountPath"]: m["name"] for m in _containers(pod)["trainer"]["volumeMounts"]}
        assert mounts["/dev/shm"] == "shared-memory"


SPOT_SELECTOR = {"cloud.google.com/gke-spot": "true"}
SPOT_TOLERATION = {
    "key": "cloud.google.com/gke-spot",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}


def test_spot_capacity_selects_spot_nodes_where_the_accelerators_are():
    spot = _params("reference", capacity="spot")
    gpu = _pod(_rjob(render("jobset-gpu", spot).manifest, "slice"))
    assert gpu["nodeSelector"] == {"cloud.google.com/gke-accelerator": spot.gpu_accelerator, **SPOT_SELECTOR}
    assert SPOT_TOLERATION in gpu["tolerations"] and gpu["terminationGracePeriodSeconds"] == 15
    doc = render("jobset-pathways", spot).manifest
    worker, head = _pod(_rjob(doc, "worker")), _pod(_rjob(doc, "pathways-head"))
    assert SPOT_SELECTOR.items() <= worker["nodeSelector"].items() and worker["tolerations"] == [SPOT_TOLERATION]
    assert worker["terminationGracePeriodSeconds"] == 15  # no more than Spot gives
    assert head["nodeSelector"] == {"cloud.google.com/gke-nodepool": spot.head_nodepool}  # the CPU head stays
    pw = render("pathwaysjob", spot)
    (w,) = pw.manifest["spec"]["workers"]
    assert w["nodeSelector"] == SPOT_SELECTOR and w["terminationGracePeriodSeconds"] == 15
    js_worker = _pod(_rjob(pathwaysjob_jobset(pw.manifest), "worker"))
    assert SPOT_SELECTOR.items() <= js_worker["nodeSelector"].items()
    assert any("cannot give them tolerations" in x for x in pw.warnings)
    # On demand: no Spot selector, toleration or worker grace change.
    on_demand = render("jobset-pathways", PARAM_SETS["reference"]).manifest
    assert "cloud.google.com/gke-spot" not in _pod(_rjob(on_demand, "worker"))["nodeSelector"]
    assert "tolerations" not in _pod(_rjob(on_demand, "worker"))
    assert "workers" in render("pathwaysjob", PARAM_SETS["reference"]).manifest["spec"]
    with pytest.raises(DeployError, match="--capacity must be one of on-demand, spot"):
        render("jobset-gpu", _params("reference", capacity="preemptible"))
    with pytest.raises(DeployError, match="--spot-grace-seconds=5 leaves the trainer no time"):
        render("jobset-gpu", _params("reference", capacity="spot", spot_grace_seconds=5))


def test_pathways_images_default_to_the_trainers_jax():
    p = PARAM_SETS["reference"]
    tag = f"jax-{default_trainer_jax()}"
    hc = _containers(_pod(_rjob(render("jobset-pathways", p).manifest, "pathways-head")))
    assert hc["pathways-rm"]["image"] == f"{PATHWAYS_IMAGE_REPO}/server:{tag}"
    assert hc["pathways-proxy"]["image"] == f"{PATHWAYS_IMAGE_REPO}/proxy_server:{tag}"
    assert render("pathwaysjob", p).manifest["spec"]["pathwaysVersion"] == tag
    assert _params("reference", trainer_jax="0.9.1").pathways_tag == "jax-0.9.1"
    override = _params("reference", pathways_version="latest")
    hc = _containers(_pod(_rjob(render("jobset-pathways", override).manifest, "pathways-head")))
    assert hc["pathways-rm"]["image"].endswith("/server:latest")


def _net_pod(mode: str, **changes) -> tuple[dict, dict, Rendered]:
    accelerator = {"tcpxo": "nvidia-h100-mega-80gb", "rdma": "nvidia-h200-141gb"}[mode]
    r = render("jobset-gpu", _params("reference", gpu_networking=mode, gpu_accelerator=accelerator, **changes))
    template = _rjob(r.manifest, "slice")["template"]["spec"]["template"]
    return template["metadata"]["annotations"], template["spec"], r


def test_gpudirect_tcpxo_renders_what_gkes_guide_asks_for():
    annotations, pod, r = _net_pod("tcpxo")
    assert annotations["networking.gke.io/default-interface"] == "eth0"
    interfaces = json.loads(annotations["networking.gke.io/interfaces"])
    assert interfaces == [{"interfaceName": "eth0", "network": "default"}] + [
        {"interfaceName": f"eth{i}", "network": f"vpc{i}"} for i in range(1, 9)
    ]
    devices = yaml.safe_load(annotations["devices.gke.io/container.tcpxo-daemon"])
    assert [d["path"] for d in devices] == [f"/dev/nvidia{i}" for i in range(8)] + [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/dmabuf_import_helper",
    ]
    (rxdm,) = pod["initContainers"]  # a native sidecar: the Job completes when the trainer does
    assert rxdm["name"] == "tcpxo-daemon" and rxdm["restartPolicy"] == "Always"
    assert rxdm["image"] == TCPXO_DAEMON_IMAGE and "--num_hops=2 --num_nics=8" in rxdm["args"][0]
    assert rxdm["securityContext"] == {"capabilities": {"add": ["NET_ADMIN", "NET_BIND_SERVICE"]}}
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert {
        "libraries": "/home/kubernetes/bin/nvidia",
        "sys": "/sys",
        "proc-sys": "/proc/sys",
    }.items() <= volumes.items()
    assert volumes["aperture-devices"] == "/dev/aperture_devices"
    trainer = _containers(pod)["trainer"]
    env = _env(trainer)
    assert env["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"] == "/dev/aperture_devices"
    assert env["LD_LIBRARY_PATH"] == env["NCCL_LIB_DIR"] == "/usr/local/nvidia/lib64"
    assert {"name": "aperture-devices", "mountPath": "/dev/aperture_devices"} in trainer["volumeMounts"]
    assert 'source "${NCCL_LIB_DIR}/nccl-env-profile.sh"' in trainer["command"][2]
    header = r.text[: r.text.index("apiVersion:")]
    assert TCPXO_DOC in header and TCPXO_INSTALLER in header and not r.warnings


def test_gpudirect_rdma_renders_what_gkes_guide_asks_for():
    annotations, pod, r = _net_pod("rdma")
    interfaces = json.loads(annotations["networking.gke.io/interfaces"])
    networks = ["default", "gvnic-1"] + [f"rdma-{i}" for i in range(8)]
    assert interfaces == [{"interfaceName": f"eth{i}", "network": n} for i, n in enumerate(networks)]
    assert "initContainers" not in pod
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert (
        volumes["library-dir-host"] == "/home/kubernetes/bin/nvidia"
        and volumes["gib"] == "/home/kubernetes/bin/gib"
    )
    trainer = _containers(pod)["trainer"]
    mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    assert mounts["library-dir-host"] == "/usr/local/nvidia" and mounts["gib"] == "/usr/local/gib"
    assert _env(trainer)["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    assert "source /usr/local/gib/scripts/set_nccl_env.sh" in trainer["command"][2]
    header = r.text[: r.text.index("apiVersion:")]
    assert RDMA_DOC in header and RDMA_INSTALLER in header


@needs_bash
@pytest.mark.parametrize("mode", ("tcpxo", "rdma"))
def test_the_gpudirect_prelude_sources_the_nccl_profile_then_derives_the_process_id(mode, tmp_path):
    """The prelude with a stand-in profile: sourced (its variable reaches the trainer), then the process id."""
    _, pod, _ = _net_pod(mode)
    trainer = _containers(pod)["trainer"]
    profile = {"tcpxo": "nccl-env-profile.sh", "rdma": "set_nccl_env.sh"}[mode]
    script = trainer["command"][2].replace("/usr/local/gib/scripts/", f"{tmp_path}/")
    (tmp_path / profile).write_text("export NCCL_FROM_PROFILE=1\n")
    env = {
        "PATH": os.environ["PATH"],
        "NCCL_LIB_DIR": str(tmp_path),
        "JOB_INDEX": "1",
        "JOB_COMPLETION_INDEX": "0",
    }
    env.update({k: v for k, v in _env(trainer).items() if isinstance(v, str) and k != "NCCL_LIB_DIR"})
    out = subprocess.run([BASH, "-c", script, "bash", "env"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert got["NCCL_FROM_PROFILE"] == "1" and got["JAX_PROCESS_ID"] == "1"


def test_gpu_networking_needs_whole_gpu_nodes():
    with pytest.raises(DeployError, match="needs --platform gpu and --gpus-per-node 8"):
        render("jobset-gpu", _params("reference", gpu_networking="rdma", gpus_per_node=4))
    with pytest.raises(DeployError, match="needs --platform gpu"):
        render("jobset-gpu", _params("reference", gpu_networking="tcpxo", platform="cpu"))
    r = render("jobset-gpu", _params("reference", gpu_networking="tcpxo"))  # an H100 (A3 High) node pool
    assert any("nvidia-h100-mega-80gb" in w for w in r.warnings)
    assert any("is GKE's" in w for w in render("slurm", _params("reference", gpu_networking="rdma")).warnings)


VARIANTS = {
    "spot, budget": {"capacity": "spot", "max_preemptions": 5},
    "tcpxo": {"gpu_networking": "tcpxo", "gpu_accelerator": "nvidia-h100-mega-80gb"},
    "rdma, resources": {"gpu_networking": "rdma", "trainer_cpu": "100", "trainer_ephemeral_storage": "100Gi"},
    "metrics port": {"metrics_port": 9100},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("target", MANIFEST_TARGETS)
def test_the_new_settings_validate_against_the_schemas(target, variant):
    doc = render(target, _params("resize", **VARIANTS[variant])).manifest
    assert validate_manifest(doc)[0].endswith("(CRD)")
    if target == "pathwaysjob":
        validate_manifest(pathwaysjob_jobset(doc))


def _trainer_pod_parts(target: str, doc: dict) -> tuple[dict, dict]:
    """(the trainer container, the metadata of its pod template) of a rendered manifest."""
    if target == "pathwaysjob":
        return _pathwaysjob_trainer(doc), doc["spec"]["controller"]["template"].get("metadata", {})
    rjob = _rjob(doc, {"jobset-pathways": "pathways-head", "jobset-gpu": "slice"}[target])
    return _containers(_pod(rjob))["trainer"], rjob["template"]["spec"]["template"].get("metadata", {})


@pytest.mark.parametrize("target", MANIFEST_TARGETS)
def test_metrics_port_is_the_trainers_named_port_with_the_prometheus_scrape_annotations(target):
    doc = render(target, _params("resize", metrics_port=9100)).manifest
    trainer, metadata = _trainer_pod_parts(target, doc)
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in trainer["ports"]
    assert "metrics_port=9100" in extract_argv(target, render(target, _params("resize", metrics_port=9100)).text)
    annotations = metadata["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9100"
    assert annotations["prometheus.io/path"] == "/metrics"
    off, off_metadata = _trainer_pod_parts(target, render(target, _params("resize")).manifest)
    assert all(port.get("name") != "metrics" for port in off.get("ports", []))
    assert not any(k.startswith("prometheus.io/") for k in off_metadata.get("annotations", {}))


# ------------------------------------------------------------------------------------------------
# The guide: routes in order, one number per section, the exit-code table, the log selector, the checklist.
# ------------------------------------------------------------------------------------------------
GUIDE = REPO / "docs" / "running_at_scale.md"


def _guide_sections() -> dict[int, str]:
    """{number: the section's text} of the guide's `### N. Title` sections, checking each number is used once."""
    text = GUIDE.read_text()
    heads = list(re.finditer(r"^### (\d+)\. (.+)$", text, re.M))
    numbers = [int(m.group(1)) for m in heads]
    assert numbers == list(range(1, len(numbers) + 1)), numbers  # no duplicate, no gap
    ends = [m.start() for m in heads[1:]] + [len(text)]
    return {int(m.group(1)): text[m.start() : end] for m, end in zip(heads, ends, strict=True)}


def test_the_guide_orders_the_pathways_routes_jobset_first_xpk_last_and_its_references_hold():
    sections = _guide_sections()
    routes = {n: re.findall(r"python -m scripts\.deploy\.render ([\w-]+)", body) for n, body in sections.items()}
    assert routes[2] == ["jobset-pathways"] and routes[3] == ["pathwaysjob"] and routes[4] == ["xpk"]
    assert sections[4].index("any non-zero exit fails the workload") < sections[4].index("```bash")
    assert XPK_ACCEPT_FLAG in sections[4].split("```bash")[1]  # the printed command carries the flag
    text = GUIDE.read_text()
    titles = {n: body.splitlines()[0] for n, body in sections.items()}
    for n in map(int, re.findall(r"\(section (\d+)[),;]", text) + re.findall(r"sections? (\d+)\b", text)):
        assert n in sections, f"section {n} is referenced but does not exist"
    assert "JobSet manifest" in titles[2] and "PathwaysJob" in titles[3] and "xpk" in titles[4]
    assert "Spot" in titles[9] and "checklist" in titles[10]
    # README.md links two sections by their anchors: their numbers and titles stay.
    assert titles[7] == "### 7. Goodput at scale: choosing the periods"
    assert titles[8] == "### 8. Check the fit before you rent the slices: compile for the target"


def test_the_guides_exit_code_table_states_what_each_route_does_with_every_code_and_the_budget():
    text = GUIDE.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| Trainer exit |"))
    assert [c.strip() for c in header.strip("|").split("|")][1:] == [
        "JobSet manifests (`jobset-pathways`, `jobset-gpu`)",
        "Slurm script",
        "`pathwaysjob` manifest",
        "xpk script",
    ]
    lines = text.splitlines()
    start = lines.index(header)
    table = lines[start : next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))]
    rows = {line.split("|")[1].strip().split()[0]: line for line in table[2:]}
    assert set(rows) == {"0", "42", "75", "1", "2"}
    jobset, slurm, pathwaysjob, xpk = [c.strip() for c in rows["42"].strip().strip("|").split("|")][1:]
    assert "`--max-preemptions 0`" in jobset and "(N+1)-th" in jobset and "`BackoffLimitExceeded`" in jobset
    assert "`--max-preemptions N`" in slurm and "`SLURM_RESTART_COUNT`" in slurm
    assert "does not apply" in pathwaysjob and xpk == "The workload fails."
    for code in ("75", "1", "2"):
        assert rows[code].rstrip().endswith("| The workload fails. |"), code
    assert "`--max-preemptions N`" in rows["75"] and "`--max-preemptions N`" in rows["1"]


def test_the_guides_log_commands_select_the_head_pods_trainer_container():
    """The workers have no `trainer` container: every selector names the pathways-head replicated Job, and the
    JobSet route prints exactly the command the manifest's comments print."""
    text = GUIDE.read_text()
    p = _params("reference", run_name="qwen3-0.6b-elastic")
    assert head_logs_command(p) in text
    assert head_logs_command(p) in render("jobset-pathways", p).text
    for line in (line for line in text.splitlines() if "kubectl logs -f -l" in line):
        words = shlex.split(
            line.split("`")[1] if line.lstrip().startswith(("`", "-", "(")) else line, comments=True
        )
        selector, container = words[words.index("-l") + 1], words[words.index("-c") + 1]
        if "replicatedjob-name" in selector:
            assert "jobset.sigs.k8s.io/replicatedjob-name=pathways-head" in selector, line
            assert container in ("trainer", "jax-tpu"), line
        else:  # the GPU route: process 0's pod, which runs a trainer
            assert "job-index=0" in selector and "job-completion-index=0" in selector and container == "trainer"


def test_the_guide_has_one_deploy_checklist_with_every_topic():
    checklist = _guide_sections()[10]
    for topic in ("Versions, pinned", "Resources", "Spot", "Logs", "Quotas", "Restart budgets"):
        assert f"**{topic}" in checklist, topic
    assert GUIDE.read_text().count("Deploy checklist") == 1
