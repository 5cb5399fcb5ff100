"""Checks on a checkpoint before anything restores it, so a wrong path or model says what is wrong.

Orbax, given a run directory or a model of another size, fails mid-restore with a traceback (and
suggests `strict=False`, i.e. silently truncating weights). These checks read only the directory and
Orbax's metadata: `check_checkpoint_dir` says what a path is instead of a committed checkpoint and
where the checkpoints are; `check_params_match` names the first tensor whose stored shape differs from
the model config. The trainer's preflight, `trainer.convert` and `trainer.decode` all use them.
"""

from __future__ import annotations

import logging
import re

from etils import epath

from trainer.errors import UserInputError
from trainer.io.paths import resolve

log = logging.getLogger(__name__)


class MissingCheckpoint(UserInputError, FileNotFoundError):
    """The path does not exist (still a FileNotFoundError for callers that catch that)."""


def check_checkpoint_dir(path, flag: str = "--checkpoint") -> epath.Path:
    """The resolved committed checkpoint directory `path`, or an error saying what `path` is instead and
    where the checkpoints are: missing, a run directory, a run's checkpoints/ directory, a step whose save
    never finished, or a Hugging Face directory. Checked before the model config is looked for, so the
    user hears "this is a run directory" rather than "cannot tell the model config"."""
    from trainer.checkpoint import commit

    path = resolve(path)
    if commit.is_committed(path):
        return path
    if not path.exists():
        raise MissingCheckpoint(f"{flag} {path} does not exist{_steps_hint(path.parent, 'in')}")
    if not path.is_dir():
        raise UserInputError(
            f"{flag} {path} is a file; point {flag} at a checkpoint directory "
            f"(<run>/checkpoints/<step>, or an hf-to-trainer output)"
        )
    if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").exists() or (path / "events.jsonl").exists():
        raise UserInputError(
            f"{flag} {path} is a run directory: point {flag} at {path / 'checkpoints'}/<step>"
            f"{_steps_hint(path / 'checkpoints', 'committed')}"
        )
    if path.name == "checkpoints" or commit.committed_steps(path):
        raise UserInputError(
            f"{flag} {path} is a run's checkpoints directory: point {flag} at {path}/<step>"
            f"{_steps_hint(path, 'committed')}"
        )
    if re.fullmatch(r"\d+", path.name) or commit.TMP_SUFFIX in path.name:
        raise UserInputError(
            f"{flag} {path} is not a committed checkpoint (no {commit.COMMIT_MARKER}: its save "
            f"did not finish){_steps_hint(path.parent, 'in')}"
        )
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        raise UserInputError(
            f"{flag} {path} is a Hugging Face directory, not a checkpoint of this trainer: "
            f"import it with `hf-to-trainer --hf-dir {path}` (or pass it as --hf-dir to logits)"
        )
    raise UserInputError(
        f"{flag} {path} is not a checkpoint (no {commit.COMMIT_MARKER}): point it at "
        f"<run>/checkpoints/<step> or an hf-to-trainer output"
    )


def _steps_hint(root: epath.Path, how: str) -> str:
    """'; committed steps in R: 50, 100' (the newest 8), for an error that should say what exists."""
    from trainer.checkpoint import commit

    try:
        steps = commit.committed_steps(root)
    except OSError:
        steps = []
    if how == "committed" and not steps:
        return " (it has no committed checkpoint yet)"
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[-8:]))
    more = f" (and {len(steps) - 8} older)" if len(steps) > 8 else ""
    return f"; committed steps in {root}: {shown}{more}"


def check_params_match(ckpt, cfg, *, fix: str, flag: str = "--checkpoint") -> None:
    """Compare the stored params' shapes (Orbax metadata, no array read) with what `cfg` builds, and name
    the first tensor that differs: otherwise Orbax fails mid-restore with a traceback that suggests
    `strict=False`, i.e. silently truncating or padding the weights, which is never what a user wants."""
    stored = _stored_param_shapes(resolve(ckpt))
    if stored is None:  # metadata unreadable: load_checkpoint_params still maps a restore mismatch
        return
    from trainer.model import abstract_params

    wanted = _shapes(abstract_params(cfg))
    diffs = [
        f"{name} is {list(stored[name])} in the checkpoint but {list(shape)} in the model config"
        if name in stored
        else f"{name} {list(shape)} is missing from the checkpoint"
        for name, shape in wanted.items()
        if stored.get(name) != shape
    ]
    if diffs:
        more = f" (and {len(diffs) - 1} more tensors differ)" if len(diffs) > 1 else ""
        raise UserInputError(f"{flag} {resolve(ckpt)} does not match the model config: {diffs[0]}{more}; {fix}")


def _stored_param_shapes(ckpt: epath.Path) -> dict[str, tuple[int, ...]] | None:
    """{'layers/mlp/down_proj': shape} of the stored params, read as the preflight reads a saved step
    (`compat.stored_orbax_signature`: no array read, no JAX backend); None when it cannot be read."""
    from trainer.checkpoint.compat import display, stored_orbax_signature

    stored = stored_orbax_signature(ckpt)
    if stored is None:  # an optional pre-check; the restore checks shapes too
        return None
    return {
        display(path).removeprefix("params/"): shape
        for path, (shape, _) in stored.items()
        if display(path).startswith("params/")
    }


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """{'layers/mlp/down_proj': shape} of a nested dict of arrays / shape structs / Orbax metadata."""
    out = {}
    for key in sorted(tree):
        if isinstance(tree[key], dict):
            out.update({f"{key}/{k}": v for k, v in _shapes(tree[key]).items()})
        else:
            out[str(key)] = tuple(getattr(tree[key], "shape", ()) or ())
    return out
