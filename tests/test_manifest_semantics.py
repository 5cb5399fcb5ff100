"""What Kubernetes, the JobSet controller, xpk and Slurm do with every exit code of the trainer, under the
artefacts the scripts.deploy package (`python -m scripts.deploy.render`) writes.

The exit-code contract (trainer/errors.py): 0 finished -> the run completes; 1 a bug -> restart a few times,
then fail; 2 bad input and 3 gave up -> fail at once; 42 preempted (SIGTERM, state saved) -> restart using no
budget; 75 transient, and the codes of a death the trainer did not choose (137, 134, 139, 143) -> restart
from a generous counted budget. An evicted pod (condition DisruptionTarget) restarts using no budget.

The JobSet manifests are rendered and run through a small evaluator of the documented rules:

- Job pod failure policy: the rules of a failed pod are evaluated in order and the first match decides
  (FailJob, FailIndex, Ignore, Count); a failure that matches none is counted; `onExitCodes` looks at the
  containers named by `containerName` (all, when unset) and leaves out containers that exited 0, for `In`
  and `NotIn` alike; `onPodConditions` matches a condition of the pod; a podFailurePolicy needs
  restartPolicy Never, FailIndex needs backoffLimitPerIndex, which needs an Indexed Job.
  https://kubernetes.io/docs/concepts/workloads/controllers/job/#pod-failure-policy
  https://kubernetes.io/docs/tasks/job/pod-failure-policy/
  https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/job-v1/
- Backoff limits: a Job fails (BackoffLimitExceeded) when its counted pod failures exceed backoffLimit
  (default 6, or the largest int32 with backoffLimitPerIndex); every failed pod no rule ignores is counted
  (Count, FailIndex and FailJob: matchPodFailurePolicy's countFailed); with backoffLimitPerIndex an index fails
  when its failures exceed it, or at once on FailIndex; the Job fails with MaxFailedIndexesExceeded when its
  failed indexes exceed maxFailedIndexes, else with FailedIndexes once every index has succeeded or failed. The
  controller checks FailJob, then backoffLimit, then the failed indexes (pkg/controller/job/job_controller.go,
  syncJob), so BackoffLimitExceeded wins over MaxFailedIndexesExceeded.
  https://kubernetes.io/docs/concepts/workloads/controllers/job/#backoff-limit-per-index
  https://kubernetes.io/docs/concepts/workloads/controllers/job/#pod-backoff-failure-policy
- Pod disruption condition DisruptionTarget (preemption, eviction, taint-based eviction, node drain):
  https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions
- JobSet: on a failed child Job the failurePolicy rules are evaluated in order, the first rule whose
  onJobFailureReasons (empty: any) and targetReplicatedJobs (empty: all) match runs; with no match the
  action is RestartJobSet, which restarts while fewer than maxRestarts counted restarts happened and fails
  the JobSet otherwise; FailJobSet fails it; RestartJobSetAndIgnoreMaxRestarts restarts without counting.
  A restart recreates every child Job. successPolicy (operator All/Any over targetReplicatedJobs, empty:
  all) completes the JobSet; without one every Job must complete.
  https://jobset.sigs.k8s.io/docs/reference/jobset.v1alpha2/
  https://github.com/kubernetes-sigs/jobset/blob/main/keps/262-ConfigurableFailurePolicy/README.md

xpk: `xpk workload create-pathways` (https://github.com/AI-Hypercomputer/xpk: src/xpk/commands/workload.py,
src/xpk/templates/pathways_workload_create.yaml.j2, and the PathwaysJob controller it used before,
https://github.com/google/pathways-job internal/controller/pathwaysjob_controller.go) gives the head Job
backoffLimit 0 and no podFailurePolicy, and the JobSet no failurePolicy rules; maxRestarts is --max-restarts
(PathwaysJob releases) or absent, i.e. 0 (releases that render the JobSet). The JobSet is rebuilt here from
the rendered command's flags and run through the same evaluator, so the gaps are checked, not only listed.

PathwaysJob (https://github.com/google/pathways-job v0.1.4, internal/controller/pathwaysjob_controller.go): its
controller builds the JobSet (tests/deploy_stubs.py rebuilds it from the rendered PathwaysJob) with the same
head Job as xpk (backoffLimit 0, no podFailurePolicy) and failurePolicy.maxRestarts only; it runs through the
same evaluator, and its gaps are those of xpk's PathwaysJob releases.

Slurm: the rendered sbatch script runs for real under bash, with stub `srun`, `scontrol`, `sleep` and a stub
trainer (`python`) that exits with a scripted sequence of codes (https://slurm.schedmd.com/sbatch.html
--requeue, --signal; https://slurm.schedmd.com/scontrol.html requeue).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from deploy_stubs import BASH, pathwaysjob_jobset, run_xpk_script, stub

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.deploy.capacity import DEFAULT_SPOT_GRACE_SECONDS  # noqa: E402
from scripts.deploy.errors import DeployError  # noqa: E402
from scripts.deploy.failure_policy import (  # noqa: E402
    BUG_EXIT_CODES,
    FINAL_EXIT_CODES,
    FOREIGN_EXIT_CODES,
    PREEMPTED_EXIT_CODES,
    TRANSIENT_EXIT_CODES,
)
from scripts.deploy.graceful_stop import (  # noqa: E402
    DEFAULT_STOP_TIMEOUT_SECONDS,
    KUBERNETES_DEFAULT_GRACE_SECONDS,
    SPOT_STOP_MARGIN_SECONDS,
)
from scripts.deploy.manifest import TRAINER_CONTAINER  # noqa: E402
from scripts.deploy.params import DeployParams  # noqa: E402
from scripts.deploy.targets import render  # noqa: E402
from scripts.deploy.targets.xpk import XPK_ACCEPT_FLAG, XPK_FAILURE_POLICY  # noqa: E402
from scripts.deploy.tpu import TPU_TYPES  # noqa: E402

needs_bash = pytest.mark.skipif(BASH is None, reason="bash not installed")

IMAGE = "us-docker.pkg.dev/my-proj/trainer/trainer:v1"
REFERENCE = DeployParams(
    slices=3,
    image=IMAGE,
    run_name="qwen3-0.6b-elastic",
    output_dir="gs://my-bucket/runs",
    accept_xpk_failure_policy=True,  # the xpk target renders only with it
)
# 4 slices x 2 processes, other budgets: every number below comes from the manifest, not from the defaults.
RESIZE = dataclasses.replace(
    REFERENCE, slices=4, nodes_per_slice=2, min_slices=2, max_restarts=2, max_task_restarts=4, max_slice_restarts=3
)
PARAMS = {"reference": REFERENCE, "resize": RESIZE}
TRAINER = TRAINER_CONTAINER

# Outcomes of one pod ending, as the JobSet sees them.
COMPLETED = "run completes"
POD_RESTART = "pod restarts, no budget used"
POD_RESTART_COUNTED = "pod restarts, counted"
JOBSET_RESTART = "JobSet restarts, counted"
JOBSET_RESTART_UNCOUNTED = "JobSet restarts, not counted"
JOBSET_FAILS = "JobSet fails"
RUNNING = "still running"  # e.g. one process finished, the others have not yet


# ------------------------------------------------------------------------------------------------
# The evaluator.
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PodEnd:
    """A pod that reached a terminal phase: the exit code of each container that terminated, and the pod's
    conditions with status True."""

    exit_codes: Mapping[str, int] = field(default_factory=dict)
    conditions: frozenset[str] = frozenset()


JOB_FAILURE_REASONS = {  # the reasons JobSet's webhook accepts in onJobFailureReasons
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
}
JOBSET_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}
POD_ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
INT32_MAX = 2**31 - 1


def _exit_codes_match(req: Mapping, end: PodEnd) -> bool:
    name = req.get("containerName")
    codes = [c for n, c in end.exit_codes.items() if (name is None or n == name) and c != 0]
    if req["operator"] == "In":
        return any(c in req["values"] for c in codes)
    if req["operator"] == "NotIn":
        return any(c not in req["values"] for c in codes)
    raise AssertionError(f"unknown operator {req['operator']!r}")


def _conditions_match(patterns: list[Mapping], end: PodEnd) -> bool:
    return any(p.get("status", "True") == "True" and p["type"] in end.conditions for p in patterns)


def pod_failure_action(policy: Mapping | None, end: PodEnd) -> str:
    """The action of the first rule that matches the failed pod; Count when none does (or no policy)."""
    for rule in (policy or {}).get("rules", []):
        if "onExitCodes" in rule and _exit_codes_match(rule["onExitCodes"], end):
            return rule["action"]
        if "onPodConditions" in rule and _conditions_match(rule["onPodConditions"], end):
            return rule["action"]
    return "Count"


class Job:
    """One child Job: its pods' ends in, its Complete/Failed condition out."""

    def __init__(self, spec: Mapping):
        self.spec = spec
        pod = spec["template"]["spec"]
        self.restart_policy = pod.get("restartPolicy", "Always")
        self.containers = {c["name"] for c in pod["containers"]}
        self.init_containers = {c["name"] for c in pod.get("initContainers", [])}
        self.completions = spec.get("completions", 1)
        self.per_index = spec.get("backoffLimitPerIndex")
        self.backoff_limit = spec.get("backoffLimit", INT32_MAX if self.per_index is not None else 6)
        self.max_failed_indexes = spec.get("maxFailedIndexes")
        self.policy = spec.get("podFailurePolicy")
        self.failed = 0
        self.index_failures: Counter[int] = Counter()
        self.failed_indexes: set[int] = set()
        self.succeeded: set[int] = set()
        self.condition: tuple[str, str] | None = None  # ("Complete" | "Failed", reason)
        self._validate()

    def _validate(self) -> None:
        """The API server's rules for the fields the evaluator reads (Job API reference)."""
        assert self.restart_policy in ("Never", "OnFailure"), "a Job's pods restart Never or OnFailure"
        indexed = self.spec.get("completionMode") == "Indexed"
        if self.per_index is not None:
            assert indexed and self.restart_policy == "Never", "backoffLimitPerIndex: Indexed, restartPolicy Never"
        if self.max_failed_indexes is not None:
            assert self.per_index is not None, "maxFailedIndexes needs backoffLimitPerIndex"
            assert 0 <= self.max_failed_indexes <= self.completions
        if self.policy is None:
            return
        assert self.restart_policy == "Never", "a podFailurePolicy needs restartPolicy Never"
        for rule in self.policy["rules"]:
            assert rule["action"] in POD_ACTIONS, rule
            assert ("onExitCodes" in rule) != ("onPodConditions" in rule), "one requirement per rule"
            if rule["action"] == "FailIndex":
                assert self.per_index is not None, "FailIndex needs backoffLimitPerIndex"
            if "onExitCodes" in rule:
                req = rule["onExitCodes"]
                values = req["values"]
                assert req["operator"] in ("In", "NotIn") and 0 < len(values) <= 255
                assert values == sorted(set(values)), "values: ordered, no duplicates"
                assert req["operator"] == "NotIn" or 0 not in values, "0 cannot be used with In"
                if "containerName" in req:
                    assert req["containerName"] in self.containers | self.init_containers
            else:
                for pattern in rule["onPodConditions"]:
                    # The JobSet CRD requires the status the Job API would default to True.
                    assert pattern["type"] and pattern["status"] in ("True", "False", "Unknown"), pattern

    def _fail(self, reason: str) -> None:
        self.condition = ("Failed", reason)

    def _fail_index(self, index: int) -> str:
        self.failed_indexes.add(index)
        if self.max_failed_indexes is not None and len(self.failed_indexes) > self.max_failed_indexes:
            self._fail("MaxFailedIndexesExceeded")
        elif len(self.failed_indexes) + len(self.succeeded) >= self.completions:
            self._fail("FailedIndexes")
        return RUNNING

    def pod_ended(self, index: int, end: PodEnd) -> str:
        assert self.condition is None, f"the Job already ended: {self.condition}"
        assert 0 <= index < self.completions and index not in self.succeeded | self.failed_indexes
        if all(end.exit_codes.get(c) == 0 for c in self.containers):  # sidecars do not decide the phase
            self.succeeded.add(index)
            if len(self.succeeded) == self.completions:
                self.condition = ("Complete", "CompletionsReached")
            elif len(self.succeeded) + len(self.failed_indexes) == self.completions:
                self._fail("FailedIndexes")
            return RUNNING
        if self.restart_policy == "OnFailure":  # the kubelet restarts the container; each restart counts
            self.failed += 1
            if self.failed > self.backoff_limit:
                self._fail("BackoffLimitExceeded")
            return POD_RESTART_COUNTED
        action = pod_failure_action(self.policy, end)
        if action == "Ignore":
            return POD_RESTART
        # status.failed counts every failed pod no rule ignores: Count, FailIndex and FailJob alike. The Job
        # controller then checks a FailJob rule, the count against backoffLimit, and the failed indexes, in
        # that order (syncJob), so a FailIndex past backoffLimit fails the Job with BackoffLimitExceeded.
        self.failed += 1
        if action == "FailJob":
            self._fail("PodFailurePolicy")
            return RUNNING
        if self.failed > self.backoff_limit:
            self._fail("BackoffLimitExceeded")
            return RUNNING
        if action == "FailIndex":
            return self._fail_index(index)
        if self.per_index is not None:
            self.index_failures[index] += 1
            if self.index_failures[index] > self.per_index:
                return self._fail_index(index)
        return POD_RESTART_COUNTED


