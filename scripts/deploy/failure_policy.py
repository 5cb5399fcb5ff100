"""The trainer's exit-code contract (trainer/errors.py) as the JobSet manifests apply it: each trainer Job's
podFailurePolicy and restart budgets, the JobSet's failurePolicy rules, the preemption budget
(--max-preemptions), and the header lines that state the contract."""

from __future__ import annotations

from collections.abc import Sequence

from scripts.deploy.artefact import comment_lines
from scripts.deploy.manifest import TRAINER_CONTAINER
from scripts.deploy.params import DeployParams
from trainer.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_GAVE_UP,
    EXIT_PREEMPTED,
    EXIT_TRANSIENT,
)

# The exit-code contract (trainer/errors.py) as every artefact applies it to the trainer's processes:
PREEMPTED_EXIT_CODES = (EXIT_PREEMPTED,)  # stopped from outside, state saved: restart, using no budget
FINAL_EXIT_CODES = (EXIT_BAD_INPUT, EXIT_GAVE_UP)  # a restart cannot help: fail at once
BUG_EXIT_CODES = (EXIT_FAILED,)  # restart the whole run a few times (--max-restarts), then fail
# Every other non-zero code restarts the one process from a generous counted budget (--max-task-restarts):
# EXIT_TRANSIENT, and the codes of a death the trainer did not choose (137 SIGKILL or OOM-kill, 134 SIGABRT,
# 139 SIGSEGV, 143 a SIGTERM that arrived before the trainer's handler).
TRANSIENT_EXIT_CODES = (EXIT_TRANSIENT,)
FOREIGN_EXIT_CODES = (137, 134, 139, 143)


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
    return "\n".join(comment_lines(text, " " * 12))


def jobset_contract_header(p: DeployParams, pod: str, per: str) -> list[str]:
    text = _JOBSET_CONTRACT.format(
        pod=pod,
        budget=p.max_task_restarts,
        per=per,
        max_restarts=p.max_restarts,
        preempted=_preempted_outcome(p, pod),
    )
    return text.splitlines()
