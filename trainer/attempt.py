"""Build one training attempt: mesh, sharded state, compiled step, data iterator, checkpointer.

Everything an attempt needs is created here and torn down by its ExitStack, so a retry after a slice
failure starts from clean objects (no threads, arrays of a dead mesh or stale caches survive). What is
passed in: the run's `TrainSpec` (config sections), the active slices, and long-lived services that
the caller owns (event log, host snapshots). Only `AttemptBuilder.plans` outlives attempts: per slice
set, the mesh, shardings and compiled step, which hold no device data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer import model as qwen3
from trainer.checkpoint import open_checkpointer
from trainer.checkpoint.fence import SaveFence
from trainer.config.schema import CheckpointConfig, DataConfig, EvalConfig, MeshConfig, ModelConfig, OptimConfig
from trainer.data.batch import BATCH_KEYS
from trainer.data.pipeline import make_eval_iterator, make_train_iterator
from trainer.evaluate import EvalSchedule, Evaluator
from trainer.executable_cache import compile_lowered
from trainer.optim import learning_rate_schedule, make_optimizer
from trainer.parallel.activations import ActivationSharding
from trainer.parallel.mesh import build_mesh
from trainer.parallel.rules import logical_to_spec
from trainer.preemption import phase
from trainer.restore import SnapshotSource, restore_state
from trainer.state import init_state, state_around, state_shardings, tree_nbytes
from trainer.step import make_eval_step, make_train_step

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0
# Several processes: a save in flight when a peer died waits in an Orbax barrier for that peer, which
# never arrives (the coordination service keeps waiting for a recoverable task), so do not wait long.
# Orderly ends (finish, scale-up) settle their saves before the attempt closes.
MULTIPROCESS_CLOSE_TIMEOUT_S = 5.0


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


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How the global batch is run on the current mesh."""

    global_batch_size: int
    micro_steps: int
    lr_scale: float

    @property
    def rows_per_micro(self) -> int:
        return self.global_batch_size // self.micro_steps


def plan_batch(
    *,
    per_device_batch_size: int,
    accumulation_steps: int,
    num_slices: int,
    policy: str,
    devices_per_slice: int,
    active_slices: int,
    batch_shards: int,
) -> BatchPlan:
    """Global batch and micro-steps for the active slices.

    The nominal global batch is per_device_batch_size x all devices of all `num_slices` configured
    slices x accumulation_steps. With fewer active slices, policy `keep_global` runs the same global
    batch with more micro-steps (same math); `scale` shrinks the global batch and the learning rate in
    proportion to the active slices.
    """
    per_step = per_device_batch_size * devices_per_slice
    nominal = per_step * num_slices * accumulation_steps
    if policy == "scale" and active_slices != num_slices:
        global_batch = per_step * active_slices * accumulation_steps
        lr_scale = active_slices / num_slices
    else:
        global_batch, lr_scale = nominal, 1.0
    micro = accumulation_steps
    while micro <= global_batch:
        rows = global_batch // micro
        if global_batch % micro == 0 and rows % batch_shards == 0:
            return BatchPlan(global_batch, micro, lr_scale)
        micro += 1
    raise ValueError(f"global batch {global_batch} cannot be split evenly over {batch_shards} batch shards")