class JobSet:
    """A JobSet under the JobSet controller: child Jobs, failurePolicy, successPolicy."""

    def __init__(self, doc: Mapping):
        spec = doc["spec"]
        self.replicated = {rj["name"]: rj for rj in spec["replicatedJobs"]}
        policy = spec.get("failurePolicy") or {}
        self.max_restarts = policy.get("maxRestarts", 0)
        self.rules = policy.get("rules", [])
        success = spec.get("successPolicy") or {"operator": "All"}
        self.success_operator = success["operator"]
        self.success_targets = success.get("targetReplicatedJobs") or list(self.replicated)
        self.restarts = 0  # counted against maxRestarts
        self.restarts_uncounted = 0
        self.state = "Running"
        for rule in self.rules:
            assert rule["action"] in JOBSET_ACTIONS and RULE_NAME.match(rule.get("name", "rule")), rule
            assert set(rule.get("onJobFailureReasons", [])) <= JOB_FAILURE_REASONS, rule
            assert set(rule.get("targetReplicatedJobs", [])) <= set(self.replicated), rule
        assert self.success_operator in ("All", "Any") and set(self.success_targets) <= set(self.replicated)
        self._create_jobs()

    def _create_jobs(self) -> None:
        self.jobs = {
            (name, i): Job(rj["template"]["spec"])
            for name, rj in self.replicated.items()
            for i in range(rj.get("replicas", 1))
        }

    def _job_failed(self, replicated_job: str, reason: str) -> str:
        action = "RestartJobSet"
        for rule in self.rules:
            reasons, targets = rule.get("onJobFailureReasons") or [], rule.get("targetReplicatedJobs") or []
            if (not reasons or reason in reasons) and (not targets or replicated_job in targets):
                action = rule["action"]
                break
        if action == "RestartJobSetAndIgnoreMaxRestarts":
            self.restarts_uncounted += 1
            self._create_jobs()
            return JOBSET_RESTART_UNCOUNTED
        if action == "RestartJobSet" and self.restarts < self.max_restarts:
            self.restarts += 1
            self._create_jobs()
            return JOBSET_RESTART
        self.state = "Failed"
        return JOBSET_FAILS

    def pod_ended(self, replicated_job: str, job_index: int, pod_index: int, end: PodEnd) -> str:
        assert self.state == "Running", f"the JobSet already ended: {self.state}"
        job = self.jobs[(replicated_job, job_index)]
        outcome = job.pod_ended(pod_index, end)
        if job.condition and job.condition[0] == "Failed":
            return self._job_failed(replicated_job, job.condition[1])
        done = [j.condition is not None for (n, _), j in self.jobs.items() if n in self.success_targets]
        if all(done) if self.success_operator == "All" else any(done):
            self.state = "Completed"
            return COMPLETED
        return outcome


