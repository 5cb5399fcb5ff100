"""Build one training attempt: mesh, sharded state, compiled step, data iterator, checkpointer.

Everything an attempt needs is created here and torn down by its ExitStack, so a retry after a slice
failure starts from clean objects (no threads, arrays of a dead mesh or stale caches survive).
The only things passed in are the config, the active slices and long-lived services (event log,
executable cache) that the caller owns.
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
from trainer.config.schema import RunConfig
from trainer.data.pipeline import make_train_iterator
from trainer.optim import learning_rate_schedule, make_optimizer
from trainer.parallel.activations import ActivationSharding
from trainer.parallel.mesh import build_mesh
from trainer.parallel.rules import logical_to_spec, tree_shardings
from trainer.step import make_train_step

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0
# Several processes: a save in flight when a peer died waits in an Orbax barrier for that peer, which
# never arrives (the coordination service keeps waiting for a recoverable task), so do not wait long.
# Orderly ends (finish, scale-up) settle their saves before the attempt closes.
MULTIPROCESS_CLOSE_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How the global batch is run on the current mesh."""

    global_batch_size: int
    micro_steps: int
    lr_scale: float

    @property
    def rows_per_micro(self) -> int:
        return self.global_batch_size // self.micro_steps


def plan_batch(cfg: RunConfig, *, devices_per_slice: int, active_slices: int, batch_shards: int) -> BatchPlan:
    """Global batch and micro-steps for the active slices.

    The nominal global batch is per_device_batch_size x all devices of all configured slices x
    gradient_accumulation_steps. With fewer active slices, `keep_global` runs the same global batch
    with more micro-steps (same math); `scale` shrinks the global batch and the learning rate in
    proportion to the active slices.
    """
    accum = cfg.optim.gradient_accumulation_steps
    per_step = cfg.data.per_device_batch_size * devices_per_slice
    nominal = per_step * cfg.mesh.num_slices * accum
    policy = cfg.elastic.elastic_resize_batch_policy
    if policy == "scale" and active_slices != cfg.mesh.num_slices:
        global_batch = per_step * active_slices * accum
        lr_scale = active_slices / cfg.mesh.num_slices
    else:
        global_batch, lr_scale = nominal, 1.0
    micro = accum
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


@dataclasses.dataclass
class Attempt:
    """What one attempt trains with. `close()` releases everything it owns."""

    cfg: RunConfig
    mesh: Mesh
    plan: BatchPlan
    state: dict
    start_step: int
    restored_from: str
    step_fn: Callable
    batch_sharding: NamedSharding
    iterator: Any
    checkpointer: Any
    flops_per_step: float
    stack: contextlib.ExitStack

    def device_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in host_batch.items()}

    def close(self) -> None:
        self.stack.close()


def state_shardings(cfg: RunConfig, mesh: Mesh, optimizer) -> tuple[Any, Any]:
    """(shardings, abstract state) of {"step", "params", "opt_state"} on this mesh, from the logical rules."""
    rules = cfg.mesh.logical_axis_rules
    logical = qwen3.param_logical_axes(cfg.model)
    abstract_params = qwen3.abstract_params(cfg.model)
    param_sh = tree_shardings(logical, abstract_params, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, abstract_opt, param_sh, transform_non_params=lambda _: replicated
    )
    shardings = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": abstract_params, "opt_state": abstract_opt}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return shardings, abstract


def init_state(cfg: RunConfig, optimizer, shardings) -> dict:
    """Fresh parameters and optimizer state, created already sharded (never whole on one device)."""

    def init(rng):
        params = qwen3.init_params(cfg.model, rng)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

    return jax.jit(init, out_shardings=shardings)(jax.random.key(cfg.train.init_weights_seed))


