"""xpk: a shell script wrapping `xpk workload create-pathways`; refused without --accept-xpk-failure-policy, since
xpk's JobSet fails the workload on any non-zero trainer exit."""

from __future__ import annotations

import shlex

from scripts.deploy.artefact import Rendered, artefact_header
from scripts.deploy.errors import DeployError
from scripts.deploy.graceful_stop import KUBERNETES_DEFAULT_GRACE_SECONDS, pod_grace
from scripts.deploy.params import DeployParams
from scripts.deploy.shell_template import fill, load_template
from scripts.deploy.trainer_command import prepare

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


def check_xpk_accepted(p: DeployParams) -> None:
    """xpk is refused unless the operator accepts what its JobSet does with the trainer's exit codes."""
    if not p.accept_xpk_failure_policy:
        raise DeployError(f"the xpk target is refused: {XPK_FAILURE_POLICY}. Fix: {XPK_FIX}")


def render_xpk(p: DeployParams) -> Rendered:
    check_xpk_accepted(p)
    argv, warnings, stop = prepare(p, single_controller=True, check=p.check_pathways)
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
        "header": artefact_header("xpk", p),
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
