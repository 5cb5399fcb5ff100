"""Every input a run needs, checked before any device work: a problem exits 2 before compiling.

- A run directory that already has a saved step (persistent or local tier) is resumed; the newest step
  of each tier must fit the train state this config builds (`trainer.checkpoint.compat`: the differing
  leaves, the config keys that explain them and the ways forward; nothing changes on storage).
- A run directory whose checkpoints hold steps but none committed and usable (set aside as corrupt, or
  written by another tool) is never started over: the user decides.
- A configured `load_full_state_path` / `load_parameters_path` must exist whatever the run holds; when
  the run starts from it, it must be a committed checkpoint whose parameter shapes match the model;
  when the run resumes instead, the path is reported as not used.
- `dataset_type=arrayrecord` needs shards that exist and a tokenizer that loads and fits the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from etils import epath

from trainer.checkpoint import base_identity, compat
from trainer.config.errors import ConfigError
from trainer.config.schema import RunConfig
from trainer.errors import UserInputError

log = logging.getLogger(__name__)
LOAD_KEYS = ("load_full_state_path", "load_parameters_path")


@dataclasses.dataclass(frozen=True)
class Preflight:
    resume_step: int | None  # newest saved step of this run (either tier), if it has one
    unused_load_paths: tuple[str, ...] = ()  # "load_parameters_path=..." given, but the run resumes


def _read_json(path: epath.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except Exception:  # noqa: BLE001 - an older or foreign checkpoint: nothing to compare
        return None


def persistent_step(checkpoints: epath.Path, step: int) -> compat.SavedStep:
    """What committed step `step` of the persistent tier records about itself."""
    from trainer.checkpoint import commit

    step_dir = commit.step_dir(checkpoints, step)
    metadata = _read_json(step_dir / "metadata" / "metadata") or {}
    return compat.SavedStep(
        where=str(step_dir),
        state=compat.stored_orbax_signature(step_dir),
        orbax_layout=True,
        config=metadata.get("config"),
        data_state=_read_json(step_dir / "data" / "metadata"),
        load_hint=str(step_dir),
        lora_base=metadata.get(base_identity.RECORD_KEY),
    )


def local_step(root: epath.Path, step: int, load_hint: str | None) -> compat.SavedStep:
    """What committed step `step` of the local tier records about itself (its manifest)."""
    from trainer.checkpoint import local_store

    manifest = local_store.read_manifest(root, step) or {}
    return compat.SavedStep(
        where=f"{root}/{step} (local checkpoint tier)",
        state=compat.stored_local_signature(manifest) or None,
        orbax_layout=False,
        config=manifest.get("config"),
        data_state=manifest.get("data_state"),
        load_hint=load_hint,
        lora_base=manifest.get(base_identity.RECORD_KEY),
    )


def unresumable_steps(checkpoints: epath.Path) -> str | None:
    """A message naming the steps a run directory holds when none of them can be resumed, or None."""
    from trainer.checkpoint import commit

    aside = commit.set_aside_paths(checkpoints)
    foreign = commit.foreign_step_paths(checkpoints)
    if not aside and not foreign:
        return None
    kinds = []
    if aside:
        kinds.append("set aside as corrupt: " + ", ".join(p.name for p in aside))
    if foreign:
        kinds.append("not committed by this trainer: " + ", ".join(p.name for p in foreign))
    return (
        f"{checkpoints} holds steps but none that can be resumed ({'; '.join(kinds)}): the run is not "
        "started over on top of them. Inspect them and delete them to start over, or give this run "
        "another run_name=..."
    )


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
    from trainer.config.mixture import parse_mixture
    from trainer.data.grain_pipeline import load_tokenizer, resolve_files

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


# ---- a resumed run's saved steps against this config ---------------------------------------------

# The config sections whose keys can change the structure of the train state / of the data state.
STATE_SECTIONS = ("model", "optim", "lora")
DATA_SECTIONS = ("data",)


def abstract_state(cfg: RunConfig) -> dict:
    """The train state {"step", "params", "opt_state"} `cfg` builds, as shapes: no mesh."""
    from trainer.program.optim import learning_rate_schedule, make_optimizer
    from trainer.program.state import abstract_train_state, trainable_logical_axes

    schedule = learning_rate_schedule(cfg.optim, steps=cfg.train.steps, lr_scale=1.0)
    optimizer = make_optimizer(cfg.optim, trainable_logical_axes(cfg.model, cfg.lora), schedule=schedule)
    return abstract_train_state(cfg.model, optimizer, cfg.lora)


def describe_mismatch(cfg: RunConfig, saved: compat.SavedStep) -> str | None:
    """None when `saved` fits `cfg`, else the one message: what differs, why, and the ways forward."""
    state_diffs = []
    if saved.state is not None:
        state_diffs = compat.leaf_differences(
            compat.signature(abstract_state(cfg), orbax_layout=saved.orbax_layout), saved.state
        )
    data_diffs = compat.data_state_differences(cfg.data, saved.data_state)
    if not state_diffs and not data_diffs:
        return None
    keys = []
    if saved.config:
        if state_diffs:
            keys += explaining_keys(cfg, saved, STATE_SECTIONS, lambda c: _state_diff_count(c, saved))
        if data_diffs:
            keys += explaining_keys(
                cfg, saved, DATA_SECTIONS, lambda c: len(compat.data_state_differences(c.data, saved.data_state))
            )
    why = (
        "; config keys that explain it: "
        + ", ".join(f"{k} (checkpoint {old!r}, now {new!r})" for k, old, new in keys)
        if keys
        else ""
    )
    revert = " ".join(f"{k}={_arg(old)}" for k, old, _ in keys)
    ways = [
        f"resume it with the checkpoint's values ({revert})"
        if keys
        else "resume it with the config it was saved with"
    ]
    ways.append("or start a new run: another run_name=...")
    if saved.load_hint and saved.lora_base is None:  # a LoRA step holds adapters, not a model to start from
        ways.append(
            f"or start a new run from this run's parameters: run_name=<new> load_parameters_path={saved.load_hint}"
        )
    return (
        f"cannot resume from {saved.where}: the train state this config builds does not match it: "
        + "; ".join(state_diffs + data_diffs)
        + why
        + ". Ways forward: "
        + "; ".join(ways)
        + ". Nothing in the run directory was changed."
    )


def _arg(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _state_diff_count(cfg: RunConfig, saved: compat.SavedStep) -> int:
    expected = compat.signature(abstract_state(cfg), orbax_layout=saved.orbax_layout)
    return sum(1 for p in {*expected, *saved.state} if expected.get(p) != saved.state.get(p))


def explaining_keys(
    cfg: RunConfig, saved: compat.SavedStep, sections: tuple[str, ...], count
) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) of each changed key in `sections` whose saved value, alone, brings
    `count` (differences left under a config) down: the keys that explain the mismatch."""
    from trainer.config.loader import build, to_flat_dict
    from trainer.config.schema import flat_fields

    fields = flat_fields()
    now = to_flat_dict(cfg)
    changed = [
        k
        for k, v in saved.config.items()
        if k in fields and fields[k][0] in sections and _norm(v) != _norm(now.get(k))
    ]
    if not changed:
        return []
    base = count(cfg)
    found = []
    for k in changed:
        try:
            reverted = build({**now, k: saved.config[k]})
            if count(reverted) < base:
                found.append((k, saved.config[k], now[k]))
        except Exception as e:  # noqa: BLE001 - a value this version cannot take explains nothing
            log.debug("config key %s=%r not tried: %s", k, saved.config[k], e)
    return found