# ------------------------------------------------------------------------------------------------
# The evaluator against the documentation's own examples.
# ------------------------------------------------------------------------------------------------
def _job_doc(job_spec: Mapping, *, max_restarts: int = 0, rules=()) -> dict:
    return {
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts, "rules": list(rules)},
            "replicatedJobs": [{"name": "main", "replicas": 1, "template": {"spec": job_spec}}],
        }
    }


def _pod(main: str = "main", **extra) -> dict:
    return {"restartPolicy": "Never", "containers": [{"name": main}], **extra}


def test_evaluator_on_the_pod_failure_policy_task_example():
    """kubernetes.io/docs/tasks/job/pod-failure-policy: FailJob on exit 42 of `main`, Ignore DisruptionTarget."""
    spec = {
        "completions": 8,
        "parallelism": 2,
        "backoffLimit": 6,
        "template": {"spec": _pod()},
        "podFailurePolicy": {
            "rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "In", "values": [42]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
    }
    job = Job(spec)
    assert job.pod_ended(0, PodEnd({"main": 0})) == RUNNING
    assert job.pod_ended(1, PodEnd({"main": 137}, frozenset({"DisruptionTarget"}))) == POD_RESTART
    assert job.pod_ended(1, PodEnd({"main": 1})) == POD_RESTART_COUNTED and job.failed == 1
    job.pod_ended(1, PodEnd({"main": 42}))
    assert job.condition == ("Failed", "PodFailurePolicy")
    # Without a policy, 7 failures exceed backoffLimit 6.
    job = Job({**spec, "podFailurePolicy": None})
    outcomes = [job.pod_ended(0, PodEnd({"main": 1})) for _ in range(7)]
    assert outcomes[:6] == [POD_RESTART_COUNTED] * 6 and job.condition == ("Failed", "BackoffLimitExceeded")


def test_evaluator_on_the_backoff_limit_per_index_examples():
    """kubernetes.io/docs/concepts/workloads/controllers/job/#backoff-limit-per-index: index 0 exits 1 (one
    retry), index 1 exits 42 (FailIndex, no retry); without maxFailedIndexes the Job runs every index and
    then fails with FailedIndexes. With maxFailedIndexes the first index over the limit fails the Job."""
    spec = {
        "completions": 4,
        "parallelism": 2,
        "completionMode": "Indexed",
        "backoffLimitPerIndex": 1,
        "template": {"spec": _pod()},
        "podFailurePolicy": {
            "rules": [
                {"action": "FailIndex", "onExitCodes": {"containerName": "main", "operator": "In", "values": [42]}}
            ]
        },
    }
    job = Job(spec)
    assert job.pod_ended(0, PodEnd({"main": 1})) == POD_RESTART_COUNTED
    assert job.pod_ended(0, PodEnd({"main": 1})) == RUNNING and job.failed_indexes == {0}
    assert job.pod_ended(1, PodEnd({"main": 42})) == RUNNING and job.failed_indexes == {0, 1}
    job.pod_ended(2, PodEnd({"main": 0}))
    assert job.condition is None
    job.pod_ended(3, PodEnd({"main": 0}))
    assert job.condition == ("Failed", "FailedIndexes")
    job = Job({**spec, "maxFailedIndexes": 1})
    job.pod_ended(1, PodEnd({"main": 42}))
    assert job.condition is None
    job.pod_ended(2, PodEnd({"main": 42}))
    assert job.condition == ("Failed", "MaxFailedIndexesExceeded")


def test_evaluator_exit_code_requirements():
    """containerName narrows the check; exit code 0 is left out of In and NotIn alike."""
    not_in = {"operator": "NotIn", "values": [75]}
    assert not _exit_codes_match(not_in, PodEnd({"main": 75, "sidecar": 0}))  # 0 is not "not in [75]"
    assert _exit_codes_match(not_in, PodEnd({"main": 75, "sidecar": 143}))  # the sidecar's 143 is not
    assert not _exit_codes_match({**not_in, "containerName": "main"}, PodEnd({"main": 75, "sidecar": 143}))
    assert _exit_codes_match({"operator": "In", "values": [1]}, PodEnd({"init": 1}))
    assert not _exit_codes_match({"operator": "In", "values": [1]}, PodEnd({}))
    with pytest.raises(AssertionError, match="0 cannot be used"):
        Job(
            {
                "template": {"spec": _pod()},
                "podFailurePolicy": {
                    "rules": [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [0]}}]
                },
            }
        )
    with pytest.raises(AssertionError, match="FailIndex needs"):
        Job(
            {
                "template": {"spec": _pod()},
                "podFailurePolicy": {
                    "rules": [{"action": "FailIndex", "onExitCodes": {"operator": "In", "values": [1]}}]
                },
            }
        )


def test_evaluator_backoff_limit_counts_every_counted_failure_before_the_failed_indexes():
    """backoffLimit next to backoffLimitPerIndex: Count, FailIndex and FailJob failures all count (status.failed);
    a count past backoffLimit fails the Job with BackoffLimitExceeded even when the same pod failed its index."""
    spec = {
        "completions": 2,
        "parallelism": 2,
        "completionMode": "Indexed",
        "backoffLimitPerIndex": 5,
        "maxFailedIndexes": 0,
        "backoffLimit": 2,
        "template": {"spec": _pod()},
        "podFailurePolicy": {
            "rules": [
                {"action": "Count", "onExitCodes": {"containerName": "main", "operator": "In", "values": [42]}},
                {"action": "FailIndex", "onExitCodes": {"containerName": "main", "operator": "In", "values": [1]}},
            ]
        },
    }
    job = Job(spec)
    assert job.pod_ended(0, PodEnd({"main": 42})) == POD_RESTART_COUNTED  # an explicit Count: counted
    assert job.pod_ended(1, PodEnd({"main": 75})) == POD_RESTART_COUNTED  # no rule: counted, another index
    job.pod_ended(0, PodEnd({"main": 1}))  # a third counted failure: past backoffLimit 2
    assert job.condition == ("Failed", "BackoffLimitExceeded")
    job = Job(spec)
    job.pod_ended(1, PodEnd({"main": 1}))  # within backoffLimit: the failed index decides
    assert job.condition == ("Failed", "MaxFailedIndexesExceeded")


def test_evaluator_jobset_rules_first_match_default_and_max_restarts():
    """The first rule matching reason and replicatedJob runs; otherwise RestartJobSet, counted."""
    fail_fast = {"template": {"spec": _pod()}, "backoffLimit": 0}
    rules = [
        {
            "name": "free",
            "action": "RestartJobSetAndIgnoreMaxRestarts",
            "onJobFailureReasons": ["PodFailurePolicy"],
        },
        {"name": "never", "action": "FailJobSet", "targetReplicatedJobs": ["other"]},
    ]
    doc = _job_doc(fail_fast, max_restarts=2, rules=rules)
    doc["spec"]["replicatedJobs"].append({"name": "other", "replicas": 1, "template": {"spec": fail_fast}})
    js = JobSet(doc)
    assert js.pod_ended("main", 0, 0, PodEnd({"main": 1})) == JOBSET_RESTART  # BackoffLimitExceeded: default
    assert js.pod_ended("main", 0, 0, PodEnd({"main": 1})) == JOBSET_RESTART
    assert js.pod_ended("main", 0, 0, PodEnd({"main": 1})) == JOBSET_FAILS  # a third: maxRestarts=2 used up
    js = JobSet(doc)
    assert js.pod_ended("other", 0, 0, PodEnd({"main": 1})) == JOBSET_FAILS  # the rule for `other`
    js = JobSet(doc)
    assert js.pod_ended("main", 0, 0, PodEnd({"main": 0})) == RUNNING  # no successPolicy: all must complete
    assert js.pod_ended("other", 0, 0, PodEnd({"main": 0})) == COMPLETED


# ------------------------------------------------------------------------------------------------
# The rendered JobSet manifests.
# ------------------------------------------------------------------------------------------------
def _doc(target: str, p: DeployParams) -> dict:
    docs = [d for d in yaml.safe_load_all(render(target, p).text) if d is not None]
    assert len(docs) == 1
    return docs[0]


