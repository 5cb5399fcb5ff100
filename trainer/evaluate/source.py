"""Which checkpoint an evaluation reads, and what it was trained with.

RUN_DIR_OR_CHECKPOINT is a run directory (its newest committed checkpoint is evaluated), a committed step
directory `<run>/checkpoints/<step>`, or an hf-to-trainer output. The model, the tokenizer
(tokenizer_path, tokenizer_type, add_bos) and the sharding rules come from the config the checkpoint
records (trainer/hf/checkpoints.py, the same source `trainer.convert` reads), so nothing about the model
is given twice. Every problem with the path is a UserInputError naming it and what to point at instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainer.errors import UserInputError

FLAG = "RUN_DIR_OR_CHECKPOINT"


@dataclasses.dataclass(frozen=True)
class Source:
    """A committed checkpoint and the sections of the config it was trained with."""

    checkpoint: Path
    model: object  # ModelConfig
    data: object  # DataConfig: tokenizer_path, tokenizer_type, add_bos, max_target_length
    mesh: object  # MeshConfig: the ici axes and logical_axis_rules of the run


def checkpoint_dir(path) -> Path:
    """The committed checkpoint `path` names: the path itself, or a run directory's newest committed step."""
    from trainer.checkpoint import commit
    from trainer.checkpoint.checks import check_checkpoint_dir
    from trainer.io.paths import resolve

    where = resolve(path)
    if not commit.is_committed(where) and (where / "checkpoints").is_dir():
        steps = commit.committed_steps(where / "checkpoints")
        if not steps:
            raise UserInputError(
                f"{FLAG} {where} is a run directory without a committed checkpoint yet; let it train past "
                f"a checkpoint (checkpoint_period) or point at another run"
            )
        return Path(str(commit.step_dir(where / "checkpoints", steps[-1])))
    return Path(str(check_checkpoint_dir(where, flag=FLAG)))


def open_source(path, model: str | None = None) -> Source:
    """The checkpoint `path` names and its recorded config (or base.yml with `model`, --model, for a
    checkpoint that records none), checked against the stored shapes (no array is read): a config that
    does not describe the params is said before any compile."""
    from trainer.checkpoint.checks import check_params_match
    from trainer.hf.checkpoints import MODEL_FIX, RECORDED_FIX, checkpoint_sections

    ckpt = checkpoint_dir(path)
    model_cfg, data, mesh = checkpoint_sections(ckpt, model)
    check_params_match(ckpt, model_cfg, fix=MODEL_FIX if model else RECORDED_FIX, flag=FLAG)
    return Source(ckpt, model_cfg, data, mesh)
