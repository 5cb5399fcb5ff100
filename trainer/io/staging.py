"""Check inputs, then write aside, then swap: a failed tool run never destroys or half-writes an output.

Tools that produce a directory or a file (data preparation, tokenizer training, conversion) write into
a hidden sibling first and move it into place only once everything succeeded. An existing output is
replaced only then (and only with overwrite); on any failure the sibling is removed and the old output
is untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


class OutputExists(FileExistsError):
    """The output exists and overwrite was not asked for."""


def check_writable(dest: str | os.PathLike, *, overwrite: bool, flag: str = "--overwrite", name: str = "") -> Path:
    """Refuse up front (before any work) an output that cannot be written: it exists (naming the flag
    that allows replacing it), or its nearest existing ancestor is a file or not writable. `name` is
    how the message names the output (e.g. the option that gave it)."""
    from trainer.errors import UserInputError

    dest = Path(dest).expanduser()
    label = f"{name} {dest}" if name else str(dest)
    if dest.exists() and not overwrite:
        raise UserInputError(f"{label} already exists; pass {flag} to replace it, or choose another output")
    parent = dest.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserInputError(f"{label}: {parent} is a file, not a directory; choose another output")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserInputError(f"{label}: {parent} is not writable; choose another output")
    return dest


def _make_parents(dest: Path) -> list[Path]:
    """Create dest's missing parent folders; return them deepest first, so a failure can remove them."""
    created, parent = [], dest.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    dest.parent.mkdir(parents=True, exist_ok=True)
    return created


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def _aside(dest: Path, tag: str) -> Path:
    return dest.with_name(f".{dest.name}.{tag}-{uuid.uuid4().hex[:8]}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def _staged(dest: str | os.PathLike, *, overwrite: bool, directory: bool) -> Iterator[Path]:
    dest = check_writable(dest, overwrite=overwrite)
    parents = _make_parents(dest)
    tmp = _aside(dest, "staging")
    if directory:
        tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        _remove_empty(parents)
        raise
    _swap(tmp, dest)


def staged_dir(dest: str | os.PathLike, *, overwrite: bool = False) -> contextlib.AbstractContextManager[Path]:
    """Yield an empty directory beside `dest`; on success it becomes `dest` (replacing the old one). On
    failure nothing is left: not the staging directory, nor parent folders made for it."""
    return _staged(dest, overwrite=overwrite, directory=True)


def staged_file(dest: str | os.PathLike, *, overwrite: bool = False) -> contextlib.AbstractContextManager[Path]:
    """Yield a path beside `dest` to write; on success it is renamed onto `dest`. On failure nothing is
    left, as for staged_dir."""
    return _staged(dest, overwrite=overwrite, directory=False)


def _swap(tmp: Path, dest: Path) -> None:
    if not dest.exists():
        os.replace(tmp, dest)
        return
    old = _aside(dest, "old")
    os.replace(dest, old)
    os.replace(tmp, dest)
    _remove(old)
