"""`cluster=local`: one process whose devices are grouped into virtual slices (CPU, one host's GPUs).

The virtual slices fail as real ones do: the fault injector (`trainer.elastic.faults`) fires the
schedule's faults and `trainer.chaos` requests at step boundaries, a step on a down slice fails with
Pathways' error, and a lost slice takes its snapshot replicas with it (`LocalCluster`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainer.elastic.backends.one_controller import OneController
from trainer.elastic.cluster import Cluster
from trainer.elastic.faults import FaultInjector
from trainer.elastic.local_cluster import LocalCluster
from trainer.failures.slice_loss import Outages


class LocalBackend(OneController):
    name = "local"

    def cluster(self, slices: list[list], *, events, stop: Callable[[int], bool], chaos_dir: Path) -> Cluster:
        e = self.spec.elastic
        outages = Outages()  # which virtual slices are down
        injector = FaultInjector(self.spec.faults.check_processes(1), outages, chaos_dir, events)
        return LocalCluster(
            slices,
            timeout_s=e.elastic_timeout_seconds,
            poll_s=e.elastic_poll_interval_seconds,
            outages=outages,
            injector=injector,
        )