def _norm(value):
    return json.loads(json.dumps(value, default=list))


def check_saved_step(cfg: RunConfig, saved: compat.SavedStep) -> None:
    """Raise CheckpointMismatch (exit 2, before compiling) when `saved` does not fit `cfg`: its state's
    structure, or (LoRA) the base its adapters were trained over."""
    message = describe_mismatch(cfg, saved) or base_mismatch(cfg, saved)
    if message is not None:
        raise compat.CheckpointMismatch(message)


def base_mismatch(cfg: RunConfig, saved: compat.SavedStep) -> str | None:
    """None unless `saved` holds LoRA adapters trained over another base than this config's."""
    if not cfg.frozen_base:
        return None
    now = base_identity.base_record(cfg.checkpoint.load_parameters_path, cfg.train.init_weights_seed)
    why = base_identity.difference(saved.lora_base, now)
    if why is None:
        return None
    back = saved.lora_base.get("load_parameters_path")
    revert = (
        f"load_parameters_path={back}" if back else f"init_weights_seed={saved.lora_base.get('init_weights_seed')}"
    )
    return (
        f"cannot resume from {saved.where}: {why}. Ways forward: resume it over its own base ({revert}, the "
        "same content); or start a new run over this base: another run_name=... Nothing in the run directory "
        "was changed."
    )


def check_load_paths_exist(cfg: RunConfig) -> list[str]:
    """Every configured load path exists and is a committed checkpoint (else a UserInputError naming the
    key), whatever the run directory holds; returns them as 'key=path'."""
    from trainer.checkpoint.checks import check_checkpoint_dir

    given = []
    for key in LOAD_KEYS:
        value = getattr(cfg.checkpoint, key)
        if value:
            check_checkpoint_dir(value, flag=key)
            given.append(f"{key}={value}")
    return given


def check(cfg: RunConfig, checkpoints: epath.Path, *, local_checkpoints: epath.Path | None = None) -> Preflight:
    """Raise a UserInputError (ConfigError, DataError, CheckpointMismatch, ...) naming an unusable input; say
    where the run starts from (the newest committed step of the persistent or the local checkpoint tier)."""
    from trainer.checkpoint import commit, local_store

    load_paths = check_load_paths_exist(cfg)
    if cfg.checkpoint.enable_checkpointing and checkpoints.exists() and not checkpoints.is_dir():
        raise UserInputError(f"{checkpoints} is not a directory: every checkpoint save would fail; move it away")
    saved: list[tuple[int, compat.SavedStep]] = []
    persistent_hint = None
    if cfg.checkpoint.enable_checkpointing:
        steps = commit.committed_steps(checkpoints)
        if steps:
            saved.append((steps[-1], persistent_step(checkpoints, steps[-1])))
            persistent_hint = saved[-1][1].load_hint
    if local_checkpoints is not None:
        steps = local_store.committed_steps(local_checkpoints)
        if steps:
            saved.append((steps[-1], local_step(local_checkpoints, steps[-1], persistent_hint)))
    resume = max(step for step, _ in saved) if saved else None
    for _, step in saved:
        check_saved_step(cfg, step)
    if resume is None:
        if cfg.checkpoint.enable_checkpointing and (problem := unresumable_steps(checkpoints)):
            raise UserInputError(problem)
        check_load_path(cfg)
    data_problems(cfg)
    observe_problems(cfg)
    if cfg.frozen_base:  # a LoRA base or DPO reference is loaded on every start, resumed or not
        load_paths = [p for p in load_paths if not p.startswith("load_parameters_path=")]
    return Preflight(resume_step=resume, unused_load_paths=tuple(load_paths) if resume is not None else ())
