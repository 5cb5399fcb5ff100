"""How long the trainer gets to stop: its stop timeout, the grace every pod that runs it gets
(terminationGracePeriodSeconds) or Slurm's notice, and the check that the stop fits Spot's short notice."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from scripts.deploy.errors import DeployError

if TYPE_CHECKING:
    from scripts.deploy.params import DeployParams

# The trainer stops within stop_timeout_seconds of a SIGTERM; every pod that runs it gets that much plus a
# margin before Kubernetes kills it (terminationGracePeriodSeconds), and Slurm sends its notice that early.
DEFAULT_STOP_TIMEOUT_SECONDS = 20  # mirrors the default of the trainer key stop_timeout_seconds
STOP_MARGIN_SECONDS = 10
KUBERNETES_DEFAULT_GRACE_SECONDS = 30  # terminationGracePeriodSeconds of a pod that does not set it
SPOT_STOP_MARGIN_SECONDS = 5  # the margin under Spot, whose notice is short (capacity.py)


def grace_seconds(stop_timeout_seconds: float, margin: int = STOP_MARGIN_SECONDS) -> int:
    """Slurm's notice before the time limit, and (with the parameters' margin: `pod_grace`) the
    terminationGracePeriodSeconds of every pod that runs the trainer: the trainer's stop timeout plus a margin."""
    return math.ceil(stop_timeout_seconds) + margin


def pod_grace(p: DeployParams, stop_timeout_seconds: float) -> int:
    """terminationGracePeriodSeconds of a pod that runs the trainer: its stop timeout plus the margin of the
    capacity (10 s; 5 s under Spot, whose notice is short)."""
    return grace_seconds(stop_timeout_seconds, p.stop_margin)


def check_spot_fit(p: DeployParams, stop_timeout_seconds: float) -> None:
    """Under Spot the trainer's pods may claim no more grace than GKE gives them (--spot-grace-seconds)."""
    if p.spot and pod_grace(p, stop_timeout_seconds) > p.spot_grace_seconds:
        raise DeployError(
            f"stop_timeout_seconds={stop_timeout_seconds:g} cannot fit Spot's notice: GKE gives a Spot pod "
            f"{p.spot_grace_seconds} s (--spot-grace-seconds) and the trainer needs its stop timeout plus "
            f"{SPOT_STOP_MARGIN_SECONDS} s; use stop_timeout_seconds<={p.spot_stop_timeout} (or leave it out: "
            "the renderer sets it), or raise --spot-grace-seconds to what your node pools give (GKE can extend it "
            "to 120 s: docs/running_at_scale.md, Spot capacity)"
        )


def worker_grace(p: DeployParams) -> int:
    """terminationGracePeriodSeconds of a Pathways worker pod: Kubernetes' default, no more than Spot gives."""
    if p.spot:
        return min(KUBERNETES_DEFAULT_GRACE_SECONDS, p.spot_grace_seconds)
    return KUBERNETES_DEFAULT_GRACE_SECONDS
