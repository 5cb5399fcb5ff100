"""Checkpoints: plain Orbax, one directory per committed step, readable with orbax.checkpoint alone.

Layout of `<run dir>/checkpoints/` (a local path or gs://...)::

    checkpoints/
      300/                         a committed step (Orbax CompositeCheckpointHandler)
        commit_success.txt         written last: the step counts only if this is here
        _CHECKPOINT_METADATA       Orbax step metadata (timestamps)
        state/                     the train state {"step", "params", "opt_state"}: PyTree/OCDBT item
        data/metadata              the data-iterator state: JSON item
        metadata/metadata          resolved config, mesh shape, batch plan: JSON item
      400.orbax-checkpoint-tmp/    a save in progress, or left by a killed one: partial

A params-only checkpoint (`save_parameters`) is the same minus `data/` and `metadata/`, with
`state/` holding {"params": ...} only.

Reading a step without this package::

    import orbax.checkpoint as ocp
    with ocp.CheckpointManager("runs/NAME/checkpoints") as mngr:
        out = mngr.restore(300, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                        data=ocp.args.JsonRestore(),
                                                        metadata=ocp.args.JsonRestore()))
    # or one item: ocp.StandardCheckpointer().restore("runs/NAME/checkpoints/300/state", abstract_state)

"Committed" is defined once, in `commit.is_committed`.
"""

from trainer.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointRestoreError,
    CheckpointSaveError,
    NoCheckpoints,
    RestoredStep,
    open_checkpointer,
)
from trainer.checkpoint.commit import is_committed
from trainer.checkpoint.params import load_full_state, load_parameters, save_parameters

__all__ = [
    "Checkpointer",
    "NoCheckpoints",
    "open_checkpointer",
    "RestoredStep",
    "CheckpointSaveError",
    "CheckpointRestoreError",
    "is_committed",
    "load_parameters",
    "load_full_state",
    "save_parameters",
]