def _rjob(doc: Mapping, name: str) -> dict:
    return {rj["name"]: rj for rj in doc["spec"]["replicatedJobs"]}[name]


def _trainer_pods(doc: Mapping) -> list[tuple[str, int, int]]:
    """(replicatedJob, job index, pod index) of every pod that runs the trainer."""
    pods = []
    for rj in doc["spec"]["replicatedJobs"]:
        spec = rj["template"]["spec"]
        if any(c["name"] == TRAINER for c in spec["template"]["spec"]["containers"]):
            pods += [(rj["name"], j, i) for j in range(rj.get("replicas", 1)) for i in range(spec["completions"])]
    return pods


def _sidecars(doc: Mapping, replicated_job: str) -> list[str]:
    return [
        c["name"]
        for c in _rjob(doc, replicated_job)["template"]["spec"]["template"]["spec"].get("initContainers", [])
    ]


def trainer_end(doc: Mapping, replicated_job: str, code: int | None, *conditions: str) -> PodEnd:
    """A trainer pod that ended: the trainer exited `code` (None: it never ran); a sidecar (the Pathways
    resource manager and proxy) was stopped with SIGTERM when the trainer exited (143)."""
    codes = {name: 143 for name in _sidecars(doc, replicated_job)}
    if code is not None:
        codes[TRAINER] = code
    return PodEnd(codes, frozenset(conditions))


DT = "DisruptionTarget"
# (what happened, trainer exit code or None, pod conditions, outcome the contract asks for)
CONTRACT_ROWS = [
    ("0 finished", 0, (), COMPLETED),
    ("1 a bug", 1, (), JOBSET_RESTART),
    ("2 bad input", 2, (), JOBSET_FAILS),
    ("3 gave up", 3, (), JOBSET_FAILS),
    ("42 preempted", 42, (), POD_RESTART),
    ("75 transient", 75, (), POD_RESTART_COUNTED),
    ("137 SIGKILL or OOM-kill", 137, (), POD_RESTART_COUNTED),
    ("134 SIGABRT", 134, (), POD_RESTART_COUNTED),
    ("139 SIGSEGV", 139, (), POD_RESTART_COUNTED),
    ("143 SIGTERM before the handler", 143, (), POD_RESTART_COUNTED),
    ("no trainer exit code", None, (), POD_RESTART_COUNTED),
    ("evicted, stopped in time (42)", 42, (DT,), POD_RESTART),
    ("evicted, killed after the grace period (137)", 137, (DT,), POD_RESTART),
    ("evicted before the trainer started", None, (DT,), POD_RESTART),
    ("evicted, the trainer exited 1 while stopping", 1, (DT,), POD_RESTART),
]
ROW_IDS = [r[0] for r in CONTRACT_ROWS]


def test_the_rows_cover_every_code_of_the_contract():
    from trainer.errors import EXIT_CODES

    plain = {code for _, code, conditions, _ in CONTRACT_ROWS if not conditions}
    assert {code for code, _, _ in EXIT_CODES} | set(FOREIGN_EXIT_CODES) <= plain
    groups = (PREEMPTED_EXIT_CODES, FINAL_EXIT_CODES, BUG_EXIT_CODES, TRANSIENT_EXIT_CODES)
    assert sorted(c for g in groups for c in g) == sorted(code for code, _, _ in EXIT_CODES if code)


JOBSET_TARGETS = ("jobset-pathways", "jobset-gpu")


JOBSET_EVENTS = {COMPLETED, JOBSET_RESTART, JOBSET_RESTART_UNCOUNTED, JOBSET_FAILS}


def _every_process_ends(js: JobSet, doc: Mapping, code: int, *conditions: str) -> list[str]:
    """Every trainer process exits with the same code for the same cause: the pods end one after the other
    until the JobSet completes, restarts (which ends the other pods of that attempt) or fails."""
    outcomes = []
    for rj, j, i in _trainer_pods(doc):
        outcomes.append(js.pod_ended(rj, j, i, trainer_end(doc, rj, code, *conditions)))
        if outcomes[-1] in JOBSET_EVENTS:
            break
    return outcomes


@pytest.mark.parametrize("pset", PARAMS)
@pytest.mark.parametrize("target", JOBSET_TARGETS)
@pytest.mark.parametrize("what,code,conditions,expected", CONTRACT_ROWS, ids=ROW_IDS)
def test_each_exit_code_gets_the_contracted_outcome(target, pset, what, code, conditions, expected):
    doc = _doc(target, PARAMS[pset])
    js = JobSet(doc)
    if code == 0:
        outcomes = _every_process_ends(js, doc, 0)
        assert outcomes[-1] == COMPLETED and set(outcomes[:-1]) <= {RUNNING}, outcomes
        assert js.state == "Completed"
        return
    rj, j, i = _trainer_pods(doc)[-1]  # any process: the last (not the coordinator) for the GPU targets
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, code, *conditions)) == expected
    if expected == JOBSET_RESTART:
        assert js.restarts == 1 and js.state == "Running"


@pytest.mark.parametrize("pset", PARAMS)
@pytest.mark.parametrize("target", JOBSET_TARGETS)
def test_every_process_failing_at_once_is_one_outcome(target, pset):
    """All processes exit with the same code: the first pod decides for the JobSet."""
    doc = _doc(target, PARAMS[pset])
    for code, first in ((1, JOBSET_RESTART), (2, JOBSET_FAILS), (3, JOBSET_FAILS)):
        js = JobSet(doc)
        assert _every_process_ends(js, doc, code) == [first], code
        assert js.restarts == (1 if first == JOBSET_RESTART else 0)
    js = JobSet(doc)
    assert set(_every_process_ends(js, doc, 42)) == {POD_RESTART} and js.state == "Running"


@pytest.mark.parametrize("pset", PARAMS)
@pytest.mark.parametrize("target", JOBSET_TARGETS)
def test_42_and_evictions_forever_never_fail(target, pset):
    doc = _doc(target, PARAMS[pset])
    js = JobSet(doc)
    rj, j, i = _trainer_pods(doc)[0]
    for n in range(300):
        end = trainer_end(doc, rj, 42) if n % 3 else trainer_end(doc, rj, 137, DT)
        assert js.pod_ended(rj, j, i, end) == POD_RESTART
    assert js.state == "Running" and js.restarts == 0 and js.jobs[(rj, j)].failed == 0


@pytest.mark.parametrize("pset", PARAMS)
@pytest.mark.parametrize("target", JOBSET_TARGETS)
def test_75_n_times_then_a_jobset_restart_and_in_the_end_a_failure(target, pset):
    """N = backoffLimitPerIndex restarts of one process, the next 75 restarts the JobSet (counted), which
    gives every process a fresh budget; after maxRestarts such restarts the JobSet fails."""
    p = PARAMS[pset]
    doc = _doc(target, p)
    js = JobSet(doc)
    rj, j, i = _trainer_pods(doc)[0]
    n = _rjob(doc, rj)["template"]["spec"]["backoffLimitPerIndex"]
    assert n == p.max_task_restarts >= 4 and js.max_restarts == p.max_restarts
    for restart in range(p.max_restarts + 1):
        outcomes = [js.pod_ended(rj, j, i, trainer_end(doc, rj, 75)) for _ in range(n + 1)]
        assert outcomes[:n] == [POD_RESTART_COUNTED] * n
        assert outcomes[n] == (JOBSET_RESTART if restart < p.max_restarts else JOBSET_FAILS)
    assert js.state == "Failed"


@pytest.mark.parametrize("pset", PARAMS)
@pytest.mark.parametrize("target", JOBSET_TARGETS)
def test_1_a_few_times_then_the_jobset_fails_and_preemptions_in_between_do_not_count(target, pset):
    p = PARAMS[pset]
    doc = _doc(target, p)
    js = JobSet(doc)
    rj, j, i = _trainer_pods(doc)[-1]
    for _ in range(p.max_restarts):
        for _ in range(5):
            assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) == POD_RESTART
        assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 1)) == JOBSET_RESTART
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 1)) == JOBSET_FAILS
    assert js.restarts == p.max_restarts


