"""Checks that need more than one key, or a value's range, collected so the user sees all at once."""

from __future__ import annotations

import dataclasses

from trainer.config.errors import ConfigError
from trainer.config.rope_scaling import parse_rope_scaling
from trainer.config.schema import LORA_MODULES, RunConfig, section_classes
from trainer.errors import UserInputError


def _field_constraints(cfg: RunConfig) -> list[str]:
    problems = []
    for section in section_classes():
        sub = getattr(cfg, section)
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            choices, minimum, maximum, above = (
                f.metadata.get(k) for k in ("choices", "minimum", "maximum", "above")
            )
            if choices is not None and value not in choices:
                problems.append(f"{f.name}={value!r} is not one of {', '.join(map(repr, choices))}")
            if minimum is not None and value < minimum:
                problems.append(f"{f.name}={value!r} must be >= {minimum}")
            if above is not None and value <= above:
                problems.append(f"{f.name}={value!r} must be > {above}")
            if maximum is not None and value > maximum:
                problems.append(f"{f.name}={value!r} must be <= {maximum}")
    return problems


def _model_problems(cfg: RunConfig) -> list[str]:
    m, problems = cfg.model, []
    if m.base_num_query_heads % m.base_num_kv_heads:
        problems.append(
            f"base_num_query_heads={m.base_num_query_heads} is not divisible by "
            f"base_num_kv_heads={m.base_num_kv_heads} (GQA needs whole groups)"
        )
    if m.num_experts > 1:
        if m.base_moe_mlp_dim < 1:
            problems.append("num_experts > 1 needs base_moe_mlp_dim >= 1 (the expert MLP size)")
        if m.num_experts_per_tok > m.num_experts:
            problems.append(f"num_experts_per_tok={m.num_experts_per_tok} exceeds num_experts={m.num_experts}")
    try:
        parse_rope_scaling(m.rope_scaling)
    except ConfigError as err:
        problems.append(str(err))
    if m.attention == "splash":
        # The TPU kernel tiles the sequence in whole 128-lane blocks (trainer/model/attention.py).
        t = cfg.data.max_target_length
        bq, bk = min(m.sa_block_q, t), min(m.sa_block_kv, t)
        if t % 128 or bq % 128 or bk % 128 or t % bq or t % bk:
            problems.append(
                f"attention=splash needs max_target_length={t} and its tiles sa_block_q={m.sa_block_q}, "
                f"sa_block_kv={m.sa_block_kv} (clipped to it) in multiples of 128 that divide it; "
                "e.g. max_target_length=2048 sa_block_q=512 sa_block_kv=512, or attention=flash"
            )
    return problems


def _run_problems(cfg: RunConfig) -> list[str]:
    problems = []
    o, mesh, e = cfg.optim, cfg.mesh, cfg.elastic
    for name in ("adam_b1", "adam_b2"):
        if getattr(o, name) >= 1:
            problems.append(f"{name}={getattr(o, name)} must be < 1")
    if o.learning_rate_schedule_steps == 0:
        problems.append("learning_rate_schedule_steps=0 must be >= 1 (or -1 = steps)")
    if e.sdc_check_period > 0 and mesh.num_slices < 2:
        problems.append(
            f"sdc_check_period={e.sdc_check_period} compares what different slices compute: it needs "
            f"num_slices >= 2 (got {mesh.num_slices}); set sdc_check_period=0"
        )
    spike = cfg.observe.loss_spike_threshold
    if 0 < spike <= 1:
        problems.append(
            f"loss_spike_threshold={spike:g} would call ordinary steps spikes: give a factor > 1 (e.g. 3) "
            "or 0 (off)"
        )
    ici = [
        mesh.ici_data_parallelism,
        mesh.ici_fsdp_parallelism,
        mesh.ici_tensor_parallelism,
        mesh.ici_expert_parallelism,
    ]
    problems += _context_problems(cfg)
    if sum(v == -1 for v in ici) > 1:
        problems.append("at most one ici_*_parallelism may be -1 (fill)")
    if any(v == 0 or v < -1 for v in ici):
        problems.append(f"ici_*_parallelism values must be >= 1 or -1, got {ici}")
    if not (e.elastic_min_slice_count == -1 or 1 <= e.elastic_min_slice_count <= mesh.num_slices):
        problems.append(
            f"elastic_min_slice_count={e.elastic_min_slice_count} must be -1 (all slices) or "
            f"between 1 and num_slices={mesh.num_slices}"
        )
    if e.elastic_resize_bitwise and e.elastic_resize_batch_policy != "keep_global":
        problems.append(
            "elastic_resize_bitwise=true keeps a resized run's bits only with the same global batch: set "
            "elastic_resize_batch_policy=keep_global (scale changes the batch and the learning rate)"
        )
    try:
        _ = cfg.faults  # fault_schedule parsed, once: the run reads this plan (RunConfig.faults)
    except ConfigError as err:
        problems.append(str(err))
    c = cfg.checkpoint
    if c.load_parameters_path and c.load_full_state_path:
        problems.append(
            "set at most one of load_parameters_path (params only) and load_full_state_path "
            "(params + optimizer state + step)"
        )
    if "://" in c.local_checkpoint_directory:
        problems.append(
            f"local_checkpoint_directory={c.local_checkpoint_directory!r} must be node-local storage (a path "
            "on this machine: local SSD or RAM disk); the persistent tier goes to base_output_directory"
        )
    if c.checkpoint_period == 0:
        problems.append(
            "checkpoint_period=0: give a period >= 1 or auto (the final step is always saved; "
            "enable_checkpointing=false saves nothing)"
        )
    if bool(c.local_checkpoint_directory) != (c.local_checkpoint_period != 0):
        problems.append(
            "the local checkpoint tier needs both local_checkpoint_directory and local_checkpoint_period "
            f"(> 0 or auto; got {c.local_checkpoint_directory!r} and {c.local_checkpoint_period}); set both, "
            "or neither"
        )
    if cfg.data.dataset_type == "arrayrecord":
        from trainer.config.mixture import parse_mixture

        try:
            parse_mixture(cfg.data.grain_train_files)
        except UserInputError as err:
            problems.append(str(err))
    for rule in mesh.logical_axis_rules:
        if not (
            isinstance(rule, (list, tuple))
            and len(rule) == 2
            and isinstance(rule[0], str)
            and isinstance(rule[1], (list, tuple, str, type(None)))
        ):
            problems.append(f"logical_axis_rules entry {rule!r} must be [logical_name, [mesh_axes...]]")
    return problems


