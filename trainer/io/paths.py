"""One path layer for every path a user names: relative, absolute, `~`, or an object store (`gs://`).

Everything goes through etils `epath`, the layer Orbax uses, so a path that works for a checkpoint works
for data, tokenizers and logs too. Rules:
- `resolve`: outputs and load paths. Local paths become absolute (relative to the working directory,
  `~` expanded), because Orbax and a job's later processes must not depend on the cwd; remote URIs stay.
- `resolve_input`: bundled inputs (data, tokenizer). Like `resolve`, but a relative path that does not
  exist in the working directory falls back to the repository, so the defaults work from any directory.
- `expand_globs`: comma-separated globs, expanded by the same layer locally and on object stores.
- `local_copy`: readers that only open local files (ArrayRecord's C++ reader, sentencepiece) get a
  verified copy of a remote file in a per-host cache; local files are returned as they are.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import logging
import os
from pathlib import Path

from etils import epath

from trainer.logevents import event_extra

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]
_GLOB_CHARS = set("*?[")


def _list_object_stores_from_storage() -> None:
    """gcsfs keeps every directory listing for the life of a filesystem object, and epath and fsspec each
    hold their own: a step another process committed, or a lease generation this process just wrote, would
    stay invisible. Every listing here must see storage as it is now (commit rule, cleanup, the lease)."""
    import fsspec

    for protocol in ("gs", "gcs"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


_list_object_stores_from_storage()


def is_remote(path: str | os.PathLike) -> bool:
    """True for an object-store URI (`gs://bucket/...`, `s3://...`)."""
    return "://" in os.fspath(path)


def resolve(path: str | os.PathLike) -> epath.Path:
    """An absolute local path (cwd-relative, `~` expanded) or the remote URI unchanged."""
    text = os.fspath(path)
    if is_remote(text):
        return epath.Path(text)
    return epath.Path(os.path.abspath(os.path.expanduser(text)))


def resolve_input(path: str | os.PathLike) -> epath.Path:
    """Like `resolve`; a relative path missing from the working directory falls back to the repository."""
    text = os.fspath(path)
    resolved = resolve(text)
    if is_remote(text) or os.path.isabs(os.path.expanduser(text)) or resolved.exists():
        return resolved
    bundled = epath.Path(REPO_ROOT / text)
    return bundled if bundled.exists() else resolved


def looked_at(path: str) -> str:
    """Where `resolve_input` looked for `path`, for error messages."""
    first = str(resolve(path))
    if is_remote(path) or os.path.isabs(os.path.expanduser(path)):
        return first
    return f"{first} and {REPO_ROOT / path}"


def _split_glob(pattern: str) -> tuple[str, str]:
    """('gs://b/data', '*.arrayrecord'): the longest prefix without wildcards, and the rest."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if _GLOB_CHARS & set(part):
            return "/".join(parts[:i]), "/".join(parts[i:])
    return pattern, ""


def glob(pattern: str) -> list[epath.Path]:
    """Files matching one glob (sorted), local or remote; a pattern without wildcards matches itself, or
    the files inside it when it names a directory."""
    if not _GLOB_CHARS & set(pattern) and resolve_input(pattern).is_dir():
        return glob(pattern.rstrip("/") + "/*")
    if not is_remote(pattern):
        local = os.path.expanduser(pattern)
        matches = sorted(globlib.glob(local, recursive=True))
        if not matches and not os.path.isabs(local):
            matches = sorted(globlib.glob(str(REPO_ROOT / local), recursive=True))
        return [epath.Path(os.path.abspath(m)) for m in matches if os.path.isfile(m)]
    root, rest = _split_glob(pattern)
    if not rest:
        p = epath.Path(pattern)
        return [p] if p.is_file() else []
    root_path = epath.Path(root)
    if not root_path.exists():
        return []
    return sorted((p for p in root_path.glob(rest) if p.is_file()), key=str)


def expand_globs(patterns: str) -> list[tuple[str, list[epath.Path]]]:
    """Each comma-separated glob with its matches, in order (an empty list names a glob matching nothing)."""
    return [(part, glob(part)) for part in (p.strip() for p in patterns.split(",")) if part]


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRAINER_CACHE_DIR", "~/.cache/elastic-trainer")).expanduser()


def local_copy(path: epath.Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local file with `path`'s bytes: the file itself if local, else a cached copy (kept while size
    matches; written aside and renamed, so a killed download never leaves a short file behind)."""
    if not is_remote(path):
        return Path(os.fspath(path))
    root = Path(os.path.expanduser(os.fspath(cache_dir))) if cache_dir else default_cache_dir() / "remote"
    digest = hashlib.sha256(os.fspath(path).encode()).hexdigest()[:16]
    dest = root / digest / path.name
    size = path.stat().length
    if dest.is_file() and dest.stat().st_size == size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    with path.open("rb") as src, open(tmp, "wb") as out:
        while chunk := src.read(1 << 22):
            out.write(chunk)
    os.replace(tmp, dest)
    log.info(
        "copied %s to %s (%d bytes)",
        path,
        dest,
        size,
        extra=event_extra("remote_copy", {"src": str(path), "dest": str(dest), "bytes": size}),
    )
    return dest
