"""A committed step's own files, checked independently of any config: the only proof of corruption.

At commit the trainer records every file of the step (`files.json`: relative path, size, and a CRC32C
checksum where it is cheap: computed for local files, taken from the object store's listing for remote
ones, which keeps one for every object). When a restore fails with anything but a config mismatch or a
lost device, `verify_step` re-checks the step: commit marker, Orbax's metadata readable, every
recorded file present, of its size and checksum. A failed check is proof that this step is broken,
and the checkpointer sets it aside naming the check; a step that passes them all failed for another
reason (a storage blip, a peer, memory), and is never touched.

A step without `files.json` (written by another tool, or by a trainer that did not record its files) is
checked for what can be checked without it: marker and metadata.
"""

from __future__ import annotations

import json
import logging
import os
import zlib

from etils import epath

from trainer.io.paths import is_remote

log = logging.getLogger(__name__)

FILES = "files.json"
FORMAT = 1
_CHUNK = 8 << 20


def _crc32(path: epath.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _remote_listing(root: epath.Path) -> dict[str, dict]:
    """{relative path: {"size", "crc32c"}} of every object under `root`, from one listing."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(str(root))
    found = fs.find(path, detail=True)
    out = {}
    for name, info in found.items():
        if info.get("type") == "directory":
            continue
        rel = name[len(path.rstrip("/")) + 1 :]
        out[rel] = {"size": int(info.get("size") or 0), "crc32c": info.get("crc32c")}
    return out


def _local_listing(root: epath.Path, *, checksums: bool) -> dict[str, dict]:
    out = {}
    base = os.fspath(root)
    for directory, _, names in os.walk(base):
        for name in names:
            path = os.path.join(directory, name)
            entry = {"size": os.path.getsize(path)}
            if checksums:
                entry["crc32"] = _crc32(epath.Path(path))
            out[os.path.relpath(path, base).replace(os.sep, "/")] = entry
    return out


def listing(root: epath.PathLike, *, checksums: bool = True) -> dict[str, dict]:
    root = epath.Path(root)
    return _remote_listing(root) if is_remote(str(root)) else _local_listing(root, checksums=checksums)


# Written by Orbax's commit itself, after the record: checked for readability, not recorded.
_COMMIT_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")


def record(step_dir: epath.PathLike) -> int:
    """Write `files.json` into a finished (not yet committed) step directory; returns the files listed."""
    step_dir = epath.Path(step_dir)
    files = {rel: e for rel, e in listing(step_dir).items() if rel != FILES and rel not in _COMMIT_FILES}
    (step_dir / FILES).write_text(json.dumps({"format": FORMAT, "files": files}, sort_keys=True))
    return len(files)


def verify_step(step_dir: epath.PathLike) -> str | None:
    """None when every check passes, else the first failed check: 'missing file X', 'truncated X: a of b
    bytes', 'checksum mismatch X', 'unreadable metadata: ...', 'no commit marker'."""
    from trainer.checkpoint import commit
    from trainer.checkpoint.compat import stored_orbax_signature

    step_dir = epath.Path(step_dir)
    try:
        if not (step_dir / commit.COMMIT_MARKER).exists():
            return f"no commit marker ({commit.COMMIT_MARKER})"
        recorded = None
        if (step_dir / FILES).exists():
            try:
                recorded = json.loads((step_dir / FILES).read_text())["files"]
            except (ValueError, KeyError) as e:
                return f"unreadable {FILES}: {e}"
        if recorded is not None:
            problem = _compare(step_dir, recorded)
            if problem:
                return problem
        for item in ("_CHECKPOINT_METADATA", "metadata/metadata", "data/metadata"):
            if (step_dir / item).exists():
                try:
                    json.loads((step_dir / item).read_text())
                except ValueError as e:
                    return f"unreadable metadata: {item}: {e}"
        if (step_dir / "state").exists() and stored_orbax_signature(step_dir) is None:
            return "unreadable metadata: state (Orbax's tree metadata cannot be read)"
    except OSError as e:  # storage refused to answer: nothing is proven about the step
        log.warning("could not verify %s: %s", step_dir, e)
        return None
    return None


def _compare(step_dir: epath.Path, recorded: dict[str, dict]) -> str | None:
    remote = is_remote(str(step_dir))
    present = listing(step_dir, checksums=False)
    for rel, want in sorted(recorded.items()):
        have = present.get(rel)
        if have is None:
            return f"missing file {rel}"
        if have["size"] != want["size"]:
            return f"truncated {rel}: {have['size']} of {want['size']} bytes"
        if remote:
            if want.get("crc32c") and have.get("crc32c") and want["crc32c"] != have["crc32c"]:
                return f"checksum mismatch {rel}"
        elif "crc32" in want and _crc32(step_dir / rel) != want["crc32"]:
            return f"checksum mismatch {rel}"
    return None
