"""The layout of a run on a set of slices: what to train, how the batch is split, and the compiled steps.

Pure: config sections and devices in, plans and executables out; no device data, threads or files. The
trainer (`trainer.attempt.builder.AttemptBuilder`, per slice set) and the AOT tool (`trainer.compile` through
`trainer.aot.layouts`, on compile-only TPU devices) both go through this module and only this module,
so the step the tool measures is the step a run executes.

- `TrainSpec` / `train_spec(cfg)`: the config sections every attempt needs (the one place that picks
  them out of a `RunConfig`).
- `BatchLayout` / `batch_layout`: the global batch and micro-steps on the active slices.
- `loader_shard`: this process's block of global-batch rows.
- `SliceLayout` / `slice_layout`: the mesh, batch layout, optimizer and state shardings over a slice set.
- `lower_step` / `compile_step`: the train step or the eval step, lowered or compiled for a layout.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.config.loader import to_flat_dict
from trainer.config.schema import (
    AUTO,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoraConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    PreferenceConfig,
    RunConfig,
    frozen_model,
)
from trainer.data.batch import BATCH_KEYS
from trainer.parallel.activations import ActivationSharding
from trainer.parallel.mesh import build_mesh
from trainer.parallel.rules import logical_to_spec
from trainer.program.batch_rows import rows_per_slice
from trainer.program.executable_cache import compile_lowered
from trainer.program.optim import learning_rate_schedule, make_optimizer
from trainer.program.state import base_shardings, state_shardings, trainable_logical_axes
from trainer.program.step import DATA as DATA_AXIS
from trainer.program.step import make_eval_step, make_replica_checksums, make_train_step

Step = Literal["train", "eval", "sdc"]


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """What every attempt of a run trains, on whatever slices: the config sections it needs."""

    model: ModelConfig
    optim: OptimConfig
    data: DataConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig
    steps: int
    init_weights_seed: int
    resize_batch_policy: str  # elastic_resize_batch_policy: keep_global | scale
    config_record: dict  # the resolved config, flat: saved with every checkpoint
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    sdc_check: bool = False  # sdc_check_period > 0: compile the replica checksums too (trainer.attempt.sdc)
    sdc_lazy: bool = False  # sdc_check_period auto on 2+ slices: compile them at the first check
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # lora_rank > 0: adapters over a frozen base
    preference: PreferenceConfig | None = None  # objective=dpo: the DPO loss against the frozen reference
    # elastic_resize_bitwise: the step keeps its bits over every active slice count (`ordered_groups`)
    bitwise_resize: bool = False

    @property
    def frozen_base(self) -> bool:
        """A frozen model beside the state: LoRA's base or DPO's reference (`frozen_model`)."""
        return frozen_model(self.lora, self.data)

    @property
    def rows_per_example(self) -> int:
        """Batch rows per example: 2 under objective=dpo (a pair), else 1."""
        return 2 if self.data.dpo else 1


def train_spec(cfg: RunConfig) -> TrainSpec:
    """The sections of the config every attempt needs (the parts built from them never see RunConfig)."""
    return TrainSpec(
        model=cfg.model,
        optim=cfg.optim,
        data=cfg.data,
        mesh=cfg.mesh,
        checkpoint=cfg.checkpoint,
        steps=cfg.train.steps,
        init_weights_seed=cfg.train.init_weights_seed,
        resize_batch_policy=cfg.elastic.elastic_resize_batch_policy,
        config_record=to_flat_dict(cfg),
        eval=cfg.eval,
        sdc_check=cfg.elastic.sdc_check_period > 0,
        sdc_lazy=cfg.elastic.sdc_check_period == AUTO and cfg.mesh.num_slices > 1,
        lora=cfg.lora,
        preference=cfg.preference if cfg.data.dpo else None,
        bitwise_resize=cfg.elastic.elastic_resize_bitwise,
    )


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How the global batch is run on the current mesh."""

    global_batch_size: int
    micro_steps: int
    lr_scale: float
    # > 0: the global batch is summed as this many fixed groups of rows in their order (`ordered_groups`),
    # micro_steps of them per replica; 0: each replica sums its rows and the replicas' sums are all-reduced
    ordered_groups: int = 0

    @property
    def rows_per_micro(self) -> int:
        return self.global_batch_size // self.micro_steps