def test_each_process_has_its_own_transient_budget():
    """backoffLimitPerIndex counts per pod index (process); a finished process stays finished."""
    doc = _doc("jobset-gpu", RESIZE)
    js = JobSet(doc)
    n = RESIZE.max_task_restarts
    for pod_index in range(RESIZE.nodes_per_slice):
        for _ in range(n):
            assert js.pod_ended("slice", 1, pod_index, trainer_end(doc, "slice", 137)) == POD_RESTART_COUNTED
    assert js.restarts == 0
    assert js.pod_ended("slice", 2, 0, trainer_end(doc, "slice", 0)) == RUNNING
    assert js.pod_ended("slice", 2, 1, trainer_end(doc, "slice", 75)) == POD_RESTART_COUNTED
    assert js.pod_ended("slice", 1, 0, trainer_end(doc, "slice", 75)) == JOBSET_RESTART


def test_pathways_workers_restart_in_place_against_their_job_backoff_limit():
    """Workers run Pathways, not the trainer: restartPolicy OnFailure, each container restart (evictions
    included: a podFailurePolicy needs restartPolicy Never) counts against hosts x --max-slice-restarts."""
    doc = _doc("jobset-pathways", REFERENCE)
    js = JobSet(doc)
    limit = TPU_TYPES[REFERENCE.tpu_type].hosts * REFERENCE.max_slice_restarts
    worker = PodEnd({"pathways-worker": 1})
    assert [js.pod_ended("worker", 0, 0, worker) for _ in range(limit)] == [POD_RESTART_COUNTED] * limit
    assert js.pod_ended("worker", 1, 0, PodEnd({"pathways-worker": 137}, frozenset({DT}))) == POD_RESTART_COUNTED
    assert js.pod_ended("worker", 0, 0, worker) == JOBSET_RESTART


def test_pathways_run_completes_when_the_trainer_does_whatever_the_workers():
    doc = _doc("jobset-pathways", REFERENCE)
    js = JobSet(doc)
    assert js.pod_ended("pathways-head", 0, 0, trainer_end(doc, "pathways-head", 0)) == COMPLETED


# ------------------------------------------------------------------------------------------------
# The preemption budget (--max-preemptions N): preemptions and evictions counted against the trainer Job's
# backoffLimit N; the (N+1)-th counted failure fails the JobSet.
# ------------------------------------------------------------------------------------------------
BUDGETS = {
    "reference": dataclasses.replace(REFERENCE, max_preemptions=3),
    "resize": dataclasses.replace(RESIZE, max_preemptions=4),
}


@pytest.mark.parametrize("pset", BUDGETS)
@pytest.mark.parametrize("target", JOBSET_TARGETS)
def test_the_preemption_budget_is_enforced_the_n_plus_1th_preemption_fails_the_jobset(target, pset):
    p = BUDGETS[pset]
    doc = _doc(target, p)
    rj, j, i = _trainer_pods(doc)[-1]
    assert _rjob(doc, rj)["template"]["spec"]["backoffLimit"] == p.max_preemptions
    js = JobSet(doc)
    for n in range(p.max_preemptions):  # preempted (42) and evicted (DisruptionTarget, killed) in turn
        end = trainer_end(doc, rj, 42) if n % 2 else trainer_end(doc, rj, 137, DT)
        assert js.pod_ended(rj, j, i, end) == POD_RESTART_COUNTED, n
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) == JOBSET_FAILS
    assert js.restarts == 0 and js.state == "Failed"
    # Without the budget (0, the default) the same preemptions never end the run.
    js = JobSet(_doc(target, dataclasses.replace(p, max_preemptions=0)))
    ends = [js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) for _ in range(10 * p.max_preemptions)]
    assert set(ends) == {POD_RESTART} and js.state == "Running"


@pytest.mark.parametrize("pset", BUDGETS)
@pytest.mark.parametrize("target", JOBSET_TARGETS)
@pytest.mark.parametrize("what,code,conditions,expected", CONTRACT_ROWS, ids=ROW_IDS)
def test_with_a_budget_a_preemption_is_counted_and_every_other_code_keeps_its_outcome(
    target, pset, what, code, conditions, expected
):
    """The budget's rules keep their place before FailJob and FailIndex: an evicted pod whose trainer exited 1
    while stopping is a (counted) preemption, not a bug."""
    doc = _doc(target, BUDGETS[pset])
    js = JobSet(doc)
    if code == 0:
        assert _every_process_ends(js, doc, 0)[-1] == COMPLETED
        return
    rj, j, i = _trainer_pods(doc)[-1]
    want = POD_RESTART_COUNTED if expected == POD_RESTART else expected
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, code, *conditions)) == want


@pytest.mark.parametrize("target", JOBSET_TARGETS)
def test_the_budget_counts_every_counted_failure_of_the_job_and_a_jobset_restart_renews_it(target):
    """Kubernetes keeps one failure count per Job: transient failures and a bug's failed index use the budget
    too (the header and the guide say so), and a JobSet restart recreates the Job with a fresh count."""
    p = BUDGETS["reference"]  # max_preemptions 3, max_task_restarts 10
    doc = _doc(target, p)
    rj, j, i = _trainer_pods(doc)[-1]
    js = JobSet(doc)
    assert [js.pod_ended(rj, j, i, trainer_end(doc, rj, c)) for c in (42, 75, 42)] == [POD_RESTART_COUNTED] * 3
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) == JOBSET_FAILS
    js = JobSet(doc)
    assert [js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) for _ in range(3)] == [POD_RESTART_COUNTED] * 3
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 1)) == JOBSET_FAILS  # past the budget: not a restart
    js = JobSet(doc)
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) == POD_RESTART_COUNTED
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 1)) == JOBSET_RESTART  # within it: a bug restarts
    assert [js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) for _ in range(3)] == [POD_RESTART_COUNTED] * 3
    assert js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) == JOBSET_FAILS
    # A counted preemption also uses its process's backoffLimitPerIndex (--max-task-restarts): past it the
    # JobSet restarts first, so a budget above it is never reached by one process; the renderer warns.
    wide = dataclasses.replace(p, max_preemptions=p.max_task_restarts + 2)
    doc = _doc(target, wide)
    js = JobSet(doc)
    ends = [js.pod_ended(rj, j, i, trainer_end(doc, rj, 42)) for _ in range(p.max_task_restarts + 1)]
    assert ends == [POD_RESTART_COUNTED] * p.max_task_restarts + [JOBSET_RESTART]
    assert any("--max-preemptions=12 cannot be reached" in w for w in render(target, wide).warnings)


def test_the_rendered_headers_state_the_budget():
    def header(target: str, p: DeployParams) -> str:  # the comment lines as one text
        text = render(target, p).text
        return " ".join(line.lstrip("#").strip() for line in text[: text.index("apiVersion:")].splitlines())

    for target in JOBSET_TARGETS:
        budget = header(target, BUDGETS["reference"])
        assert "counted against the trainer Job's backoffLimit=3 (--max-preemptions)" in budget
        assert "the failure past it fails the JobSet (BackoffLimitExceeded: FailJobSet)" in budget
        assert "no budget used (--max-preemptions 0: no bound)" in header(target, REFERENCE)
    slurm = render("slurm", BUDGETS["reference"]).text
    assert "requeued MAX_PREEMPTIONS=\n#             3 times (SLURM_RESTART_COUNT" in slurm
    pw = render("pathwaysjob", BUDGETS["reference"])
    assert any("--max-preemptions=3 is not applied" in w for w in pw.warnings)


# ------------------------------------------------------------------------------------------------
# Spot: the trainer's stop fits the notice GKE gives a Spot pod.
# ------------------------------------------------------------------------------------------------
SPOT = dataclasses.replace(REFERENCE, capacity="spot")


def _trainer_pod_graces(doc: Mapping) -> list[int]:
    pods = [rj["template"]["spec"]["template"]["spec"] for rj in doc["spec"]["replicatedJobs"]]
    return [
        pod["terminationGracePeriodSeconds"]
        for pod in pods
        if any(c["name"] == TRAINER for c in pod["containers"])
    ]