def _context_problems(cfg: RunConfig) -> list[str]:
    """Context parallelism: the sequence must cut into 2 x N equal zigzag chunks, and the attention
    kernel must be one that runs on a split sequence."""
    n, problems = cfg.mesh.ici_context_parallelism, []
    if n == 1:
        return problems
    length = cfg.data.max_target_length
    if length % (2 * n):
        problems.append(
            f"ici_context_parallelism={n} splits the sequence into 2 x {n} equal chunks, but "
            f"max_target_length={length} is not a multiple of {2 * n}; round it to a multiple of {2 * n}"
        )
    length_axes = [axes for name, axes in cfg.mesh.logical_axis_rules if name == "activation_length"]
    if not any(
        axes == "context" or (isinstance(axes, (list, tuple)) and "context" in axes) for axes in length_axes
    ):
        problems.append(
            f"ici_context_parallelism={n} splits the sequence over the context axis, but logical_axis_rules "
            "does not map activation_length to it; add [activation_length, [context]] to logical_axis_rules"
        )
    if cfg.model.attention in ("splash", "cudnn_flash"):
        problems.append(
            f"attention={cfg.model.attention} does not run under context parallelism yet; use "
            "attention=flash (or dot_product, or autoselected, which picks flash) with "
            f"ici_context_parallelism={n}, or set ici_context_parallelism=1"
        )
    return problems


def _eval_problems(cfg: RunConfig) -> list[str]:
    ev, data, problems = cfg.eval, cfg.data, []
    if ev.eval_interval == 0:
        problems.append("eval_interval=0: set -1 (off) or the number of steps between evaluations")
    if ev.eval_steps == 0:
        problems.append("eval_steps=0: set -1 (one pass over grain_eval_files) or the eval batches per evaluation")
    if ev.target_eval_loss > 0 and ev.eval_interval < 1:
        problems.append(
            f"target_eval_loss={ev.target_eval_loss} needs evaluation: set eval_interval (e.g. eval_interval=100)"
        )
    if data.dataset_type != "arrayrecord" and ev.grain_eval_files:
        problems.append(
            f"grain_eval_files={ev.grain_eval_files!r} is read with dataset_type=arrayrecord only; "
            "synthetic runs evaluate on their own held-out stream: leave grain_eval_files unset"
        )
    if ev.eval_interval < 1:
        return problems
    if data.dataset_type == "arrayrecord" and not ev.grain_eval_files.strip():
        problems.append(
            f"eval_interval={ev.eval_interval} with dataset_type=arrayrecord needs grain_eval_files: "
            "glob(s) of held-out shards the run does not train on"
        )
    if data.dataset_type == "synthetic" and ev.eval_steps < 1:
        problems.append(
            "eval_steps=-1 means one pass over grain_eval_files, but the synthetic held-out stream is "
            "endless: set eval_steps >= 1 (e.g. eval_steps=10)"
        )
    return problems