def _batch_axes_size(mesh: Mesh, rules) -> tuple[PartitionSpec, int]:
    # A batch size every product of mesh axes divides (1 << 30 is not divisible by a 3-way data axis,
    # which left the batch replicated on 3 slices: every replica computed the whole global batch).
    spec = logical_to_spec(("activation_batch", None), (mesh.size, 1), mesh, rules)
    axes = spec[0] if spec[0] is not None else ()
    axes = (axes,) if isinstance(axes, str) else axes
    return spec, int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def loader_shard(batch_sharding: NamedSharding, global_rows: int) -> tuple[int, int]:
    """(index, count) of this process's block of global-batch rows under `batch_sharding`: the rows its
    devices hold, which make_array_from_process_local_data expects. Follows the mesh order, so it is
    right on any subset of processes in any order (several processes, after a resize)."""
    index = batch_sharding.addressable_devices_indices_map((global_rows, 1)).values()
    lo = min(i[0].start or 0 for i in index)
    hi = max(global_rows if i[0].stop is None else i[0].stop for i in index)
    return lo // (hi - lo), global_rows // (hi - lo)


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    """What an attempt derives from the spec and its slices alone: no device data, threads or files.

    Kept per slice set across attempts, so a retry on slices seen before rebuilds none of it: not the
    compiled step, and not the mesh, shardings and abstract state either (eval_shape plus the sharding
    rules: ~50 ms on qwen3-tiny, more on bigger models)."""

    mesh: Mesh
    batch: BatchPlan
    batch_sharding: NamedSharding
    loader_index: int
    loader_count: int
    lr_schedule: optax.Schedule  # the optimizer's, also reported by the step (one object, never two)
    optimizer: optax.GradientTransformation
    shardings: Any
    abstract_state: Any
    step_fn: Callable | None = None  # set by `compiled`
    compile_s: float = 0.0
    eval_batch: BatchPlan | None = None  # the fixed eval batch on this mesh (None: eval off)
    eval_loader: tuple[int, int] = (0, 1)  # this process's (index, count) of the eval batch's rows
    eval_fn: Callable | None = None  # set by `compiled` when eval is on
    eval_compile_s: float = 0.0

    def compiled(self, spec: TrainSpec) -> SlicePlan:
        step_fn, seconds = compile_step(spec, self)
        eval_fn, eval_seconds = compile_eval_step(spec, self) if self.eval_batch is not None else (None, 0.0)
        return dataclasses.replace(
            self, step_fn=step_fn, compile_s=seconds + eval_seconds, eval_fn=eval_fn, eval_compile_s=eval_seconds
        )


def plan_slices(spec: TrainSpec, slices: list[list]) -> SlicePlan:
    """Mesh, batch plan, loader shard, optimizer and state shardings over `slices`; not compiled yet."""
    mesh = build_mesh(spec.mesh, slices)
    batch_spec, shards = _batch_axes_size(mesh, spec.mesh.logical_axis_rules)
    batch_sharding = NamedSharding(mesh, batch_spec)
    batch = plan_batch(
        per_device_batch_size=spec.data.per_device_batch_size,
        accumulation_steps=spec.optim.gradient_accumulation_steps,
        num_slices=spec.mesh.num_slices,
        policy=spec.resize_batch_policy,
        devices_per_slice=len(slices[0]),
        active_slices=len(slices),
        batch_shards=shards,
    )
    loader_index, loader_count = loader_shard(batch_sharding, batch.global_batch_size)
    schedule = learning_rate_schedule(spec.optim, steps=spec.steps, lr_scale=batch.lr_scale)
    optimizer = make_optimizer(spec.optim, qwen3.param_logical_axes(spec.model), schedule=schedule)
    shardings, abstract_state = state_shardings(spec.model, spec.mesh.logical_axis_rules, mesh, optimizer)
    eval_batch, eval_loader = None, (0, 1)
    if spec.eval.eval_interval > 0:
        # The same global eval batch on every mesh (never scaled): the same tokens at every evaluation.
        eval_batch = plan_batch(
            per_device_batch_size=spec.eval.eval_per_device_batch_size or spec.data.per_device_batch_size,
            accumulation_steps=1,
            num_slices=spec.mesh.num_slices,
            policy="keep_global",
            devices_per_slice=len(slices[0]),
            active_slices=len(slices),
            batch_shards=shards,
        )
        eval_loader = loader_shard(batch_sharding, eval_batch.global_batch_size)
    return SlicePlan(
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
    )


def compile_step(spec: TrainSpec, plan: SlicePlan):
    """AOT-compile the train step for this plan's mesh and batch; returns (executable, seconds)."""
    mesh, batch_sharding, shardings = plan.mesh, plan.batch_sharding, plan.shardings
    micro_spec = NamedSharding(mesh, batch_sharding.spec)

    def constrain_micro(micro):
        return {k: jax.lax.with_sharding_constraint(v, micro_spec) for k, v in micro.items()}

    step = make_train_step(
        spec.model,
        plan.optimizer,
        z_loss_multiplier=spec.optim.z_loss_multiplier,
        micro_steps=plan.batch.micro_steps,
        constrain_micro=constrain_micro,
        learning_rate=plan.lr_schedule,
        shard=ActivationSharding(mesh, spec.mesh.logical_axis_rules),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(
        step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated), donate_argnums=(0,)
    )
    rows, length = plan.batch.global_batch_size, spec.data.max_target_length
    abstract_batch = {
        k: jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=batch_sharding) for k in BATCH_KEYS
    }
    t0 = time.perf_counter()
    compiled = compile_lowered(jitted.lower(plan.abstract_state, abstract_batch), mesh.devices.flat)
    return compiled, time.perf_counter() - t0