@pytest.mark.parametrize("target", JOBSET_TARGETS)
def test_under_spot_the_trainers_stop_fits_the_notice(target, tmp_path):
    spot_grace = DEFAULT_SPOT_GRACE_SECONDS
    assert spot_grace == 15  # GKE: 15 s for the pods of a preempted Spot node, then 15 s for system pods
    r = render(target, SPOT)
    assert f"stop_timeout_seconds={spot_grace - SPOT_STOP_MARGIN_SECONDS}" in r.trainer_argv
    assert _trainer_pod_graces(r.manifest) == [spot_grace] * len(_trainer_pod_graces(r.manifest))
    pods = [rj["template"]["spec"]["template"]["spec"] for rj in r.manifest["spec"]["replicatedJobs"]]
    assert all(pod["terminationGracePeriodSeconds"] <= spot_grace for pod in pods)  # workers too
    # A config file's longer stop is replaced; an explicit one that fits is kept; one that cannot fit is refused.
    config = tmp_path / "slow_stop.yml"
    config.write_text("stop_timeout_seconds: 33\n")
    assert _trainer_pod_graces(_doc(target, dataclasses.replace(SPOT, config=str(config))))[0] == spot_grace
    fits = _doc(target, dataclasses.replace(SPOT, overrides=("stop_timeout_seconds=7",)))
    assert set(_trainer_pod_graces(fits)) == {12}
    for stop in ("10.5", "20"):
        with pytest.raises(DeployError, match=f"stop_timeout_seconds={stop} cannot fit Spot's notice.*<=10"):
            render(target, dataclasses.replace(SPOT, overrides=(f"stop_timeout_seconds={stop}",)))
    # Node pools that give more (GKE's extended graceful termination) fit a longer stop.
    longer = dataclasses.replace(SPOT, spot_grace_seconds=60, overrides=("stop_timeout_seconds=45",))
    assert set(_trainer_pod_graces(_doc(target, longer))) == {50}
    # The evaluator's outcomes do not change: a Spot preemption is a preemption.
    js = JobSet(r.manifest)
    rj, j, i = _trainer_pods(r.manifest)[-1]
    assert js.pod_ended(rj, j, i, trainer_end(r.manifest, rj, 42, DT)) == POD_RESTART


def test_spot_and_slurm_notice_follow_the_stop_timeout():
    """Slurm's --signal lead time is the stop timeout plus the 10 s margin, Spot or not (Slurm has no Spot)."""
    text = render("slurm", SPOT).text
    assert "#SBATCH --signal=TERM@20" in text.splitlines()
    assert "stop_timeout_seconds=10 plus 10 s" in text
    assert any("--capacity spot is GKE's" in w for w in render("slurm", SPOT).warnings)
    with pytest.raises(DeployError, match="cannot fit Spot's notice"):
        render("slurm", dataclasses.replace(SPOT, overrides=("stop_timeout_seconds=30",)))


@pytest.mark.parametrize("target", JOBSET_TARGETS)
def test_trainer_pods_get_the_stop_timeout_plus_10_s(target, tmp_path):
    """terminationGracePeriodSeconds of every pod that runs the trainer: stop_timeout_seconds + 10, as the
    trainer resolves the key (its default, its config file, the overrides after `--`)."""
    config = tmp_path / "slow_stop.yml"
    config.write_text("stop_timeout_seconds: 33\n")
    for p, grace in (
        (REFERENCE, DEFAULT_STOP_TIMEOUT_SECONDS + 10),
        (dataclasses.replace(REFERENCE, overrides=("stop_timeout_seconds=45",)), 55),
        (dataclasses.replace(REFERENCE, overrides=("stop_timeout_seconds=5", "stop_timeout_seconds=7.5")), 18),
        (dataclasses.replace(REFERENCE, config=str(config)), 43),
        (dataclasses.replace(REFERENCE, config=str(config), overrides=("stop_timeout_seconds=2",)), 12),
    ):
        doc = _doc(target, p)
        pods = [rj["template"]["spec"]["template"]["spec"] for rj in doc["spec"]["replicatedJobs"]]
        trainer_pods = [pod for pod in pods if any(c["name"] == TRAINER for c in pod["containers"])]
        assert trainer_pods and all(pod["terminationGracePeriodSeconds"] == grace for pod in trainer_pods)
    with pytest.raises(DeployError, match="stop_timeout_seconds"):
        render(target, dataclasses.replace(REFERENCE, overrides=("stop_timeout_seconds=soon",)))


# ------------------------------------------------------------------------------------------------
# xpk: the JobSet `xpk workload create-pathways` builds from the rendered command, under the same rules.
# ------------------------------------------------------------------------------------------------
def _xpk_flags(tmp_path: Path, p: DeployParams) -> tuple[dict[str, list[str]], list[str]]:
    """Run the rendered submit script against a stub xpk; its flags, and the renderer's warnings."""
    r = render("xpk", p)
    flags = run_xpk_script(tmp_path, r.text, cluster=("p", "z", "c"))
    return flags, r.warnings


def xpk_pathways_jobset(flags: Mapping[str, list[str]], hosts: int, *, renders_jobset: bool) -> dict:
    """The failure-relevant part of the JobSet xpk makes for `workload create-pathways` with these flags.

    renders_jobset=False: releases that submit a PathwaysJob; the pathways-job controller (createJobSet,
    MakePathwaysHeadReplicatedJob, MakeWorkerJob) sets failurePolicy.maxRestarts from --max-restarts.
    renders_jobset=True: releases that render templates/pathways_workload_create.yaml.j2, whose failurePolicy
    has only restartStrategy: Recreate. Both: head Job backoffLimit 0, no podFailurePolicy, the user's
    container (--docker-name, default jax-tpu) next to the resource manager and proxy; worker Job backoffLimit
    hosts x --max-slice-restarts when --elastic-slices > 0 (else hosts x 4), restartPolicy OnFailure,
    terminationGracePeriodSeconds from --termination-grace-period-seconds; successPolicy All on the head.
    """

    def one(name: str, default: str) -> str:
        return flags.get(name, [default])[-1]

    main = one("--docker-name", "jax-tpu")
    elastic = int(one("--elastic-slices", "0")) > 0
    worker_backoff = hosts * (int(one("--max-slice-restarts", "1")) if elastic else 4)
    head_pod = {
        "restartPolicy": "Never",
        "initContainers": [{"name": "pathways-proxy"}, {"name": "pathways-rm"}],
        "containers": [{"name": main}],
    }
    worker_pod = {
        "restartPolicy": "OnFailure",
        "terminationGracePeriodSeconds": int(one("--termination-grace-period-seconds", "30")),
        "containers": [{"name": "pathways-worker"}],
    }
    failure_policy = (
        {"restartStrategy": "Recreate"} if renders_jobset else {"maxRestarts": int(one("--max-restarts", "0"))}
    )
    return {
        "spec": {
            "failurePolicy": failure_policy,
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["pathways-head"]},
            "replicatedJobs": [
                {
                    "name": "pathways-head",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "backoffLimit": 0,
                            "completionMode": "Indexed",
                            "completions": 1,
                            "template": {"spec": head_pod},
                        }
                    },
                },
                {
                    "name": "worker",
                    "replicas": int(one("--num-slices", "1")),
                    "template": {
                        "spec": {
                            "backoffLimit": worker_backoff,
                            "completionMode": "Indexed",
                            "completions": hosts,
                            "template": {"spec": worker_pod},
                        }
                    },
                },
            ],
        }
    }


def _xpk_end(flags: Mapping, code: int | None, conditions=()) -> PodEnd:
    codes = {"pathways-proxy": 143, "pathways-rm": 143}
    if code is not None:
        codes[flags.get("--docker-name", ["jax-tpu"])[-1]] = code
    return PodEnd(codes, frozenset(conditions))


# What xpk does where it departs from the contract (the table in the rendered script's comments).
XPK_GAPS = {
    "2 bad input",
    "3 gave up",
    "42 preempted",
    "75 transient",
    "137 SIGKILL or OOM-kill",
    "134 SIGABRT",
    "139 SIGSEGV",
    "143 SIGTERM before the handler",
    "no trainer exit code",
    "evicted, stopped in time (42)",
    "evicted, killed after the grace period (137)",
    "evicted before the trainer started",
    "evicted, the trainer exited 1 while stopping",
}


