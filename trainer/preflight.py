"""Every input a run needs, checked before any device work: a problem exits 2 before compiling.

- A run directory that already has a committed checkpoint is resumed; its model must have the shape
  this config asks for (else: name a new run_name, or drop the changed keys).
- Otherwise `load_full_state_path` / `load_parameters_path` must be a committed checkpoint whose
  parameter shapes match the model.
- `dataset_type=arrayrecord` needs shards that exist and a tokenizer that loads and fits the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from etils import epath

from trainer.config.errors import ConfigError
from trainer.config.schema import RunConfig

log = logging.getLogger(__name__)
# Model keys that change the shape or structure of the parameters (and so of a checkpoint).
SHAPE_KEYS = (
    "base_num_decoder_layers",
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "head_dim",
    "base_mlp_dim",
    "vocab_size",
    "num_experts",
    "base_moe_mlp_dim",
    "logits_via_embedding",
    "use_qk_norm",
    "scan_layers",
    "weight_dtype",
)


@dataclasses.dataclass(frozen=True)
class Preflight:
    resume_step: int | None  # newest committed step of this run, if it has one


def _saved_model(step_dir: epath.Path) -> dict | None:
    path = step_dir / "metadata" / "metadata"
    try:
        return json.loads(path.read_text()).get("config")
    except Exception:  # noqa: BLE001 - an older or foreign checkpoint: nothing to compare
        return None


def resumed_shape_problems(cfg: RunConfig, saved: dict | None, *, where: str) -> list[str]:
    """Differences in shape-defining model keys between the saved run config `saved` and `cfg`."""
    if not saved:
        return []
    given = dataclasses.asdict(cfg.model)
    diffs = [
        f"{k}: checkpoint {saved[k]!r}, config {given[k]!r}"
        for k in SHAPE_KEYS
        if k in saved and saved[k] != given[k]
    ]
    if not diffs:
        return []
    return [
        f"the run directory holds a checkpoint ({where}) of another model shape ({'; '.join(diffs)}); "
        "to start a new run give it another run_name=..., or drop the changed keys to resume it"
    ]


def check_load_path(cfg: RunConfig) -> None:
    """The configured load path is a committed checkpoint holding params of this model's shapes
    (raises a UserInputError naming the key)."""
    from trainer.checkpoint.checks import check_checkpoint_dir, check_params_match

    for key in ("load_full_state_path", "load_parameters_path"):
        given = getattr(cfg.checkpoint, key)
        if given:
            path = check_checkpoint_dir(given, flag=key)
            check_params_match(
                path,
                cfg.model,
                flag=key,
                fix="use the model it was saved with (a converted model: model=<dir>/model.yml)",
            )


def data_problems(cfg: RunConfig) -> None:
    """Shards and tokenizer (raises DataError, which the CLI reports with exit 2)."""
    if cfg.data.dataset_type != "arrayrecord":
        return
    from trainer.data.grain_pipeline import load_tokenizer, resolve_files
    from trainer.data.mixture import parse_mixture

    for source in parse_mixture(cfg.data.grain_train_files):
        resolve_files(source.pattern)
    load_tokenizer(cfg.data, cfg.model.vocab_size)
    if cfg.eval.eval_interval > 0:
        from trainer.data.errors import DataError

        try:
            resolve_files(cfg.eval.grain_eval_files)
        except DataError as e:
            raise DataError(f"grain_eval_files={cfg.eval.grain_eval_files!r}: {e}") from None


def observe_problems(cfg: RunConfig) -> None:
    """enable_wandb needs the optional wandb package (raises ConfigError naming the key and the fix)."""
    from trainer.observe import wandb_sink

    if cfg.observe.enable_wandb and not wandb_sink.available():
        raise ConfigError(f"enable_wandb=true but the wandb package is not installed: {wandb_sink.INSTALL_HINT}")


def check(cfg: RunConfig, checkpoints: epath.Path, *, local_checkpoints: epath.Path | None = None) -> Preflight:
    """Raise a UserInputError (ConfigError, DataError, ...) naming an unusable input; say where the run
    starts from (the newest committed step of the persistent or the local checkpoint tier)."""
    from trainer.checkpoint import commit, local_store

    candidates = []  # (newest step, its directory, the model config saved with it)
    if cfg.checkpoint.enable_checkpointing:
        steps = commit.committed_steps(checkpoints)
        if steps:
            candidates.append((steps[-1], checkpoints, _saved_model(commit.step_dir(checkpoints, steps[-1]))))
    if local_checkpoints is not None:
        steps = local_store.committed_steps(local_checkpoints)
        if steps:
            candidates.append(
                (steps[-1], local_checkpoints, local_store.saved_config(local_checkpoints, steps[-1]))
            )
    resume, root, saved = max(candidates, key=lambda c: c[0]) if candidates else (None, None, None)
    if resume is not None:
        problems = resumed_shape_problems(cfg, saved, where=f"{root}, step {resume}")
        if problems:
            raise ConfigError("cannot resume: " + "; ".join(problems))
    else:
        check_load_path(cfg)
    data_problems(cfg)
    observe_problems(cfg)
    return Preflight(resume_step=resume)
