"""The one commit rule, and the directory scans built on it.

A checkpoint directory counts only once Orbax has finalized it. Orbax (>= 0.12.3) ends every save by
writing `commit_success.txt`: on POSIX into `<step>.orbax-checkpoint-tmp` just before the atomic rename
to `<step>`, on object stores (gs://) into `<step>` itself, which has no rename. So on every
filesystem "finalized" is the same test, `is_committed` below. Everything else in the checkpoints
directory that looks like a step is partial: an `<step>.orbax-checkpoint-tmp*` directory left by a
killed save, or a `<step>` directory without the marker (an object-store save that never finished, or
an interrupted copy). A `<step>.unreadable-<time>` directory is neither: a committed step that failed to
restore, moved aside by the checkpointer and kept for inspection. Paths go through etils.epath, so
local and gs:// paths work alike.

Only this trainer's own unfinished writes are ever removed: Orbax's tmp directories, and a marker-less
`<step>` directory that has this trainer's in-flight marker `<step>.saving` beside it (written before
the save starts, removed once it is committed). A marker-less `<step>` without one was written by
something else (a tool, another Orbax layout): it is left alone and reported (`foreign_step_paths`).
"""

from __future__ import annotations

import re

import orbax.checkpoint as ocp
from etils import epath

COMMIT_MARKER = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE  # "commit_success.txt"
TMP_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp"
UNREADABLE_SUFFIX = ".unreadable-"  # <step>.unreadable-<unix time>: a committed step that failed to read
SAVING_SUFFIX = ".saving"  # <step>.saving: this trainer is writing <step> (removed once committed)
_STEP_DIR = re.compile(r"(\d+)")
_SAVING = re.compile(r"(\d+)" + re.escape(SAVING_SUFFIX))
_UNREADABLE = re.compile(r"(\d+)" + re.escape(UNREADABLE_SUFFIX) + r"\d+")
_TMP_STEP_DIR = re.compile(r"(\d+)" + re.escape(TMP_SUFFIX) + r".*")


def _require_orbax_with_commit_marker() -> None:
    # Orbax < 0.12.3 renamed POSIX saves without writing the marker: its finished checkpoints would
    # look partial here and cleanup_partial would delete them. Fail loudly instead.
    version = tuple(int(p) for p in re.findall(r"\d+", ocp.__version__)[:3])
    if version < (0, 12, 3):
        raise ImportError(
            f"trainer.checkpoint needs orbax-checkpoint >= 0.12.3 (found {ocp.__version__}): "
            f"older versions do not write {COMMIT_MARKER} on POSIX filesystems"
        )


_require_orbax_with_commit_marker()


def is_committed(path: epath.PathLike) -> bool:
    """THE commit rule: `path` is a finalized Orbax checkpoint (not a tmp dir, and holds the marker)."""
    path = epath.Path(path)
    return TMP_SUFFIX not in path.name and (path / COMMIT_MARKER).exists()


def step_dir(root: epath.PathLike, step: int) -> epath.Path:
    """Where step `step` lives (Orbax's default step naming: the bare number)."""
    return epath.Path(root) / str(step)


def committed_steps(root: epath.PathLike) -> list[int]:
    """Committed steps under `root`, ascending; read from storage on every call (none if `root` is not a
    directory: a save there fails and says so)."""
    root = epath.Path(root)
    if not root.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and is_committed(p)
    )


def saving_marker(root: epath.PathLike, step: int) -> epath.Path:
    """This trainer's in-flight marker of `step`: written before its save starts, removed once committed."""
    return epath.Path(root) / f"{step}{SAVING_SUFFIX}"


def _entries(root: epath.Path) -> list[epath.Path]:
    return list(root.iterdir()) if root.is_dir() else []


def partial_step_paths(root: epath.PathLike) -> list[tuple[int, epath.Path]]:
    """(step, path) of this trainer's own unfinished writes under `root`, by step: Orbax tmp directories,
    marker-less step directories whose in-flight marker says this trainer was writing them, and markers
    left without a write in progress (the marker goes last, so its step dir is removed first)."""
    root = epath.Path(root)
    entries = _entries(root)
    names = {p.name for p in entries}
    found = []
    for p in entries:
        if m := _TMP_STEP_DIR.fullmatch(p.name):
            found.append((int(m.group(1)), p))
        elif (m := _STEP_DIR.fullmatch(p.name)) and f"{p.name}{SAVING_SUFFIX}" in names and not is_committed(p):
            found.append((int(m.group(1)), p))
        elif m := _SAVING.fullmatch(p.name):
            found.append((int(m.group(1)), p))
    return sorted(found, key=lambda sp: (sp[0], sp[1].name.endswith(SAVING_SUFFIX), sp[1].name))


def foreign_step_paths(root: epath.PathLike) -> list[epath.Path]:
    """Step directories under `root` that are neither committed nor this trainer's unfinished writes
    (finished checkpoints of another tool or layout, copies in progress): never removed here."""
    root = epath.Path(root)
    entries = _entries(root)
    names = {p.name for p in entries}
    return sorted(
        (
            p
            for p in entries
            if _STEP_DIR.fullmatch(p.name) and f"{p.name}{SAVING_SUFFIX}" not in names and not is_committed(p)
        ),
        key=lambda p: int(p.name),
    )


def set_aside_paths(root: epath.PathLike) -> list[epath.Path]:
    """Committed steps moved aside as corrupt (`<step>.unreadable-<time>`), oldest step first."""
    return sorted(
        (p for p in _entries(epath.Path(root)) if _UNREADABLE.fullmatch(p.name)),
        key=lambda p: (int(p.name.split(".")[0]), p.name),
    )
