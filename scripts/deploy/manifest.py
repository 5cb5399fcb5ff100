"""Kubernetes manifests (jobset-pathways, pathwaysjob, jobset-gpu) as Python dicts dumped with PyYAML, and the
pieces every manifest shares: metadata, env entries, the trainer container's name."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from scripts.deploy.params import DeployParams

TRAINER_CONTAINER = "trainer"  # the container that runs the trainer in the Kubernetes manifests
JOBSET_API = "jobset.x-k8s.io/v1alpha2"


class ManifestDumper(yaml.SafeDumper):
    """`yaml.safe_dump`'s dumper with two changes for files kubectl reads:

    - a string that Kubernetes' YAML parser (go-yaml: YAML 1.1, whose floats need no dot) or a YAML 1.2
      parser would read as a number (`1e3`, `0o17`) is quoted, as PyYAML already quotes `true`, `007`, `1.5`
      (an env value or a label must stay a string);
    - a string of several lines is a literal block (`|`), so a script in a command reads as written;
    - an object used twice is written out twice, not as a YAML alias.
    """

    def ignore_aliases(self, data) -> bool:
        return True


ManifestDumper.add_implicit_resolver(  # only decides quoting: a plain scalar matching it would not be a string
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    list("-+.0123456789"),
)


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_str(value)


ManifestDumper.add_representer(str, _represent_str)


def manifest_text(header: Sequence[str], manifest: Mapping) -> str:
    """The file of one Kubernetes object: its comment lines, then the object as YAML (keys in the order built,
    no line folding)."""
    assert all(line.startswith("#") for line in header), header
    body = yaml.dump(dict(manifest), Dumper=ManifestDumper, sort_keys=False, width=2**31 - 1)
    return "\n".join(header) + "\n" + body


def env_list(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in pairs]


def field_env(name: str, field_path: str) -> dict:
    """An environment variable from the downward API."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def job_identity_env() -> list[dict]:
    """The job's name and namespace from the downward API: the trainer names its run after them and takes
    the run's lease as that job, so a restarted pod of the same JobSet takes it over at once
    (trainer/checkpoint/lease.py)."""
    return [
        field_env("JOBSET_NAME", "metadata.labels['jobset.sigs.k8s.io/jobset-name']"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
    ]


def manifest_metadata(p: DeployParams) -> dict:
    labels = {"app.kubernetes.io/part-of": "elastic-trainer", "elastic-trainer/job": p.job_name}
    if p.queue:
        labels["kueue.x-k8s.io/queue-name"] = p.queue
    return {"name": p.job_name, "namespace": p.namespace, "labels": labels}


METRICS_PORT_NAME = "metrics"  # the trainer container's port of its live metrics (metrics_port)
METRICS_PATH = "/metrics"


def metrics_ports(p: DeployParams) -> list[dict]:
    """The trainer container's `metrics` port entry (none while --metrics-port is 0)."""
    if not p.metrics_port:
        return []
    return [{"name": METRICS_PORT_NAME, "containerPort": p.metrics_port, "protocol": "TCP"}]


def scrape_annotations(p: DeployParams) -> dict[str, str]:
    """The prometheus.io annotations of the trainer's pod, which Prometheus' Kubernetes pod discovery (the
    common `kubernetes-pods` job) reads to scrape it (none while --metrics-port is 0)."""
    if not p.metrics_port:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(p.metrics_port),
        "prometheus.io/path": METRICS_PATH,
    }
