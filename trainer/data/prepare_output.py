"""Where a data preparation's output goes: the checks before any work, the work directory, publishing.

A preparation (trainer/data/shards.py) builds everything in a work directory named by a digest of what
determines its output (the inputs with their sizes and versions, the tokenizer, the fields, the text
unit, the number of shards, the prefix, the unit size, the output): a rerun of the same command finds it
and resumes, a different command never reuses it. For a local output it is a hidden sibling
(`<parent>/.<name>.prepare-<digest>`, so a glob over the output never sees it); for a gs:// output it is
under the local cache (TRAINER_CACHE_DIR, default ~/.cache/elastic-trainer, `prepare/<digest>`). It
holds `units/` (the work units, trainer/data/prepare_units.py), `shards/` (the output being built),
`merged.json` (written once `shards/` is complete) and a lock that refuses a second run of the same
command while one is running.

`publish` then puts the output in place. Locally the whole directory is swapped in by a rename (an old
output, replaced only with --overwrite, is moved aside first and removed after). On gs:// an object
appears only once its upload completed, so no half-written shard is ever visible: the old
dataset_info.json is deleted first, then the shards are uploaded, old shards the new output does not
have are deleted, and dataset_info.json is uploaded last: on an object store, dataset_info.json marks
a complete output.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from trainer.data.errors import DataError
from trainer.data.readers import SHARD_SUFFIX
from trainer.io import paths
from trainer.io.staging import check_writable
from trainer.logevents import event_extra

log = logging.getLogger(__name__)

INFO_FILE = "dataset_info.json"
MERGED = "merged.json"  # in the work directory: shards/ is complete and holds dataset_info.json


def resolve_output(path: str | os.PathLike) -> Path | str:
    """A local output as an absolute Path; a gs:// output as its URI."""
    if paths.is_remote(path):
        return os.fspath(path).rstrip("/")
    return Path(os.fspath(paths.resolve(path)))


def _check_entries(label: str, entries: list[str], overwrite: bool) -> None:
    foreign = [n for n in entries if not (n.endswith(SHARD_SUFFIX) or n == INFO_FILE)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        if paths.is_remote(label):
            raise DataError(
                f"--output-dir {label} holds objects this tool did not write ({shown}); the shards get a "
                "prefix of their own: choose another --output-dir"
            )
        raise DataError(
            f"--output-dir {label} holds files this tool did not write ({shown}); the directory is "
            "replaced as a whole, so move them out or choose another --output-dir"
        )
    if not overwrite:
        shards = sum(n.endswith(SHARD_SUFFIX) for n in entries)
        raise DataError(
            f"{label} already holds {shards} {SHARD_SUFFIX} shards; a glob over it would mix old and new "
            "data: pass --overwrite (the old shards are replaced only once the new ones are written) "
            "or choose another --output-dir"
        )


def check_output(out: Path | str, overwrite: bool) -> None:
    """Refuse before any work what publishing must not replace. The whole directory is replaced, so
    files this tool did not write in it are refused even with --overwrite; old shards need --overwrite,
    since a glob over the directory would mix old and new data. An empty directory is simply replaced."""
    if isinstance(out, str):
        dest = paths.resolve(out)
        if dest.is_file():
            raise DataError(f"--output-dir {out} is an object, not a directory; choose another --output-dir")
        entries = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
    else:
        check_writable(out, overwrite=True, name="--output-dir")  # its parent: a directory, writable
        if not out.exists():
            return
        if not out.is_dir():
            raise DataError(f"--output-dir {out} is a file, not a directory; choose another --output-dir")
        entries = sorted(p.name for p in out.iterdir())
    if entries:
        _check_entries(str(out), entries, overwrite)


def digest(description: dict) -> str:
    """A short digest of what determines a preparation's output (its work directory's name)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def work_dir(out: Path | str, key: str) -> Path:
    if isinstance(out, str):
        return paths.default_cache_dir() / "prepare" / key
    return out.with_name(f".{out.name}.prepare-{key}")


def make_work_dir(work: Path) -> list[Path]:
    """Create `work` and its missing parents; returns the parents it created, deepest first."""
    created, parent = [], work.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    work.mkdir(parents=True, exist_ok=True)
    return created


def remove_work_dir(work: Path, created_parents: list[Path] = ()) -> None:
    for _ in range(3):  # a worker of a killed earlier run may still be finishing a unit in it
        shutil.rmtree(work, ignore_errors=True)
        if not work.exists():
            break
        time.sleep(0.5)
    for folder in created_parents:
        try:
            folder.rmdir()
        except OSError:
            break


@contextlib.contextmanager
def locked(work: Path, out: Path | str):
    """Hold the work directory's lock (released by the OS if this process dies, kill -9 included)."""
    fd = os.open(work / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(
                f"another preparation of the same inputs into {out} is running (its work directory {work} "
                "is locked); wait for it to finish, or stop it and rerun"
            ) from None
        yield
    finally:
        os.close(fd)


def already_published(work: Path, out: Path | str) -> bool:
    """An earlier run completed the output and was stopped before removing its work directory."""
    return not (work / "shards").exists() and isinstance(out, Path) and (out / INFO_FILE).is_file()


def publish(built: Path, out: Path | str) -> None:
    """Put the complete output `built` (shards + dataset_info.json) in place of `out`."""
    if isinstance(out, str):
        _upload_all(built, out)
        return
    if not out.exists():
        os.replace(built, out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(out, old)
    os.replace(built, out)
    shutil.rmtree(old, ignore_errors=True)


def _upload(src: Path, dest) -> None:
    with open(src, "rb") as f, dest.open("wb") as g:  # the object appears when the upload completes
        shutil.copyfileobj(f, g, 1 << 22)


def _upload_all(built: Path, uri: str) -> None:
    dest = paths.resolve(uri)
    info = dest / INFO_FILE
    if info.exists():
        info.unlink()  # from here until the new one is uploaded, the output is marked incomplete
    shards = sorted(p.name for p in built.iterdir() if p.name != INFO_FILE)
    for name in shards:
        _upload(built / name, dest / name)
    for p in sorted(dest.iterdir(), key=str) if dest.is_dir() else []:
        if p.name.endswith(SHARD_SUFFIX) and p.name not in shards:
            p.unlink()  # an old shard the new output does not have
    _upload(built / INFO_FILE, info)
    log.info(
        "uploaded %d shards to %s",
        len(shards),
        uri,
        extra=event_extra("prepare_uploaded", {"output": str(uri), "shards": len(shards)}),
    )