def compile_step(cfg: RunConfig, layout: Layout):
    """AOT-compile the train step for this layout's mesh and batch plan; returns (executable, seconds)."""
    mesh, plan, batch_sharding, shardings = layout.mesh, layout.plan, layout.batch_sharding, layout.shardings
    rules = cfg.mesh.logical_axis_rules
    micro_spec = NamedSharding(mesh, batch_sharding.spec)

    def constrain_micro(micro):
        return {k: jax.lax.with_sharding_constraint(v, micro_spec) for k, v in micro.items()}

    step = make_train_step(
        cfg.model,
        layout.optimizer,
        z_loss_multiplier=cfg.optim.z_loss_multiplier,
        micro_steps=plan.micro_steps,
        constrain_micro=constrain_micro,
        learning_rate=layout.lr_schedule,
        shard=ActivationSharding(mesh, rules),
    )

    def traced(state, batch):
        return step(state, batch)

    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(
        traced,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
    length = cfg.data.max_target_length
    abstract_batch = {
        k: jax.ShapeDtypeStruct((plan.global_batch_size, length), jnp.int32, sharding=batch_sharding)
        for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")
    }
    t0 = time.perf_counter()
    compiled = jitted.lower(layout.abstract_state, abstract_batch).compile()
    return compiled, time.perf_counter() - t0


def loader_shard(batch_sharding: NamedSharding, global_rows: int) -> tuple[int, int]:
    """(index, count) of this process's block of global-batch rows under `batch_sharding`: the rows its
    devices hold, which make_array_from_process_local_data expects. Follows the mesh order, so it is
    right on any subset of processes in any order (several processes, after a resize)."""
    index = batch_sharding.addressable_devices_indices_map((global_rows, 1)).values()
    lo = min(i[0].start or 0 for i in index)
    hi = max(global_rows if i[0].stop is None else i[0].stop for i in index)
    return lo // (hi - lo), global_rows // (hi - lo)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What an attempt derives from the config and its slices alone: no device data, threads or files.

    Cached per slice set across attempts, so a retry on slices seen before rebuilds none of it: not the
    compiled step, and not the mesh, shardings and abstract state either (eval_shape plus the sharding
    rules: ~50 ms on qwen3-tiny, more on bigger models)."""

    mesh: Mesh
    plan: BatchPlan
    batch_sharding: NamedSharding
    loader_index: int
    loader_count: int
    lr_schedule: optax.Schedule  # the optimizer's, also reported by the step (one object, never two)
    optimizer: optax.GradientTransformation
    shardings: Any
    abstract_state: Any
    step_fn: Callable | None = None  # set by `compiled`
    compile_s: float = 0.0

    def compiled(self, cfg: RunConfig) -> Layout:
        step_fn, seconds = compile_step(cfg, self)
        return dataclasses.replace(self, step_fn=step_fn, compile_s=seconds)


def slice_set_key(slices: list[list]) -> tuple:
    """A set of active slices in mesh order, by device id: the layout cache's key."""
    return tuple(tuple(d.id for d in s) for s in slices)


def describe_layout(cfg: RunConfig, slices: list[list]) -> Layout:
    """Mesh, batch plan, loader shard, optimizer and state shardings over `slices`; not compiled yet."""
    mesh = build_mesh(cfg.mesh, slices)
    batch_spec, shards = _batch_axes_size(mesh, cfg.mesh.logical_axis_rules)
    batch_sharding = NamedSharding(mesh, batch_spec)
    plan = plan_batch(cfg, devices_per_slice=len(slices[0]), active_slices=len(slices), batch_shards=shards)
    loader_index, loader_count = loader_shard(batch_sharding, plan.global_batch_size)
    schedule = learning_rate_schedule(cfg.optim, steps=cfg.train.steps, lr_scale=plan.lr_scale)
    optimizer = make_optimizer(cfg.optim, qwen3.param_logical_axes(cfg.model), schedule=schedule)
    shardings, abstract_state = state_shardings(cfg, mesh, optimizer)
    return Layout(
        mesh, plan, batch_sharding, loader_index, loader_count, schedule, optimizer, shardings, abstract_state
    )


def build_attempt(
    cfg: RunConfig,
    slices: list[list],
    *,
    checkpoint_dir,
    events,
    total_slices: int,
    layout_cache: dict | None = None,
    restore_source: Callable | None = None,
    wrap_step: Callable | None = None,
    checkpoint_multiprocessing=None,
) -> Attempt:
    """Everything one attempt needs, on the mesh over `slices` (the active ones).

    `layout_cache` (slice set -> Layout) is owned by the caller and outlives attempts; everything
    stateful (iterator, checkpointer, device arrays) is built fresh here every time.
    `restore_source(abstract_state, newest_checkpoint_step)` may supply a newer state than the newest
    checkpoint (an elastic host-RAM snapshot); it returns (state, data_state, label) or None.
    `wrap_step` wraps the compiled step (the elastic fault injector's guard).
    `checkpoint_multiprocessing`: Orbax MultiprocessingOptions when only some processes take part.
    """
    stack = contextlib.ExitStack()
    try:
        key = slice_set_key(slices)
        layout = None if layout_cache is None else layout_cache.get(key)
        fresh = layout is None
        if fresh:
            layout = describe_layout(cfg, slices)
        mesh, plan = layout.mesh, layout.plan
        # Data first: a bad dataset or tokenizer must stop the run before any compile or device work.
        iterator = make_train_iterator(
            cfg.data,
            vocab_size=cfg.model.vocab_size,
            global_batch_size=plan.global_batch_size,
            process_index=layout.loader_index,
            process_count=layout.loader_count,
        )
        stack.callback(iterator.close)
        if fresh:
            layout = layout.compiled(cfg)
            if layout_cache is not None:
                layout_cache[key] = layout
            events.emit(
                "compile_done", seconds=round(layout.compile_s, 3), devices=mesh.size, micro_steps=plan.micro_steps
            )
        else:
            events.emit("compile_cached", devices=mesh.size, micro_steps=plan.micro_steps)
        optimizer, shardings, abstract_state = layout.optimizer, layout.shardings, layout.abstract_state

        checkpointer = None
        if cfg.checkpoint.enable_checkpointing:
            from trainer.checkpoint import Checkpointer

            checkpointer = Checkpointer(
                checkpoint_dir, cfg.checkpoint, on_event=events, multiprocessing=checkpoint_multiprocessing
            )
            # A normal finish has already waited for its saves; after a failure, settle an in-flight save
            # for a bounded time (Orbax finishes or fails it in the background; it never counts until
            # committed).
            stack.callback(
                partial(
                    checkpointer.close,
                    timeout_s=CLOSE_TIMEOUT_S
                    if checkpoint_multiprocessing is None
                    else MULTIPROCESS_CLOSE_TIMEOUT_S,
                )
            )
        t0 = time.perf_counter()
        events.emit("restore_start")
        state, data_state, source = _initial_state(
            cfg, optimizer, shardings, abstract_state, checkpointer, restore_source
        )
        jax.block_until_ready(state)
        events.emit(
            "restore_end",
            source=source,
            seconds=round(time.perf_counter() - t0, 4),
            bytes=int(sum(x.nbytes for x in jax.tree.leaves(state))),
        )
        if data_state is not None:
            iterator.set_state(data_state)
        start_step = int(jax.device_get(state["step"]))
        flops = (
            qwen3.training_flops_per_token(cfg.model, cfg.data.max_target_length)
            * plan.global_batch_size
            * cfg.data.max_target_length
        )
        log.info(
            "attempt ready: mesh=%s global_batch=%d micro_steps=%d lr_scale=%.3f start_step=%d source=%s "
            "loader_shard=%d/%d",
            dict(mesh.shape),
            plan.global_batch_size,
            plan.micro_steps,
            plan.lr_scale,
            start_step,
            source,
            layout.loader_index,
            layout.loader_count,
        )
        return Attempt(
            cfg=cfg,
            mesh=mesh,
            plan=plan,
            state=state,
            start_step=start_step,
            restored_from=source,
            step_fn=layout.step_fn if wrap_step is None else wrap_step(layout.step_fn),
            batch_sharding=layout.batch_sharding,
            iterator=iterator,
            checkpointer=checkpointer,
            flops_per_step=flops,
            stack=stack,
        )
    except BaseException:
        stack.close()
        raise


def _initial_state(cfg: RunConfig, optimizer, shardings, abstract_state, checkpointer, restore_source):
    """Newest of (snapshot, committed checkpoint); else load_parameters_path / load_full_state_path; else init."""
    ckpt_step = None
    if checkpointer is not None:
        checkpointer.cleanup_partial()
        ckpt_step = checkpointer.latest_committed_step()
    if restore_source is not None:
        snap = restore_source(abstract_state, ckpt_step)
        if snap is not None:
            return snap
    if ckpt_step is not None:
        restored = checkpointer.restore(abstract_state)
        return restored.state, restored.data_state, f"checkpoint:{restored.step}"
    if cfg.checkpoint.load_full_state_path:
        from trainer.checkpoint import load_full_state

        return load_full_state(cfg.checkpoint.load_full_state_path, abstract_state), None, "load_full_state_path"
    if cfg.checkpoint.load_parameters_path:
        from trainer.checkpoint import load_parameters

        params = load_parameters(cfg.checkpoint.load_parameters_path, abstract_state["params"])
        opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
        return {"step": step, "params": params, "opt_state": opt_state}, None, "load_parameters_path"
    return init_state(cfg, optimizer, shardings), None, "init"