def _cluster_problems(cfg: RunConfig) -> list[str]:
    """A `cluster` that contradicts the other keys naming the backend (what the job's environment says,
    the process count and pathwaysutils, is checked when the backend is chosen: trainer.elastic.backends)."""
    cluster, processes, problems = cfg.distributed.cluster, cfg.distributed.num_processes, []
    if cfg.mesh.enable_single_controller and cluster in ("local", "processes"):
        problems.append(
            f"enable_single_controller=true asks for Pathways' one controller but cluster={cluster}: set "
            "cluster=pathways (or auto), or enable_single_controller=false"
        )
    if cluster in ("local", "pathways") and processes > 1:
        problems.append(
            f"cluster={cluster} runs one process but num_processes={processes}: set cluster=processes "
            "(or auto), or num_processes=1"
        )
    if cluster == "processes" and processes == 1:
        problems.append(
            "cluster=processes needs several processes but num_processes=1: set cluster=local (or auto), "
            "or num_processes to the job's process count"
        )
    return problems


def _lora_problems(cfg: RunConfig) -> list[str]:
    lo, problems = cfg.lora, []
    if lo.lora_rank == 0:
        return problems
    targets = lo.lora_target_modules
    known = (*LORA_MODULES, "all-linear")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        problems.append(
            f"lora_target_modules={targets!r} must be a non-empty list of projection names, e.g. [q_proj,v_proj]"
        )
        return problems
    unknown = [t for t in targets if t not in known]
    if unknown:
        problems.append(
            f"lora_target_modules names {', '.join(map(repr, unknown))}: not a projection of this model; "
            f"use names from {', '.join(known)}"
        )
    mlp = {"gate_proj", "up_proj", "down_proj"} & ({*LORA_MODULES} if "all-linear" in targets else {*targets})
    if cfg.model.num_experts > 1 and mlp:
        problems.append(
            f"lora_target_modules targets the MLP ({', '.join(sorted(mlp))}) of an MoE model "
            f"(num_experts={cfg.model.num_experts}): adapters go on the attention projections only there; "
            "set lora_target_modules=[q_proj,k_proj,v_proj,o_proj]"
        )
    if lo.lora_dropout > 0:
        problems.append(
            f"lora_dropout={lo.lora_dropout} is not supported (a dropped adapter input would make the step depend "
            "on more than its batch and state); set lora_dropout=0"
        )
    if lo.lora_alpha <= 0:
        problems.append(f"lora_alpha={lo.lora_alpha} must be > 0 (the adapters' scale is lora_alpha / lora_rank)")
    if cfg.checkpoint.load_full_state_path:
        problems.append(
            "load_full_state_path with lora_rank > 0: a LoRA run starts from its base (load_parameters_path) "
            "with fresh adapters, or resumes its own checkpoints; unset load_full_state_path"
        )
    return problems


def _objective_problems(cfg: RunConfig) -> list[str]:
    data, pref, problems = cfg.data, cfg.preference, []
    if data.use_sft and data.objective == "dpo":
        problems.append(
            "use_sft=true means objective=sft, but objective=dpo: set use_sft=false for DPO (preference pairs "
            "are masked on their replies), or objective=sft"
        )
    if data.objective != "pretrain" and data.dataset_type != "arrayrecord":
        problems.append(
            f"objective={data.objective} trains on records (chats or preference pairs) but dataset_type="
            f"{data.dataset_type}: set dataset_type=arrayrecord and grain_train_files=..."
        )
    if data.objective == "dpo" and pref.dpo_beta <= 0:
        problems.append(f"dpo_beta={pref.dpo_beta} must be > 0 (e.g. dpo_beta=0.1)")
    if pref.dpo_label_smoothing > 0 and pref.dpo_loss_type != "sigmoid":
        problems.append(
            f"dpo_label_smoothing={pref.dpo_label_smoothing} applies to dpo_loss_type=sigmoid only, not "
            f"{pref.dpo_loss_type}: set dpo_label_smoothing=0 or dpo_loss_type=sigmoid"
        )
    return problems


def validate(cfg: RunConfig) -> None:
    """Raise one ConfigError listing every problem found."""
    problems = _field_constraints(cfg) + _model_problems(cfg) + _run_problems(cfg) + _eval_problems(cfg)
    problems += _cluster_problems(cfg) + _lora_problems(cfg) + _objective_problems(cfg)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
