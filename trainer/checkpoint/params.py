"""Starting a new run from an existing checkpoint: params only, or the full train state.

A params-only checkpoint (`save_parameters`, later the HF import) has the step-directory layout with
only a `state` item holding {"params": ...}, so both kinds load through the same code, from the path
of a committed directory: `<run>/checkpoints/<step>` or the params-only directory itself.
"""
from __future__ import annotations

from etils import epath
import orbax.checkpoint as ocp

from trainer.checkpoint import commit
from trainer.checkpoint.checkpointer import STATE


def _state_item(path: epath.PathLike) -> epath.Path:
    path = epath.Path(path)
    if not commit.is_committed(path):
        raise FileNotFoundError(f"{path} is not a committed checkpoint directory (no {commit.COMMIT_MARKER}; "
                                f"point at <run>/checkpoints/<step> or a save_parameters directory)")
    return path / STATE


def save_parameters(path: epath.PathLike, params) -> None:
    """Write `params` as a params-only checkpoint at `path` (which must not exist); blocks until committed."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(epath.Path(path), args=ocp.args.Composite(
            **{STATE: ocp.args.StandardSave({"params": params})}))


def load_parameters(path: epath.PathLike, abstract_params):
    """The params of the checkpoint at `path` (full or params-only), resharded onto `abstract_params`'
    shardings; any optimizer state there is not read."""
    target = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=True)
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(_state_item(path), args=args)["params"]


def load_full_state(path: epath.PathLike, abstract_state):
    """The full train state of the checkpoint step directory at `path`, on `abstract_state`'s shardings."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(_state_item(path), abstract_state)
