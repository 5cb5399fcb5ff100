"""Does a saved step fit the train state this config builds? Answered from metadata, before compiling.

A config change that alters the train state's structure (gradient clipping adds an optimizer state,
another model size changes shapes, another dtype) makes every saved step unrestorable by this config.
That is not a broken checkpoint: the run is intact and the config is what changed. So the mismatch is
found before any compile, from what the step records about itself (Orbax's tree metadata, or a local
step's manifest), and reported once: the leaves that differ, the config keys that explain them (found
by trying the step's own value of each changed key), and the ways forward. Nothing on storage changes.

Signatures are {leaf path: (shape, dtype)}. Orbax stores a tree in its serialized layout (tuples as
lists, named tuples as dicts); a local step records the live tree's key paths; `signature` builds
either from the abstract state, so both compare like with like. This module compares; what a whole
config explains of a difference is `trainer.preflight`'s part.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
from etils import epath

from trainer.errors import UserInputError

log = logging.getLogger(__name__)

_SHOWN = 3  # example leaves per kind of difference


class CheckpointMismatch(UserInputError):
    """A saved step of this run does not fit the state this config builds (exit 2, nothing changed)."""


Signature = dict[str, tuple[tuple[int, ...], str]]


def signature(tree, *, orbax_layout: bool) -> Signature:
    """{path: (shape, dtype)} of `tree`'s leaves; `orbax_layout`: the paths Orbax stores the tree under."""
    if orbax_layout:
        import orbax.checkpoint as ocp

        tree = ocp.tree.serialize_tree(tree, keep_empty_nodes=True)
    return {
        jax.tree_util.keystr(path): (tuple(int(d) for d in leaf.shape), str(jnp.dtype(leaf.dtype)))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def stored_orbax_signature(step_dir: epath.PathLike) -> Signature | None:
    """The state item's signature from its stored layout (no array read, and no JAX backend: a process of
    a multi-process job reads it before joining the job); None when it cannot be read."""
    from trainer.io.orbax_internals import orbax_stored_arrays

    try:
        arrays = orbax_stored_arrays(epath.Path(step_dir) / "state")
    except Exception as e:  # noqa: BLE001 - unreadable metadata is for the restore's verification to judge
        log.debug("no state metadata in %s: %s", step_dir, e)
        return None
    return {
        "".join(f"[{key}]" if kind == 1 else f"[{key!r}]" for key, kind in path): (shape, str(jnp.dtype(dtype)))
        for path, (shape, dtype) in arrays.items()
    } or None


def stored_local_signature(manifest: dict) -> Signature:
    return {e["path"]: (tuple(e["shape"]), str(jnp.dtype(e["dtype"]))) for e in manifest.get("leaves", [])}


def display(path: str) -> str:
    """`['opt_state'][1][0].mu['embed']` -> `opt_state/1/0/mu/embed`."""
    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", path)
    return "/".join(next(p for p in part if p) for part in parts) or path


def leaf_differences(expected: Signature, stored: Signature) -> list[str]:
    """Human lines, one per top-level item that differs: leaves only in the step, only in the config, and
    leaves whose shape or dtype differ (a few examples each, with counts)."""
    out = []
    items = sorted({display(p).split("/")[0] for p in {*expected, *stored}})
    for item in items:

        def of(sig, item=item):
            return {p: v for p, v in sig.items() if display(p).split("/")[0] == item}

        want, have = of(expected), of(stored)
        only_saved = [p for p in have if p not in want]
        only_config = [p for p in want if p not in have]
        changed = [p for p in want if p in have and want[p] != have[p]]
        parts = []
        if only_saved:
            parts.append(f"{len(only_saved)} leaves only in the checkpoint ({_examples(only_saved)})")
        if only_config:
            parts.append(f"{len(only_config)} only in this config ({_examples(only_config)})")
        if changed:
            shown = ", ".join(
                f"{display(p)} {_fmt(have[p])} in the checkpoint, {_fmt(want[p])} in this config"
                for p in changed[:_SHOWN]
            )
            more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
            parts.append(f"{len(changed)} differ ({shown}{more})")
        if parts:
            out.append(f"{item}: " + ", ".join(parts))
    return out


def _examples(paths: list[str]) -> str:
    shown = ", ".join(display(p) for p in paths[:_SHOWN])
    return shown + (", ..." if len(paths) > _SHOWN else "")


def _fmt(sd: tuple) -> str:
    return f"{sd[1]}{list(sd[0])}"


def expected_data_kind(data_cfg) -> tuple[str, int | None]:
    """(kind, version) of the data-iterator state the configured dataset writes."""
    if data_cfg.dataset_type == "synthetic":
        return "synthetic", None
    from trainer.data.grain_pipeline import STATE_KIND, STATE_VERSION

    return STATE_KIND, STATE_VERSION


def data_state_differences(data_cfg, stored: dict | None) -> list[str]:
    """What makes the saved data-iterator state unusable by this config's dataset (kind, version,
    shuffle seed); record counts and mixtures are checked when the iterator is built."""
    if not isinstance(stored, dict) or "kind" not in stored:
        return []
    kind, version = expected_data_kind(data_cfg)
    if stored["kind"] != kind:
        return [
            f"data: the checkpoint's iterator state is {stored['kind']!r}, this config's dataset writes {kind!r}"
        ]
    if version is not None and stored.get("version") != version:
        return [
            f"data: the checkpoint's iterator state is version {stored.get('version')}, this trainer's {version}"
        ]
    seed = stored.get("data_shuffle_seed")
    if version is not None and seed is not None and seed != data_cfg.data_shuffle_seed:
        return [
            f"data: the checkpoint's data order used data_shuffle_seed={seed}, "
            f"this config {data_cfg.data_shuffle_seed}"
        ]
    return []


@dataclasses.dataclass(frozen=True)
class SavedStep:
    """What a saved step says about itself, for the check (any field may be missing: None)."""

    where: str  # "checkpoints/6" or "local tier step 8", for messages
    state: Signature | None
    orbax_layout: bool
    config: dict | None  # the flat config it was saved with
    data_state: dict | None
    load_hint: str | None  # a path load_parameters_path can take to start a new run from its params
    lora_base: dict | None = None  # a LoRA run's base identity (trainer.checkpoint.base_identity)
