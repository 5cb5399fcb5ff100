"""The identity of a run's frozen model (a LoRA run's base, a DPO run's reference): what its checkpoints
record and a resume must find again.

A base loaded from `load_parameters_path` is named by that path and the SHA-256 of its content (every
file of the committed checkpoint directory but the commit marker, by relative path, in path order); a
base initialised from `init_weights_seed` by the seed and the model's architecture keys. The record is
saved in every step's config (the persistent tier's metadata and the local tier's manifest under
`RECORD_KEY`) and compared before compiling (`trainer.preflight`): adapters trained over one base are never
resumed over another.
"""

from __future__ import annotations

import functools
import hashlib

RECORD_KEY = "lora_base"
_CHUNK = 1 << 22


@functools.lru_cache(maxsize=8)
def content_sha256(path: str) -> str:
    """SHA-256 over the files of the committed checkpoint directory `path` (relative name, size and bytes of
    each, in name order; the commit marker left out). Read once per process and path."""
    from trainer.checkpoint import commit
    from trainer.io.paths import resolve

    root = resolve(path)
    digest = hashlib.sha256()
    for rel, f in sorted(_files(root, "")):
        if f.name == commit.COMMIT_MARKER:
            continue
        digest.update(rel.encode() + b"\0")
        with f.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def _files(directory, prefix: str) -> list:
    """(relative name, path) of every file under `directory` (a walk by listing: works on gs:// too)."""
    out = []
    for entry in directory.iterdir():
        rel = f"{prefix}{entry.name}"
        out += _files(entry, rel + "/") if entry.is_dir() else [(rel, entry)]
    return out


def base_record(load_parameters_path: str, init_weights_seed: int) -> dict:
    """The base's identity as saved with each step: {"load_parameters_path", "sha256"} or
    {"init_weights_seed"} (the architecture is in the same config record)."""
    if load_parameters_path:
        return {"load_parameters_path": load_parameters_path, "sha256": content_sha256(load_parameters_path)}
    return {"init_weights_seed": init_weights_seed}


def difference(saved: dict | None, now: dict) -> str | None:
    """None when a step saved over base `saved` can resume over base `now`; else what differs. A step that
    records no base (not a LoRA run's) is the structure check's business, not this one's."""
    if saved is None or saved == now:
        return None
    if "sha256" in saved and saved.get("sha256") == now.get("sha256"):
        return None  # the same content, moved: the adapters fit it
    return f"its adapters were trained over base {_show(saved)}, this run's base is {_show(now)}"


def _show(record: dict) -> str:
    if "sha256" in record:
        return f"load_parameters_path={record['load_parameters_path']} (sha256 {record['sha256'][:12]}...)"
    return f"initialised from init_weights_seed={record.get('init_weights_seed')}"