def compile_eval_step(spec: TrainSpec, plan: SlicePlan):
    """AOT-compile the eval step (forward only) for this plan's mesh and fixed eval batch; returns
    (executable, seconds). Params keep the train state's shardings; the loss sums come back replicated."""
    mesh, batch_sharding = plan.mesh, plan.batch_sharding
    micro_spec = NamedSharding(mesh, batch_sharding.spec)

    def constrain_micro(micro):
        return {k: jax.lax.with_sharding_constraint(v, micro_spec) for k, v in micro.items()}

    step = make_eval_step(
        spec.model,
        micro_steps=plan.eval_batch.micro_steps,
        constrain_micro=constrain_micro,
        shard=ActivationSharding(mesh, spec.mesh.logical_axis_rules),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(step, in_shardings=(plan.shardings["params"], batch_sharding), out_shardings=replicated)
    rows, length = plan.eval_batch.global_batch_size, spec.data.max_target_length
    abstract_batch = {
        k: jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=batch_sharding) for k in BATCH_KEYS
    }
    t0 = time.perf_counter()
    compiled = compile_lowered(jitted.lower(plan.abstract_state["params"], abstract_batch), mesh.devices.flat)
    return compiled, time.perf_counter() - t0


@dataclasses.dataclass
class Attempt:
    """What one attempt trains with. `close()` releases everything it owns."""

    mesh: Mesh
    plan: BatchPlan
    state: dict  # as restored; the loop carries the live state itself (each step donates its input)
    start_step: int
    restored_from: str
    step_fn: Callable
    batch_sharding: NamedSharding
    iterator: Any
    checkpointer: Any
    flops_per_step: float
    sequence_length: int
    checkpoint_metadata: dict
    stack: contextlib.ExitStack
    evaluator: Evaluator | None = None  # held-out evaluation (eval_interval > 0)

    def device_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in host_batch.items()}

    def close(self) -> None:
        self.stack.close()


def slice_set_key(slices: list[list]) -> tuple:
    """A set of active slices in mesh order, by device id: the plan cache's key."""
    return tuple(tuple(d.id for d in s) for s in slices)