def batch_layout(
    *,
    per_device_batch_size: int | float,
    accumulation_steps: int,
    num_slices: int,
    policy: str,
    devices_per_slice: int,
    active_slices: int,
    batch_shards: int,
    rows_per_example: int = 1,
    replicas_per_slice: int = 1,
    bitwise_resize: bool = False,
    shards_per_slice: int = 1,
    key: str = "per_device_batch_size",
) -> BatchLayout:
    """Global batch (in rows) and micro-steps for the active slices.

    The nominal global batch is per_device_batch_size x all devices of all `num_slices` configured
    slices x accumulation_steps examples, of `rows_per_example` rows each (2 for a DPO pair). With fewer
    active slices, policy `keep_global` runs the same global batch with more micro-steps (same math);
    `scale` shrinks the global batch and the learning rate in proportion to the active slices. Every
    micro-step's rows on every batch shard are whole examples (a pair is never split).
    `bitwise_resize` (elastic_resize_bitwise, keep_global): the batch is summed as `ordered_groups` fixed
    groups whatever the active slices (`replicas_per_slice` data-parallel replicas each), a replica running
    groups / replicas of them as its micro-steps. The groups suit every slice count from 1 to num_slices,
    whatever elastic_min_slice_count says, so that runs of one job with other recovery settings (an
    uninterrupted one among them) sum in the same groups.
    `per_device_batch_size` may be a fraction: x devices_per_slice it must be whole examples that split
    over the slice's `shards_per_slice` batch shards, or a ConfigError names `key` and the smallest valid
    value (`trainer.program.batch_rows`); the count is exact.
    """
    per_step = (
        rows_per_slice(
            per_device_batch_size, devices_per_slice=devices_per_slice, shards_per_slice=shards_per_slice, key=key
        )
        * rows_per_example
    )
    nominal = per_step * num_slices * accumulation_steps
    if policy == "scale" and active_slices != num_slices:
        global_batch = per_step * active_slices * accumulation_steps
        lr_scale = active_slices / num_slices
    else:
        global_batch, lr_scale = nominal, 1.0
    if bitwise_resize and global_batch == nominal:
        replicas = active_slices * replicas_per_slice
        unit = batch_shards // replicas * rows_per_example
        groups = ordered_groups(
            units=global_batch // unit,
            nominal_groups=num_slices * replicas_per_slice * accumulation_steps,
            replica_counts=tuple(c * replicas_per_slice for c in range(1, num_slices + 1)),
        )
        if global_batch % unit == 0 and groups % replicas == 0:
            return BatchLayout(global_batch, groups // replicas, lr_scale, groups)
        raise _unsplittable(global_batch, batch_shards, rows_per_example)
    for micro in range(accumulation_steps, global_batch + 1):
        rows = global_batch // micro
        if global_batch % micro == 0 and rows % (batch_shards * rows_per_example) == 0:
            return BatchLayout(global_batch, micro, lr_scale)
    raise _unsplittable(global_batch, batch_shards, rows_per_example)


def _unsplittable(global_batch: int, batch_shards: int, rows_per_example: int) -> ValueError:
    whole = f" of whole {rows_per_example}-row examples" if rows_per_example > 1 else ""
    return ValueError(
        f"global batch {global_batch} cannot be split evenly over {batch_shards} batch shards{whole}"
    )


def ordered_groups(*, units: int, nominal_groups: int, replica_counts: tuple[int, ...]) -> int:
    """How many fixed groups of rows a bitwise-resizable step (elastic_resize_bitwise) sums the global batch
    in, given `units` (the global batch in whole rows for one replica's batch shards: the finest group) and
    the data-parallel replica counts the run may train on: the fewest groups (so the largest) that is a
    multiple of `nominal_groups` (replicas on all slices x accumulation steps: no group is larger than a
    micro-step there) and of every replica count that divides `units` (one the batch can be split over).

    Each group's gradient is computed by the same program on the same rows whichever replica runs it, and
    the groups are added in their index order (`trainer.program.step`), so the sum's bits do not depend
    on how many replicas computed it."""
    groups = nominal_groups
    for count in replica_counts:
        if units % count == 0:
            groups = math.lcm(groups, count)
    return groups


def _batch_axes_size(mesh: Mesh, rules) -> tuple[PartitionSpec, int]:
    # A batch size every product of mesh axes divides (1 << 30 is not divisible by a 3-way data axis,
    # which left the batch replicated on 3 slices: every replica computed the whole global batch).
    spec = logical_to_spec(("activation_batch", None), (mesh.size, 1), mesh, rules)
    axes = spec[0] if spec[0] is not None else ()
    axes = (axes,) if isinstance(axes, str) else axes
    return spec, int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def _shards_per_slice(batch_spec: PartitionSpec, shards: int, mesh: Mesh, slices: int) -> int:
    """The batch shards within one slice: the data axis spans the slices, the other batch axes do not."""
    axes = batch_spec[0] if batch_spec[0] is not None else ()
    axes = (axes,) if isinstance(axes, str) else axes
    return shards // slices if DATA_AXIS in axes and mesh.shape[DATA_AXIS] % slices == 0 else shards


def loader_shard(batch_sharding: NamedSharding, global_rows: int) -> tuple[int, int]:
    """(index, count) of this process's block of global-batch rows under `batch_sharding`: the rows its
    devices hold, which make_array_from_process_local_data expects. Follows the mesh order, so it is
    right on any subset of processes in any order (several processes, after a resize)."""
    index = batch_sharding.addressable_devices_indices_map((global_rows, 1)).values()
    lo = min(i[0].start or 0 for i in index)
    hi = max(global_rows if i[0].stop is None else i[0].stop for i in index)
    return lo // (hi - lo), global_rows // (hi - lo)


@dataclasses.dataclass(frozen=True)
class SliceLayout:
    """What an attempt derives from the spec and its slices alone: no device data, threads or files.

    Kept per slice set across attempts, so a retry on slices seen before rebuilds none of it: not the
    compiled step, and not the mesh, shardings and abstract state either (eval_shape plus the sharding
    rules: ~50 ms on qwen3-tiny, more on bigger models)."""

    mesh: Mesh
    batch: BatchLayout
    batch_sharding: NamedSharding
    loader_index: int
    loader_count: int
    lr_schedule: optax.Schedule  # the optimizer's, also reported by the step (one object, never two)
    optimizer: optax.GradientTransformation
    shardings: Any
    abstract_state: Any
    step_fn: Callable | None = None  # set by `compiled`
    compile_s: float = 0.0
    eval_batch: BatchLayout | None = None  # the fixed eval batch on this mesh (None: eval off)
    eval_loader: tuple[int, int] = (0, 1)  # this process's (index, count) of the eval batch's rows
    eval_fn: Callable | None = None  # set by `compiled` when eval is on
    eval_compile_s: float = 0.0
    sdc_fn: Callable | None = None  # set by `compiled` when the silent-data-corruption check is on
    # LoRA (lora_rank > 0): the frozen base's shardings and abstract params on this mesh; every step takes the
    # base as its third argument (`trainer.program.step`). None: full training.
    base_shardings: Any = None
    abstract_base: Any = None

    def compiled(self, spec: TrainSpec) -> SliceLayout:
        step_fn, seconds = compile_step(spec, self, "train")
        eval_fn, eval_seconds = compile_step(spec, self, "eval") if self.eval_batch is not None else (None, 0.0)
        sdc_fn, sdc_seconds = compile_step(spec, self, "sdc") if spec.sdc_check else (None, 0.0)
        if spec.sdc_lazy and not spec.sdc_check:
            sdc_fn = _CompiledOnFirstCall(lambda: compile_step(spec, self, "sdc")[0])
        return dataclasses.replace(
            self,
            step_fn=step_fn,
            compile_s=seconds + eval_seconds + sdc_seconds,
            eval_fn=eval_fn,
            eval_compile_s=eval_seconds,
            sdc_fn=sdc_fn,
        )


def slice_layout(spec: TrainSpec, slices: list[list]) -> SliceLayout:
    """Mesh, batch layout, loader shard, optimizer and state shardings over `slices`; not compiled yet."""
    mesh = build_mesh(spec.mesh, slices)
    batch_spec, shards = _batch_axes_size(mesh, spec.mesh.logical_axis_rules)
    batch_sharding = NamedSharding(mesh, batch_spec)
    per_slice = _shards_per_slice(batch_spec, shards, mesh, len(slices))
    batch = batch_layout(
        per_device_batch_size=spec.data.per_device_batch_size,
        accumulation_steps=spec.optim.gradient_accumulation_steps,
        num_slices=spec.mesh.num_slices,
        policy=spec.resize_batch_policy,
        devices_per_slice=len(slices[0]),
        active_slices=len(slices),
        batch_shards=shards,
        rows_per_example=spec.rows_per_example,
        replicas_per_slice=mesh.shape.get(DATA_AXIS, 1) // len(slices),
        bitwise_resize=spec.bitwise_resize,
        shards_per_slice=per_slice,
    )
    loader_index, loader_count = loader_shard(batch_sharding, batch.global_batch_size)
    schedule = learning_rate_schedule(spec.optim, steps=spec.steps, lr_scale=batch.lr_scale)
    optimizer = make_optimizer(spec.optim, trainable_logical_axes(spec.model, spec.lora), schedule=schedule)
    shardings, abstract_state = state_shardings(
        spec.model, spec.mesh.logical_axis_rules, mesh, optimizer, spec.lora
    )
    base_sh = abstract_base = None
    if spec.frozen_base:
        base_sh, abstract_base = base_shardings(spec.model, spec.mesh.logical_axis_rules, mesh)
    eval_batch, eval_loader = None, (0, 1)
    if spec.eval.eval_interval > 0:
        # The same global eval batch on every mesh (never scaled): the same tokens at every evaluation.
        eval_batch = batch_layout(
            per_device_batch_size=spec.eval.eval_per_device_batch_size or spec.data.per_device_batch_size,
            key="eval_per_device_batch_size" if spec.eval.eval_per_device_batch_size else "per_device_batch_size",
            shards_per_slice=per_slice,
            accumulation_steps=1,
            num_slices=spec.mesh.num_slices,
            policy="keep_global",
            devices_per_slice=len(slices[0]),
            active_slices=len(slices),
            batch_shards=shards,
            rows_per_example=spec.rows_per_example,
        )
        eval_loader = loader_shard(batch_sharding, eval_batch.global_batch_size)
    return SliceLayout(
        mesh,
        batch,
        batch_sharding,
        loader_index,
        loader_count,
        schedule,
        optimizer,
        shardings,
        abstract_state,
        eval_batch=eval_batch,
        eval_loader=eval_loader,
        base_shardings=base_sh,
        abstract_base=abstract_base,
    )


@dataclasses.dataclass(frozen=True)
class _Program:
    """What differs between the train step and the eval step when they are jitted for a layout."""

    fn: Callable
    batch: BatchLayout
    state: Any  # the abstract first argument
    state_sharding: Any
    out_shardings: Any
    donate_argnums: tuple[int, ...]


def _program(spec: TrainSpec, layout: SliceLayout, step: Step) -> _Program:
    """The train step takes the whole state and donates it, returning (state, metrics); the eval step
    takes only the params (with the train state's shardings) and returns its loss sums, replicated."""
    mesh = layout.mesh
    shard = ActivationSharding(
        mesh, spec.mesh.logical_axis_rules, context_strategy=spec.mesh.context_parallel_strategy
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    if step == "train":
        fn = make_train_step(
            spec.model,
            layout.optimizer,
            z_loss_multiplier=spec.optim.z_loss_multiplier,
            micro_steps=layout.batch.micro_steps,
            ordered_groups=layout.batch.ordered_groups,
            batch_spec=layout.batch_sharding.spec,
            data_reduce_dtype=spec.optim.data_reduce_dtype,
            learning_rate=layout.lr_schedule,
            shard=shard,
            lora=spec.lora,
            preference=spec.preference,
        )
        return _Program(
            fn, layout.batch, layout.abstract_state, layout.shardings, (layout.shardings, replicated), (0,)
        )
    if step == "eval":
        if layout.eval_batch is None:
            raise ValueError("this layout has no eval batch (eval_interval <= 0)")
        fn = make_eval_step(
            spec.model,
            micro_steps=layout.eval_batch.micro_steps,
            batch_spec=layout.batch_sharding.spec,
            shard=shard,
            lora=spec.lora,
            preference=spec.preference,
        )
        params = layout.abstract_state["params"]
        return _Program(fn, layout.eval_batch, params, layout.shardings["params"], replicated, ())
    if step == "sdc":
        fn = make_replica_checksums(
            spec.model,
            z_loss_multiplier=spec.optim.z_loss_multiplier,
            micro_steps=layout.batch.micro_steps,
            batch_spec=layout.batch_sharding.spec,
            shard=shard,
            lora=spec.lora,
            preference=spec.preference,
        )
        params = layout.abstract_state["params"]
        return _Program(fn, layout.batch, params, layout.shardings["params"], replicated, ())
    raise ValueError(f"step={step!r}: 'train', 'eval' or 'sdc'")


def lower_step(spec: TrainSpec, layout: SliceLayout, step: Step = "train") -> jax.stages.Lowered:
    """The train step (or the eval step) jitted for this layout's mesh and batch, lowered over the abstract
    state and an abstract int32 batch of the layout's global rows (and, with LoRA on, the abstract base)."""
    program = _program(spec, layout, step)
    base = () if layout.abstract_base is None else (layout.abstract_base,)
    jitted = jax.jit(
        program.fn,
        in_shardings=(program.state_sharding, layout.batch_sharding, *(layout.base_shardings,) * len(base)),
        out_shardings=program.out_shardings,
        donate_argnums=program.donate_argnums,
    )
    shape = (program.batch.global_batch_size, spec.data.max_target_length)
    abstract_batch = {
        k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=layout.batch_sharding) for k in BATCH_KEYS
    }
    return jitted.lower(program.state, abstract_batch, *base)


class _CompiledOnFirstCall:
    """A program compiled when it is first called (a check that may never run in a short job)."""

    def __init__(self, compile_now: Callable[[], Callable]):
        self._compile_now = compile_now
        self._fn: Callable | None = None

    def __call__(self, *args):
        if self._fn is None:
            self._fn = self._compile_now()
        return self._fn(*args)


def compile_step(spec: TrainSpec, layout: SliceLayout, step: Step = "train"):
    """AOT-compile the train step (or the eval step, over the layout's fixed eval batch) for this layout;
    returns (executable, seconds, lowering included)."""
    t0 = time.perf_counter()
    compiled = compile_lowered(lower_step(spec, layout, step), layout.mesh.devices.flat)
    return compiled, time.perf_counter() - t0
