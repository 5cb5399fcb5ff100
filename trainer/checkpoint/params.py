"""Starting a new run from an existing checkpoint: params only, or the full train state.

A params-only checkpoint (`save_parameters`, later the HF import) has the step-directory layout with
only a `state` item holding {"params": ...}, so both kinds load through the same code, from the path
of a committed directory: `<run>/checkpoints/<step>` or the params-only directory itself.
"""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from trainer.checkpoint import commit
from trainer.checkpoint.checkpointer import STATE


def _state_item(path: epath.PathLike) -> epath.Path:
    from trainer.io.paths import resolve

    path = resolve(path)
    if not commit.is_committed(path):
        why = (
            "an unfinished save's temporary directory"
            if commit.TMP_SUFFIX in path.name
            else f"no {commit.COMMIT_MARKER}"
        )
        raise FileNotFoundError(
            f"{path} is not a committed checkpoint directory ({why}; "
            f"point at <run>/checkpoints/<step> or a save_parameters directory)"
        )
    return path / STATE


def save_parameters(path: epath.PathLike, params, *, in_place: bool = False) -> None:
    """Write `params` as a params-only checkpoint at `path` (which must not exist); blocks until committed.

    in_place=True is for numpy params that nothing touches during the save (a checkpoint conversion):
    Orbax then writes them as they are, uncompressed, instead of first copying every array (and holding
    zstd buffers), so the save adds next to nothing to peak host memory; the default save adds about
    one more copy of the params. Both load alike."""
    from trainer.io.paths import resolve

    path = resolve(path)
    if in_place:
        registry = ocp.type_handlers.create_type_handler_registry(
            (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False))
        )
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False)
        item = ocp.args.PyTreeSave({"params": params})
    else:
        handler, item = ocp.StandardCheckpointHandler(), ocp.args.StandardSave({"params": params})
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**{STATE: handler})) as checkpointer:
        checkpointer.save(path, args=ocp.args.Composite(**{STATE: item}))


def load_parameters(path: epath.PathLike, abstract_params):
    """The params of the checkpoint at `path` (full or params-only), resharded onto `abstract_params`'
    shardings; any optimizer state there is not read."""
    target = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(_state_item(path), args=args)["params"]


def load_full_state(path: epath.PathLike, abstract_state):
    """The full train state of the checkpoint step directory at `path`, on `abstract_state`'s shardings."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(_state_item(path), abstract_state)