@needs_bash
@pytest.mark.parametrize("pset", PARAMS)
def test_xpk_flags_and_what_xpk_makes_of_each_exit_code(pset, tmp_path):
    p = PARAMS[pset]
    flags, warnings = _xpk_flags(tmp_path, p)
    grace = DEFAULT_STOP_TIMEOUT_SECONDS + 10
    assert flags["--max-restarts"] == [str(p.max_restarts)]
    assert flags["--max-slice-restarts"] == [str(p.max_slice_restarts)]
    assert flags["--elastic-slices"] == [str(p.num_elastic_slices)]
    assert flags["--termination-grace-period-seconds"] == [str(grace)]
    assert "--restart-on-exit-codes" not in flags  # xpk applies it to `workload create` only
    # Only the acknowledged failure policy: the head pod's default grace (30 s) covers the default stop timeout.
    assert warnings == [f"{XPK_FAILURE_POLICY} (accepted with {XPK_ACCEPT_FLAG})"]
    hosts = TPU_TYPES[p.tpu_type].hosts

    gaps = set()
    for what, code, conditions, contract in CONTRACT_ROWS:
        js = JobSet(xpk_pathways_jobset(flags, hosts, renders_jobset=False))
        got = js.pod_ended("pathways-head", 0, 0, _xpk_end(flags, code, conditions))
        # Every non-zero exit, and every eviction, restarts the JobSet counted against --max-restarts.
        assert got == (COMPLETED if code == 0 and not conditions else JOBSET_RESTART), what
        if got != contract:
            gaps.add(what)
        # Releases that render the JobSet leave maxRestarts at 0: the first non-zero exit ends the run.
        js = JobSet(xpk_pathways_jobset(flags, hosts, renders_jobset=True))
        got = js.pod_ended("pathways-head", 0, 0, _xpk_end(flags, code, conditions))
        assert got == (COMPLETED if code == 0 and not conditions else JOBSET_FAILS), what
    assert gaps == XPK_GAPS

    # Preemptions use up --max-restarts: the (max_restarts + 1)-th ends the run.
    js = JobSet(xpk_pathways_jobset(flags, hosts, renders_jobset=False))
    outcomes = [js.pod_ended("pathways-head", 0, 0, _xpk_end(flags, 42)) for _ in range(p.max_restarts + 1)]
    assert outcomes == [JOBSET_RESTART] * p.max_restarts + [JOBSET_FAILS]
    # The workers get the flag's grace, the trainer's head pod Kubernetes' default (30 s).
    doc = xpk_pathways_jobset(flags, hosts, renders_jobset=True)
    assert _rjob(doc, "worker")["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
    assert (
        "terminationGracePeriodSeconds" not in _rjob(doc, "pathways-head")["template"]["spec"]["template"]["spec"]
    )
    assert KUBERNETES_DEFAULT_GRACE_SECONDS == grace


def test_xpk_warns_when_the_trainer_needs_more_grace_than_the_head_pod_gets():
    r = render("xpk", dataclasses.replace(REFERENCE, overrides=("stop_timeout_seconds=60",)))
    assert "--termination-grace-period-seconds=70" in r.text
    assert any("70 s of grace" in w and "30 s" in w for w in r.warnings)


def test_xpk_script_documents_each_code():
    text = render("xpk", REFERENCE).text
    table = text[text.index("What xpk makes of") : text.index("xpk workload create-pathways \\")]
    for code in ("0 ", "42", "75", "1 ", "2, 3"):
        assert f"#   {code}" in table, code


# ------------------------------------------------------------------------------------------------
# PathwaysJob: the JobSet its controller builds from the rendered object, under the same rules.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pset", PARAMS)
def test_what_the_pathwaysjob_controller_makes_of_each_exit_code(pset):
    p = PARAMS[pset]
    pw = _doc("pathwaysjob", p)
    doc = pathwaysjob_jobset(pw)
    head = _rjob(doc, "pathways-head")["template"]["spec"]
    assert (
        head["backoffLimit"] == 0
        and "podFailurePolicy" not in head
        and "rules" not in doc["spec"]["failurePolicy"]
    )
    gaps = set()
    for what, code, conditions, contract in CONTRACT_ROWS:
        js = JobSet(doc)
        got = js.pod_ended("pathways-head", 0, 0, trainer_end(doc, "pathways-head", code, *conditions))
        # Every non-zero exit, and every eviction, restarts the JobSet counted against maxRestarts.
        assert got == (COMPLETED if code == 0 and not conditions else JOBSET_RESTART), what
        if got != contract:
            gaps.add(what)
    assert gaps == XPK_GAPS  # what the renderer's warning and the manifest's comments list
    warning = " ".join(render("pathwaysjob", p).warnings)
    assert "exit 42" in warning and "evictions" in warning and "2 and 3" in warning
    # Preemptions use up maxRestarts: the (max_restarts + 1)-th ends the run.
    js = JobSet(doc)
    end = trainer_end(doc, "pathways-head", 42)
    outcomes = [js.pod_ended("pathways-head", 0, 0, end) for _ in range(p.max_restarts + 1)]
    assert outcomes == [JOBSET_RESTART] * p.max_restarts + [JOBSET_FAILS]


def test_pathwaysjob_head_pod_gets_the_trainers_grace_and_workers_their_budget():
    """Unlike xpk, the head pod keeps the template's terminationGracePeriodSeconds; the workers restart in place
    against hosts x maxSliceRestarts (elasticSlices > 0)."""
    p = dataclasses.replace(REFERENCE, overrides=("stop_timeout_seconds=45",))
    doc = pathwaysjob_jobset(_doc("pathwaysjob", p))
    assert (
        _rjob(doc, "pathways-head")["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 55
    )
    js = JobSet(doc)
    limit = TPU_TYPES[p.tpu_type].hosts * p.max_slice_restarts
    worker = PodEnd({"pathways-worker": 1})
    assert [js.pod_ended("worker", 0, 0, worker) for _ in range(limit)] == [POD_RESTART_COUNTED] * limit
    assert js.pod_ended("worker", 0, 0, worker) == JOBSET_RESTART
    js = JobSet(doc)
    assert js.pod_ended("pathways-head", 0, 0, trainer_end(doc, "pathways-head", 0)) == COMPLETED


# ------------------------------------------------------------------------------------------------
# Slurm: the rendered sbatch script under bash with stub srun, scontrol, sleep and trainer.
# ------------------------------------------------------------------------------------------------
SRUN = r"""
while [[ "$1" == --* ]]; do shift; done
rc=0
for (( i = 0; i < SLURM_NTASKS; i++ )); do
  SLURM_PROCID=$i "$@" || rc=$?
done
exit $rc
"""
SCONTROL = r"""
case "$1" in
  show)
    case "$2" in
      hostnames) printf "node-a\nnode-b\n" ;;
      job) echo "JobId=${SLURM_JOB_ID} JobName=run JobState=${FAKE_JOB_STATE:-RUNNING} Reason=None" ;;
    esac ;;
  requeue) echo "$2" >> "$STUBS/requeue" ;;
  *) exit 1 ;;
esac
"""
SLEEP = 'echo "$SLURM_PROCID $1" >> "$STUBS/sleep"\n'
# The trainer: pops the next exit code of its task from $STUBS/codes.<task> (0 when none is left).
TRAINER_STUB = r"""
f="$STUBS/codes.$SLURM_PROCID"
code=$(head -n 1 "$f")
tail -n +2 "$f" > "$f.rest"; mv "$f.rest" "$f"
echo "$SLURM_PROCID ${code:-0}" >> "$STUBS/runs"
exit "${code:-0}"
"""


@dataclass
class SlurmRun:
    rc: int
    stderr: str
    runs: list[tuple[int, int]]  # (task, exit code) of every trainer start, in order
    sleeps: list[tuple[int, int]]  # (task, seconds)
    requeues: list[str]


def _slurm_setup(tmp_path: Path, codes: list[int], tasks: int, trainer: str, env: Mapping) -> tuple[dict, Path]:
    """The rendered sbatch script and its environment, with the stubs first on PATH."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    bin_dir = tmp_path / "bin"
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("sleep", SLEEP), ("python", trainer)):
        stub(bin_dir, name, body)
    for task in range(tasks):
        (stubs / f"codes.{task}").write_text("".join(f"{c}\n" for c in codes))
    script = tmp_path / "job.sbatch"
    script.write_text(render("slurm", REFERENCE).text)
    environ = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUBS": str(stubs),
        "REAL_SLEEP": shutil.which("sleep") or "/bin/sleep",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NTASKS": str(tasks),
        "CONTAINER_IMAGE": "",
        **env,
    }
    return environ, script


def _slurm_result(stubs: Path, rc: int, stderr: str) -> SlurmRun:
    def words(name: str) -> list[str]:
        f = stubs / name
        return f.read_text().split() if f.exists() else []

    def pairs(name: str) -> list[tuple[int, int]]:
        numbers = [int(w) for w in words(name)]
        return list(zip(numbers[::2], numbers[1::2]))

    return SlurmRun(rc, stderr, pairs("runs"), pairs("sleep"), words("requeue"))


def _slurm(tmp_path: Path, codes: list[int], *, tasks: int = 2, **env: str) -> SlurmRun:
    """Run the sbatch script; each task's trainer exits with `codes`, one per start (then 0)."""
    environ, script = _slurm_setup(tmp_path, codes, tasks, TRAINER_STUB, env)
    out = subprocess.run(
        [BASH, str(script)], env=environ, capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    return _slurm_result(tmp_path / "stubs", out.returncode, out.stderr)


def _per_task(pairs: list[tuple[int, int]], task: int = 0) -> list[int]:
    return [v for t, v in pairs if t == task]


def test_slurm_directives_give_the_trainer_its_notice_and_allow_requeue():
    text = render("slurm", REFERENCE).text
    assert "#SBATCH --requeue" in text.splitlines()
    assert f"#SBATCH --signal=TERM@{DEFAULT_STOP_TIMEOUT_SECONDS + 10}" in text.splitlines()
    slow = render("slurm", dataclasses.replace(REFERENCE, overrides=("stop_timeout_seconds=45",))).text
    assert "#SBATCH --signal=TERM@55" in slow.splitlines()
    assert f"MAX_TASK_RESTARTS:-{REFERENCE.max_task_restarts}" in text
    assert f"MAX_RESTARTS:-{REFERENCE.max_restarts}" in text


BACKOFF = [10, 20, 40, 80, 160, 320, 600, 600, 600, 600]  # RESTART_BACKOFF_SECONDS=10 doubling, at most 600


@needs_bash
@pytest.mark.parametrize(
    "codes,rc,runs,requeued,sleeps",
    [
        pytest.param([0], 0, [0], False, [], id="0 completes"),
        pytest.param([2], 2, [2], False, [], id="2 fails at once"),
        pytest.param([3], 3, [3], False, [], id="3 fails at once"),
        pytest.param([42], 42, [42], True, [], id="42 requeues the job"),
        pytest.param([75, 75, 0], 0, [75, 75, 0], False, [10, 20], id="75 restarts in place"),
        pytest.param([137, 0], 0, [137, 0], False, [10], id="137 restarts in place"),
        pytest.param([134, 139, 143, 0], 0, [134, 139, 143, 0], False, [10, 20, 40], id="crash codes restart"),
        pytest.param([1, 1, 1, 0], 0, [1, 1, 1, 0], False, [10, 20, 40], id="1 a few restarts"),
        pytest.param([1, 1, 1, 1], 1, [1, 1, 1, 1], False, [10, 20, 40], id="1 then fails"),
        pytest.param([75, 1, 75, 1, 0], 0, [75, 1, 75, 1, 0], False, [10, 10, 20, 20], id="separate budgets"),
        pytest.param([75, 42], 42, [75, 42], True, [10], id="75 then 42 requeues"),
        pytest.param([1, 2], 2, [1, 2], False, [10], id="1 then 2 fails"),
        pytest.param([75] * 11, 75, [75] * 11, False, BACKOFF, id="75 past MAX_TASK_RESTARTS"),
    ],
)
def test_slurm_task_loop_answers_each_exit_code(tmp_path, codes, rc, runs, requeued, sleeps):
    """Every task gets the same codes (every process exits with the same code for the same cause)."""
    assert (
        REFERENCE.max_restarts == 3
        and REFERENCE.max_task_restarts == 10
        and REFERENCE.restart_backoff_seconds == 10
    )
    got = _slurm(tmp_path, codes)
    assert got.rc == rc, got.stderr
    for task in (0, 1):
        assert _per_task(got.runs, task) == runs, got.stderr
        assert _per_task(got.sleeps, task) == sleeps
    assert got.requeues == (["4242", "4242"] if requeued else [])


@needs_bash
def test_slurm_does_not_undo_a_cancel(tmp_path):
    """A job Slurm is already ending (scancel) is not requeued by a trainer that stopped with 42."""
    got = _slurm(tmp_path, [42], tasks=1, FAKE_JOB_STATE="CANCELLED")
    assert got.rc == 42 and got.requeues == [] and "not requeued" in got.stderr


@needs_bash
def test_slurm_budgets_come_from_the_environment(tmp_path):
    got = _slurm(tmp_path, [137, 137, 137], tasks=1, MAX_TASK_RESTARTS="2", RESTART_BACKOFF_SECONDS="0")
    assert got.rc == 137 and _per_task(got.runs) == [137, 137, 137] and _per_task(got.sleeps) == [0, 0]
    assert "no restarts left" in got.stderr


@needs_bash
@pytest.mark.parametrize("restarts,requeued", [("0", True), ("1", True), ("2", False), ("5", False)])
def test_slurm_preemption_budget_stops_requeueing(tmp_path, restarts, requeued):
    """MAX_PREEMPTIONS=2 (--max-preemptions): a job already requeued twice (SLURM_RESTART_COUNT) ends with 42."""
    got = _slurm(tmp_path, [42], tasks=1, MAX_PREEMPTIONS="2", SLURM_RESTART_COUNT=restarts)
    assert got.rc == 42 and got.requeues == (["4242"] if requeued else [])
    assert ("MAX_PREEMPTIONS=2): not requeued" in got.stderr) is not requeued
    text = render("slurm", dataclasses.replace(REFERENCE, max_preemptions=4)).text
    assert "MAX_PREEMPTIONS=${MAX_PREEMPTIONS:-4}" in text


# A trainer that runs until SIGTERM, then exits with $ON_TERM (its parent, the task's shell, is recorded so
# the test can signal the task as Slurm does).
TERM_TRAINER = r"""
trap 'kill "$sleeper" 2>/dev/null; exit "$ON_TERM"' TERM
"$REAL_SLEEP" 30 > /dev/null 2>&1 &
sleeper=$!
echo "$SLURM_PROCID" >> "$STUBS/started"
echo "$PPID" > "$STUBS/task.pid"
wait "$sleeper"
exit 99
"""


@needs_bash
@pytest.mark.parametrize("on_term,rc,requeued", [(42, 42, True), (0, 0, False), (75, 75, False)])
def test_slurm_sigterm_reaches_the_trainer_and_is_not_restarted(tmp_path, on_term, rc, requeued):
    """SIGTERM to a task (the time-limit notice): the trainer gets it; 42 requeues the job, and no exit
    after a SIGTERM restarts the trainer in place."""
    environ, script = _slurm_setup(tmp_path, [], 1, TERM_TRAINER, {"ON_TERM": str(on_term)})
    stubs = tmp_path / "stubs"
    proc = subprocess.Popen([BASH, str(script)], env=environ, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pid_file = stubs / "task.pid"
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, "the trainer did not start"
            time.sleep(0.02)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    got = _slurm_result(stubs, proc.returncode, stderr)
    assert got.rc == rc, stderr
    assert (stubs / "started").read_text().split() == ["0"]  # started once, not restarted
    assert got.requeues == (["4242"] if requeued else [])
    assert got.sleeps == []
