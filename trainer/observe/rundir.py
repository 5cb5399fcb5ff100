"""Where a run's files live: `<base_output_directory>/<run_name>/`, local disk or an object store.

Run identity: the same command resumes the same run. An empty `run_name` is taken from the job that
runs the trainer, the same on every process and every restart of it ($JOBSET_NAME under JobSet and
xpk, $SLURM_JOB_NAME-$SLURM_JOB_ID under Slurm), and outside a job it is `<model>-<data>` (e.g.
`qwen3-tiny-synthetic`), so rerunning a command continues its run and another model or dataset gets
its own directory.

Checkpoints are written by Orbax straight to the run directory, wherever it is (gs:// included).
Append-only logs (metrics.jsonl, events.jsonl, TensorBoard) cannot be appended to in place on object
stores, so for a remote run directory they are written to a local mirror: `pull()` first continues the
bucket's logs (a restarted pod appends to what earlier pods wrote), and `sync()` sends what is new.

`sync()` appends on Cloud Storage: the new bytes of a log go up as a small object that is composed onto
the log (one request, no re-upload of what the bucket has), whole lines only for the JSONL logs, so the
bucket never holds a torn record; a log that reaches `REWRITE_AT_COMPONENTS` compositions (GCS allows
1024) is uploaded whole once, which resets it. Other files (config.yml, stacks of a hang, profiles) go
up whole when they change; the chaos requests and `control/` (the control endpoint's token,
`trainer.observe.control`) never go up. It runs every `LIVE_SYNC_SECONDS` and soon after each committed checkpoint
(`trainer.observe.live_upload`), after each attempt and at the finish, so a process killed -9 loses at
most the last interval of its logs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from etils import epath

from trainer.io.paths import is_remote, resolve
from trainer.logevents import event_extra
from trainer.observe.control import CONTROL_DIR

log = logging.getLogger(__name__)
APPEND_ONLY_LOGS = ("metrics.jsonl", "events.jsonl")
TENSORBOARD_EVENTS = "events.out.tfevents."  # TensorBoard's record files: appended to, never rewritten
# A remote run's logs reach the bucket at most this long after they are written (and after each commit).
LIVE_SYNC_SECONDS = 30.0
# Cloud Storage composes at most 1024 components into one object: rewrite a log whole before that.
REWRITE_AT_COMPONENTS = 1000


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
    # path -> (size, mtime_ns) at its last whole upload, or ("append", bytes in the bucket, components)
    # for a log appended to; and when the last sync ran ("", (time, 0))
    _uploaded: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    _syncing: threading.Lock = dataclasses.field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def run_dir(self) -> str:
        """The run directory as the user sees it (the bucket path for a remote run)."""
        return str(self.remote if self.remote is not None else self.local)

    def pull(self) -> None:
        """Continue the bucket's append-only logs: copy each down unless the local mirror already holds
        it and more (a restarted pod on a fresh node starts with an empty mirror; a mirror left by a pod
        that another pod outlived on another node has diverged from the bucket, which wins)."""
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
                    with open(dst, "rb") as f:
                        if f.read(len(data)) == data:
                            continue  # the bucket's log and more: this node's own, not yet sent
                dst.write_bytes(data)
                log.info(
                    "continued %s from the bucket (%d bytes)",
                    src,
                    len(data),
                    extra=event_extra("log_pulled", {"file": str(src), "bytes": len(data)}),
                )
            except Exception as e:  # noqa: BLE001 - a failed download must not end training
                log.warning("could not continue %s from the bucket: %s", src, e)

    def sync(self, min_interval_s: float = 0.0) -> int:
        """Send the local files that changed since their last upload to the remote run directory (no-op
        for a local run): the logs' new bytes appended, other files whole (module doc). With
        `min_interval_s`, nothing when the previous sync was more recent (a run that recovers hundreds of
        times would otherwise send its logs at every recovery). Thread-safe. Returns the bytes sent."""
        if self.remote is None:
            return 0
        with self._syncing:
            now = time.monotonic()
            last = self._uploaded.get("", (None, 0))[0]
            if min_interval_s and last is not None and now - last < min_interval_s:
                return 0
            self._uploaded[""] = (now, 0)
            sent = 0
            try:
                for src in sorted(self.local.rglob("*")):
                    if not src.is_file() or "chaos" in src.parts:
                        continue
                    if src.relative_to(self.local).parts[0] == CONTROL_DIR:
                        continue  # the control endpoint's token stays with the job's user
                    dst = self.remote / src.relative_to(self.local).as_posix()
                    if src.name in APPEND_ONLY_LOGS or src.name.startswith(TENSORBOARD_EVENTS):
                        sent += self._append(src, dst, whole_lines=src.name in APPEND_ONLY_LOGS)
                    else:
                        sent += self._replace(src, dst)
            except Exception as e:  # losing a log upload must not end training
                log.warning("could not sync run logs to %s: %s", self.remote, e)
            return sent

    def _replace(self, src: Path, dst: epath.Path) -> int:
        stat = src.stat()
        version = (stat.st_size, stat.st_mtime_ns)
        if self._uploaded.get(str(src)) == version:
            return 0
        dst.parent.mkdir(parents=True, exist_ok=True)
        data = src.read_bytes()
        dst.write_bytes(data)
        self._uploaded[str(src)] = version
        return len(data)

    def _append(self, src: Path, dst: epath.Path, *, whole_lines: bool) -> int:
        """Send the bytes of `src` past what the bucket holds: composed onto `dst` on Cloud Storage,
        else (or when `dst` is new or nearly out of components) `dst` written whole."""
        known = self._uploaded.get(str(src))
        if known is None:
            sent_bytes, components = _remote_extent(dst)
        else:
            _, sent_bytes, components = known
        with open(src, "rb") as f:
            f.seek(sent_bytes)
            new = f.read()
        if whole_lines:
            new = new[: new.rfind(b"\n") + 1]  # a line still being written goes with the next sync
        if not new:
            self._uploaded[str(src)] = ("append", sent_bytes, components)
            return 0
        fs, key = _gcs(dst)
        if fs is None or sent_bytes == 0 or components + 1 >= REWRITE_AT_COMPONENTS:
            with open(src, "rb") as f:
                data = f.read(sent_bytes + len(new))
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            self._uploaded[str(src)] = ("append", len(data), 1)
            return len(data)
        part = f"{key.rsplit('/', 1)[0]}/.{dst.name}.append-{uuid.uuid4().hex[:12]}"
        fs.pipe_file(part, new)
        try:
            fs.merge(key, [key, part])  # GCS compose: the log, then the new bytes, as the log
        finally:
            fs.rm_file(part)
        self._uploaded[str(src)] = ("append", sent_bytes + len(new), components + 1)
        return len(new)


def _gcs(path: epath.Path):
    """(gcsfs filesystem, key) for a gs:// path, (None, "") for any other store (no compose there)."""
    if not str(path).startswith("gs://"):
        return None, ""
    import fsspec

    fs, key = fsspec.core.url_to_fs(str(path))
    return (fs, key) if hasattr(fs, "merge") else (None, "")


def _remote_extent(path: epath.Path) -> tuple[int, int]:
    """(bytes, compose components) of an object already in the bucket; (0, 0) when there is none."""
    fs, key = _gcs(path)
    if fs is None:
        return (path.stat().length, 1) if path.exists() else (0, 0)
    fs.invalidate_cache(key)  # gcsfs caches listings: ask the bucket
    try:
        info = fs.info(key)
    except FileNotFoundError:
        return 0, 0
    return int(info.get("size", 0)), int(info.get("componentCount", 1))


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
