"""`cluster=pathways`: one controller drives every slice through Pathways (TPU).

`join` initialises pathwaysutils (its proxy backend); slice health and the slice-down classification
are pathwaysutils' own (`LocalCluster` with `single_controller`), and nothing is injected: the slices
are real.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from trainer.config.errors import ConfigError
from trainer.elastic.backends.backend import BackendSpec
from trainer.elastic.backends.one_controller import OneController
from trainer.elastic.cluster import Cluster
from trainer.elastic.local_cluster import LocalCluster


class PathwaysBackend(OneController):
    name = "pathways"
    why = "enable_single_controller=true"

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        if importlib.util.find_spec("pathwaysutils") is None:
            raise ConfigError(
                f"{spec.asked(self.name, self.why)} needs pathwaysutils, which is not installed: install it "
                "(pip install pathwaysutils), or set cluster=local"
            )

    def join(self) -> None:
        import pathwaysutils

        pathwaysutils.initialize()  # Pathways proxy backend: one controller sees every slice

    def cluster(self, slices: list[list], *, events, stop: Callable[[int], bool], chaos_dir: Path) -> Cluster:
        e = self.spec.elastic
        return LocalCluster(
            slices,
            timeout_s=e.elastic_timeout_seconds,
            poll_s=e.elastic_poll_interval_seconds,
            single_controller=True,
        )
