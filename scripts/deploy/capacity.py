"""Capacity (--capacity on-demand | spot): the node selector and toleration that put the accelerator pods on GKE
Spot nodes, and the header lines that say what Spot changes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scripts.deploy.artefact import comment_lines
from scripts.deploy.graceful_stop import SPOT_STOP_MARGIN_SECONDS

if TYPE_CHECKING:
    from scripts.deploy.params import DeployParams

# Capacity (--capacity). GKE Spot: "By default, GKE clusters give Pods a 30-second graceful termination period
# after the preemption notice: the first 15 seconds to shut down your Pods, the next 15 for critical system
# Pods" (https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms, Termination and graceful shutdown of
# Spot VMs; GKE 1.35.0-gke.1171000+ Standard node pools and custom ComputeClasses can extend the period to
# 120 s: --spot-grace-seconds). Under Spot the trainer's stop fits that: its pods claim at most the grace
# GKE gives, with a shorter margin.
CAPACITIES = ("on-demand", "spot")
SPOT_NODE_LABEL = "cloud.google.com/gke-spot"  # GKE's node label of Spot nodes (Standard and Autopilot)
DEFAULT_SPOT_GRACE_SECONDS = 15


def capacity_node_selector(p: DeployParams) -> dict:
    """The node label that puts a pod on Spot nodes under --capacity spot (GKE labels every Spot node with it)."""
    return {SPOT_NODE_LABEL: "true"} if p.spot else {}


def spot_tolerations(p: DeployParams) -> list[dict]:
    """The toleration of GKE's Spot taint (cloud.google.com/gke-spot=true:NoSchedule: Autopilot puts it on Spot
    nodes, and GKE's Spot guide suggests it for Standard Spot node pools); harmless on an untainted pool."""
    if not p.spot:
        return []
    return [{"key": SPOT_NODE_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}]


def capacity_tolerations(p: DeployParams) -> dict:
    return {"tolerations": spot_tolerations(p)} if p.spot else {}


def capacity_header(p: DeployParams, spot_pods: str, *, tolerate: bool = True) -> list[str]:
    """The header's lines on --capacity."""
    if not p.spot:
        return ["# Capacity: on-demand (--capacity spot: Spot nodes, and a stop that fits their notice)."]
    return comment_lines(
        f"Capacity: Spot. {spot_pods} select {SPOT_NODE_LABEL}=true"
        + (" and tolerate its taint" if tolerate else " (a PathwaysJob cannot give them tolerations)")
        + ". GKE gives a "
        f"Spot pod {p.spot_grace_seconds} s after the notice (--spot-grace-seconds): the trainer's "
        f"stop_timeout_seconds is at most {p.spot_stop_timeout} s ({p.spot_grace_seconds} s less a "
        f"{SPOT_STOP_MARGIN_SECONDS} s margin) and no pod's terminationGracePeriodSeconds exceeds "
        f"{p.spot_grace_seconds} s."
    )
