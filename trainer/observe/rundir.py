"""Where a run's files live: `<base_output_directory>/<run_name>/`, local disk or an object store.

Run identity: the same command resumes the same run. An empty `run_name` is taken from the job that
runs the trainer, the same on every process and every restart of it ($JOBSET_NAME under JobSet and
xpk, $SLURM_JOB_NAME-$SLURM_JOB_ID under Slurm), and outside a job it is `<model>-<data>` (e.g.
`qwen3-tiny-synthetic`), so rerunning a command continues its run and another model or dataset gets
its own directory.

Checkpoints are written by Orbax straight to the run directory, wherever it is (gs:// included).
Append-only logs (metrics.jsonl, events.jsonl, TensorBoard) cannot be appended to on object stores,
so for a remote run directory they are written to a local mirror: `pull()` first continues the
bucket's logs (a restarted pod appends to what earlier pods wrote), `sync()` copies them up at each
attempt's end and at the finish.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from etils import epath

from trainer.io.paths import is_remote, resolve

log = logging.getLogger(__name__)
APPEND_ONLY_LOGS = ("metrics.jsonl", "events.jsonl")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "run"


def _model_tag(model: str) -> str:
    """A preset name as is; a model YAML path by its folder (`ckpt/qwen3-0.6b/model.yml` -> qwen3-0.6b)."""
    path = Path(model)
    if model.endswith((".yml", ".yaml")):
        return path.parent.name if path.stem == "model" and path.parent.name else path.stem
    return path.name or model


def _data_tag(dataset_type: str, grain_train_files: str) -> str:
    """synthetic, or the folder (else file stem) of the first data glob: data/fc_sample/*.ar -> fc_sample."""
    if dataset_type == "synthetic" or not grain_train_files.strip():
        return dataset_type
    first = grain_train_files.split(",")[0].strip().rstrip("/")
    parts = [p for p in first.split("/") if p and not set("*?[") & set(p)]
    if first.split("/")[-1] in parts:  # no wildcard in the last part: a file
        return Path(parts[-1]).stem
    return parts[-1] if parts else dataset_type


def resolve_run_name(
    run_name: str, *, model: str, dataset_type: str, grain_train_files: str, env: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """(run name, why): the user's run_name, else the job's name, else `<model>-<data>`."""
    env = os.environ if env is None else env
    if run_name:
        return run_name, "run_name"
    if env.get("JOBSET_NAME"):
        return _slug(env["JOBSET_NAME"]), "$JOBSET_NAME"
    if env.get("SLURM_JOB_ID"):
        job = env.get("SLURM_JOB_NAME", "slurm")
        return _slug(f"{job}-{env['SLURM_JOB_ID']}"), "$SLURM_JOB_NAME-$SLURM_JOB_ID"
    return _slug(f"{_model_tag(model)}-{_data_tag(dataset_type, grain_train_files)}"), "model and data"


@dataclasses.dataclass(frozen=True)
class RunPaths:
    local: Path  # logs, config.yml, TensorBoard, chaos requests
    checkpoints: epath.Path  # <run dir>/checkpoints, local or remote
    remote: epath.Path | None  # the run directory when it is on an object store
    local_checkpoints: epath.Path | None = None  # <local_checkpoint_directory>/<run name>: the local tier
    # path -> (size, mtime_ns) at its last upload, and when the last sync ran ("", (time, 0))
    _uploaded: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def run_dir(self) -> str:
        """The run directory as the user sees it (the bucket path for a remote run)."""
        return str(self.remote if self.remote is not None else self.local)

    def pull(self) -> None:
        """Continue the bucket's append-only logs: copy each down unless the local mirror already holds
        at least as much (a restarted pod on a fresh node starts with an empty mirror)."""
        if self.remote is None:
            return
        self.local.mkdir(parents=True, exist_ok=True)
        for name in APPEND_ONLY_LOGS:
            src, dst = self.remote / name, self.local / name
            try:
                if not src.exists():
                    continue
                data = src.read_bytes()
                if dst.exists() and dst.stat().st_size >= len(data):
                    continue
                dst.write_bytes(data)
                log.info("event=log_pulled file=%s bytes=%d", src, len(data))
            except Exception as e:  # noqa: BLE001 - a failed download must not end training
                log.warning("could not continue %s from the bucket: %s", src, e)

    def sync(self, min_interval_s: float = 0.0) -> int:
        """Copy the local logs that changed since their last upload to the remote run directory (no-op for
        a local run); with `min_interval_s`, nothing when the previous sync was more recent (a run that
        recovers hundreds of times would otherwise upload its growing logs at every recovery). Returns
        the bytes uploaded."""
        if self.remote is None:
            return 0
        now = time.monotonic()
        last = self._uploaded.get("", (None, 0))[0]
        if min_interval_s and last is not None and now - last < min_interval_s:
            return 0
        self._uploaded[""] = (now, 0)
        sent = 0
        try:
            for src in self.local.rglob("*"):
                if not src.is_file() or "chaos" in src.parts:
                    continue
                stat = src.stat()
                key, version = str(src), (stat.st_size, stat.st_mtime_ns)
                if self._uploaded.get(key) == version:
                    continue
                dst = self.remote / src.relative_to(self.local).as_posix()
                dst.parent.mkdir(parents=True, exist_ok=True)
                data = src.read_bytes()
                dst.write_bytes(data)
                self._uploaded[key] = version
                sent += len(data)
        except Exception as e:  # losing a log upload must not end training
            log.warning("could not sync run logs to %s: %s", self.remote, e)
        return sent


def run_paths(base_output_directory: str, run_name: str, *, local_checkpoint_directory: str = "") -> RunPaths:
    """The run's paths; a local base directory is made absolute (relative to the working directory).
    `local_checkpoint_directory` (node-local storage) holds the local checkpoint tier under the run name."""
    base = resolve(base_output_directory)
    tier = epath.Path(resolve(local_checkpoint_directory)) / run_name if local_checkpoint_directory else None
    if is_remote(base_output_directory):
        remote = base / run_name
        bucket = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(remote))
        local = Path(os.environ.get("TRAINER_LOCAL_RUN_ROOT", tempfile.gettempdir())) / "trainer_runs" / bucket
        return RunPaths(local=local, checkpoints=remote / "checkpoints", remote=remote, local_checkpoints=tier)
    local = Path(os.fspath(base)) / run_name
    return RunPaths(
        local=local, checkpoints=epath.Path(local) / "checkpoints", remote=None, local_checkpoints=tier
    )
