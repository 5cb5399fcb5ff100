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

The trainer command is built once (scripts/deploy/trainer_command.py) from the parameters, checked with the
project's own config loader (a bad key fails here, with the loader's message, not on the cluster) and embedded
unchanged in every artefact. Keys after `--` are extra trainer overrides (e.g. steps=5000).
The Kubernetes manifests are Python dicts dumped with PyYAML (scripts/deploy/manifest.py); tests/test_deploy.py
checks them against the vendored CRD schemas (tests/fixtures/crds/) and Kubernetes' own. The shell scripts (xpk,
slurm) are filled from scripts/deploy/templates/ (scripts/deploy/shell_template.py).

This module is the command line only: the argument parser, the DeployParams it builds, which targets `all`
writes, and writing the files; scripts/deploy/__init__.py maps the package's other modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if (
    str(REPO_ROOT) not in sys.path
):  # `python scripts/deploy/render.py` as well as `python -m scripts.deploy.render`
    sys.path.insert(0, str(REPO_ROOT))

from scripts.deploy.artefact import Rendered  # noqa: E402
from scripts.deploy.capacity import CAPACITIES, SPOT_NODE_LABEL  # noqa: E402
from scripts.deploy.errors import DeployError  # noqa: E402
from scripts.deploy.gpu_networking import GPU_NETWORKING  # noqa: E402
from scripts.deploy.params import DeployParams  # noqa: E402
from scripts.deploy.resources import (  # noqa: E402
    MULTIPROCESS_CPU_PER_GPU,
    MULTIPROCESS_MEMORY_GI_PER_GPU,
    PATHWAYS_TRAINER_RESOURCES,
)
from scripts.deploy.targets import RENDERERS, render  # noqa: E402
from scripts.deploy.targets.xpk import XPK_ACCEPT_FLAG, XPK_FAILURE_POLICY  # noqa: E402
from scripts.deploy.tpu import TPU_TYPES  # noqa: E402
from trainer.config import ConfigError  # noqa: E402


def all_targets(p: DeployParams, notes: list[str]) -> list[str]:
    """The targets `all` writes: every one, xpk only when accepted (else a note says why it is left out)."""
    if p.accept_xpk_failure_policy:
        return list(RENDERERS)
    notes.append(f"note (xpk): not written: {XPK_FAILURE_POLICY}. To write it too, pass {XPK_ACCEPT_FLAG}")
    return [t for t in RENDERERS if t != "xpk"]


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
    ap.add_argument(
        "--metrics-port",
        type=int,
        default=d["metrics_port"],
        help="metrics_port: live metrics for Prometheus on the trainer (process 0), exposed as the trainer "
        "container's port `metrics` with prometheus.io scrape annotations on its pod; 0 = off",
    )
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
        metrics_port=ns.metrics_port,
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
