"""Where a conversion may write: an output path checked before any heavy work.

Every command of `python -m trainer.convert` checks its output first, so a conversion that cannot
finish (output exists, is remote, would replace an input, or cannot be written) fails in a second, not
after reading the model; `trainer.io.staging` then writes it aside and swaps it in.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainer.errors import UserInputError
from trainer.io.paths import is_remote, resolve
from trainer.io.staging import check_writable


def check_output(path, *, overwrite: bool, flag: str, inputs=()) -> Path:
    """The resolved local output path, refused before any heavy work when it cannot be written: it exists
    (without --overwrite), it would replace one of `inputs`, it is remote, or its nearest existing
    ancestor is a file or not writable. staged_dir / staged_file write it later (aside, then swapped)."""
    if is_remote(path):
        raise UserInputError(
            f"{flag} {path}: outputs are written to local disk; write them locally, then copy "
            f"them up (e.g. `gcloud storage cp -r`)"
        )
    dest = Path(os.fspath(resolve(path)))
    for src in inputs:
        if src is not None and not is_remote(src):
            src = Path(os.fspath(resolve(src)))
            if src == dest or dest in src.parents:
                raise UserInputError(f"{flag} {dest} would replace the input {src}; choose another output")
    return check_writable(dest, overwrite=overwrite, name=flag)
