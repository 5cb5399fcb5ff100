"""Where a run's files live: `<base_output_directory>/<run_name>/`, local disk or an object store.

Checkpoints are written by Orbax straight to the run directory, wherever it is (gs:// included).
Append-only logs (metrics.jsonl, events.jsonl, TensorBoard) cannot be appended to on object stores,
so for a remote run directory they are written to a local mirror and copied up by `sync()` at each
attempt's end and at the finish.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from pathlib import Path

from etils import epath

log = logging.getLogger(__name__)


def is_remote(path: str) -> bool:
    return "://" in path


@dataclasses.dataclass(frozen=True)
class RunPaths:
    local: Path                   # logs, config.yml, TensorBoard, chaos requests
    checkpoints: epath.Path       # <run dir>/checkpoints, local or remote
    remote: epath.Path | None     # the run directory when it is on an object store

    def sync(self) -> None:
        """Copy the local logs to the remote run directory (no-op for a local run)."""
        if self.remote is None:
            return
        try:
            for src in self.local.rglob("*"):
                if src.is_file() and "chaos" not in src.parts:
                    dst = self.remote / src.relative_to(self.local).as_posix()
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(src.read_bytes())
        except Exception as e:  # losing a log upload must not end training
            log.warning("could not sync run logs to %s: %s", self.remote, e)


def run_paths(base_output_directory: str, run_name: str) -> RunPaths:
    if is_remote(base_output_directory):
        remote = epath.Path(base_output_directory) / run_name
        local = Path(os.environ.get("TRAINER_LOCAL_RUN_ROOT", tempfile.gettempdir())) / "trainer_runs" / run_name
        return RunPaths(local=local, checkpoints=remote / "checkpoints", remote=remote)
    local = Path(base_output_directory) / run_name
    return RunPaths(local=local, checkpoints=epath.Path(local) / "checkpoints", remote=None)