class AttemptBuilder:
    """Builds the attempts of one run; keeps each slice set's `SlicePlan` (compiled step) across them."""

    def __init__(self, spec: TrainSpec, *, checkpoint_dir, events, fence=None, storage_faults=None):
        """`fence`: the process's save fence, advanced by each attempt's checkpointer (none given: one of
        its own); `storage_faults`: injected storage failures (fault_schedule storage=...)."""
        self.spec = spec
        self.checkpoint_dir = checkpoint_dir
        self.events = events
        self.fence = fence or SaveFence()
        self.storage_faults = storage_faults
        self.plans: dict[tuple, SlicePlan] = {}

    def forget_compiled(self) -> None:
        """Drop every slice set's plan: the devices they were compiled for are gone (a fresh client)."""
        self.plans.clear()

    def __call__(
        self,
        slices: list[list],
        *,
        snapshots: SnapshotSource | None = None,
        wrap_step: Callable | None = None,
        checkpoint_multiprocessing=None,
        checkpoint_barrier=None,
    ) -> Attempt:
        """Everything one attempt needs, on the mesh over `slices` (the active ones), fresh except the plan.

        `snapshots`: host-RAM snapshots to restore from (see `trainer.restore`).
        `wrap_step` wraps the compiled step (the fault injector's or the membership's guard).
        `checkpoint_multiprocessing`: Orbax MultiprocessingOptions when only some processes take part.
        `checkpoint_barrier`: Orbax's barrier between processes (one that notices a dead peer), or None.
        """
        spec, events = self.spec, self.events
        stack = contextlib.ExitStack()
        try:
            key = slice_set_key(slices)
            plan = self.plans.get(key)
            fresh = plan is None
            if fresh:
                plan = plan_slices(spec, slices)
            batch = plan.batch
            # Data first: a bad dataset or tokenizer must stop the run before any compile or device work.
            iterator = make_train_iterator(
                spec.data,
                vocab_size=spec.model.vocab_size,
                global_batch_size=batch.global_batch_size,
                process_index=plan.loader_index,
                process_count=plan.loader_count,
            )
            stack.callback(iterator.close)
            eval_iterator = None
            if plan.eval_batch is not None:  # rewound before every evaluation, never checkpointed
                eval_iterator = make_eval_iterator(
                    spec.data,
                    spec.eval.grain_eval_files,
                    vocab_size=spec.model.vocab_size,
                    global_batch_size=plan.eval_batch.global_batch_size,
                    process_index=plan.eval_loader[0],
                    process_count=plan.eval_loader[1],
                )
                stack.callback(eval_iterator.close)
            if fresh:
                with phase("compile"):
                    plan = self.plans[key] = plan.compiled(spec)
                events.emit(
                    "compile_done",
                    seconds=round(plan.compile_s, 3),
                    eval_seconds=round(plan.eval_compile_s, 3),
                    devices=plan.mesh.size,
                    micro_steps=batch.micro_steps,
                )
            else:
                events.emit("compile_cached", devices=plan.mesh.size, micro_steps=batch.micro_steps)

            checkpointer = open_checkpointer(
                self.checkpoint_dir,
                spec.checkpoint,
                on_event=events,
                multiprocessing=checkpoint_multiprocessing,
                barrier_sync_fn=checkpoint_barrier,
                fence=self.fence,
                storage_faults=self.storage_faults,
            )
            # A normal finish has already waited for its saves; after a failure, settle an in-flight save
            # for a bounded time (Orbax finishes or fails it in the background; it never counts until
            # committed).
            close_s = CLOSE_TIMEOUT_S if checkpoint_multiprocessing is None else MULTIPROCESS_CLOSE_TIMEOUT_S
            stack.callback(partial(checkpointer.close, timeout_s=close_s))
            t0 = time.perf_counter()
            events.emit("restore_start")
            with phase("restore"):
                restored = restore_state(
                    plan.abstract_state,
                    checkpoints=checkpointer,
                    snapshots=snapshots,
                    load_full_state_path=spec.checkpoint.load_full_state_path,
                    load_parameters_path=spec.checkpoint.load_parameters_path,
                    fresh_state=partial(self._fresh_state, plan),
                )
                state = jax.block_until_ready(restored.state)
            events.emit(
                "restore_end",
                source=restored.label,
                seconds=round(time.perf_counter() - t0, 4),
                bytes=tree_nbytes(state),
            )
            if restored.data_state is not None:
                iterator.set_state(restored.data_state)
            start_step = int(jax.device_get(state["step"]))
            length = spec.data.max_target_length
            tokens = batch.global_batch_size * length
            log.info(
                "attempt ready: mesh=%s global_batch=%d micro_steps=%d lr_scale=%.3f start_step=%d source=%s "
                "loader_shard=%d/%d",
                dict(plan.mesh.shape),
                batch.global_batch_size,
                batch.micro_steps,
                batch.lr_scale,
                start_step,
                restored.label,
                plan.loader_index,
                plan.loader_count,
            )
            metadata = {
                "config": spec.config_record,
                "mesh": dict(plan.mesh.shape),
                "global_batch_size": batch.global_batch_size,
                "micro_steps": batch.micro_steps,
            }
            return Attempt(
                mesh=plan.mesh,
                plan=batch,
                state=state,
                start_step=start_step,
                restored_from=restored.label,
                step_fn=plan.step_fn if wrap_step is None else wrap_step(plan.step_fn),
                batch_sharding=plan.batch_sharding,
                iterator=iterator,
                checkpointer=checkpointer,
                flops_per_step=qwen3.training_flops_per_token(spec.model, length) * tokens,
                sequence_length=length,
                checkpoint_metadata=metadata,
                stack=stack,
                evaluator=self._evaluator(plan, eval_iterator),
            )
        except BaseException:
            stack.close()
            raise

    def _evaluator(self, plan: SlicePlan, iterator) -> Evaluator | None:
        if iterator is None:
            return None
        ev = self.spec.eval
        sharding = plan.batch_sharding
        return Evaluator(
            eval_fn=plan.eval_fn,
            iterator=iterator,
            device_batch=lambda b: {k: jax.make_array_from_process_local_data(sharding, v) for k, v in b.items()},
            schedule=EvalSchedule(ev.eval_interval, ev.eval_start_step, self.spec.steps),
            batches=ev.eval_steps,
            target_loss=ev.target_eval_loss,
        )

    def _fresh_state(self, plan: SlicePlan, params=None) -> dict:
        if params is None:
            return init_state(self.spec.model, plan.optimizer, plan.shardings, seed=self.spec.init_weights_seed)
        return state_around(params, plan.optimizer, plan.shardings)
