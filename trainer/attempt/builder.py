"""Build one training attempt: the layout (cached per slice set), data iterators, checkpointer, restored state.

Everything an attempt needs is created here and torn down by its ExitStack, so a retry after a slice
failure starts from clean objects (no threads, arrays of a dead mesh or stale caches survive). What is
passed in: the run's `TrainSpec` (config sections), the active slices, the parts the cluster adds
(`AttemptParts`), and long-lived services that the caller owns (event log, host snapshots, phases).
Only `AttemptBuilder.layouts` outlives attempts: per slice set, the `SliceLayout` of
`trainer.program.layout` (mesh, shardings, compiled steps), which holds no device data.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from trainer import model
from trainer.attempt.compile_ahead import BackgroundCompiler
from trainer.attempt.evaluate import EvalSchedule, Evaluator
from trainer.attempt.restore import Restored, SnapshotSource, restore_state
from trainer.checkpoint import open_checkpointer
from trainer.checkpoint.fence import SaveFence
from trainer.data.pipeline import make_eval_iterator, make_train_iterator
from trainer.io.nbytes import tree_nbytes
from trainer.observe import catalogue
from trainer.process.preemption import Phases
from trainer.program.layout import BatchLayout, SliceLayout, TrainSpec, slice_layout
from trainer.program.state import init_base, init_state, state_around

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0
# Several processes: a save in flight when a peer died waits in an Orbax barrier for that peer, which
# never arrives (the coordination service keeps waiting for a recoverable task), so do not wait long.
# Orderly ends (finish, scale-up) settle their saves before the attempt closes.
MULTIPROCESS_CLOSE_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class AttemptParts:
    """The parts of one attempt that depend on the cluster it runs on (`trainer.elastic.cluster.Cluster`).

    snapshots                   where host-RAM snapshots are restored from (`attempt.restore.SnapshotSource`)
    wrap_step                   wraps the compiled step (a fault injector's or the membership's guard), or None
    wrap_replay                 wraps the compiled replay check (the fault injector's), or None
    checkpoint_multiprocessing  Orbax MultiprocessingOptions when only some processes take part, or None
    checkpoint_barrier          Orbax's barrier between processes (one that notices a dead peer), or None
    """

    snapshots: SnapshotSource | None = None
    wrap_step: Callable | None = None
    wrap_replay: Callable | None = None
    checkpoint_multiprocessing: Any = None
    checkpoint_barrier: Any = None


@dataclasses.dataclass
class Attempt:
    """What one attempt trains with. `close()` releases everything it owns."""

    mesh: Mesh
    batch_layout: BatchLayout
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
    sdc_fn: Callable | None = None  # per-replica checksums of a step (sdc_check_period > 0)
    num_slices: int = 1  # the active slices the mesh spans

    def device_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in host_batch.items()}

    def close(self) -> None:
        self.stack.close()


def slice_set_key(slices: list[list]) -> tuple:
    """A set of active slices in mesh order, by device id: the layout cache's key."""
    return tuple(tuple(d.id for d in s) for s in slices)


# Slice sets whose compiled layout is kept: the full set, the survivor sets a run meets, room to spare.
MAX_LAYOUTS = 8


def _all_done(futures: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """A future done when every one of `futures` is (at once when there are none)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    left, lock = [len(futures)], threading.Lock()

    def one_done(_) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done.set_result(None)

    if not futures:
        done.set_result(None)
    for f in futures:
        f.add_done_callback(one_done)
    return done


class AttemptBuilder:
    """Builds the attempts of one run; keeps each slice set's `SliceLayout` (compiled step) across them."""

    def __init__(
        self,
        spec: TrainSpec,
        *,
        checkpoint_dir,
        events,
        fence=None,
        storage_faults=None,
        checkpoint_due=None,
        phases: Phases | None = None,
    ):
        """`fence`: the process's save fence, advanced by each attempt's checkpointer (none given: one of
        its own); `storage_faults`: injected storage failures (fault_schedule storage=...);
        `checkpoint_due(step)`: the planned persistent-tier period (checkpoint_period=auto), else None;
        `phases`: the process's phases (compiling and restoring are phases of their own)."""
        self.spec = spec
        self.phases = phases or Phases()
        self.checkpoint_due = checkpoint_due
        self.checkpoint_dir = checkpoint_dir
        self.events = events
        self.fence = fence or SaveFence()
        self.storage_faults = storage_faults
        self.layouts: dict[tuple, SliceLayout] = {}  # most recently used last, at most MAX_LAYOUTS
        self._lock = threading.Lock()  # layouts: the attempt's thread and the compile-ahead thread
        self.ahead = BackgroundCompiler()  # slice sets queued or compiling in the background

    def forget_compiled(self) -> None:
        """Drop every slice set's layout: the devices they were compiled for are gone (a fresh client)."""
        with self._lock:
            self.layouts.clear()

    def compile_ahead(self, slice_sets: list[list[list]]) -> concurrent.futures.Future:
        """Compile the train and eval steps of each slice set in the background, one after the other, so
        the first attempt on one (a replica-resize onto survivors) finds its executable; an attempt that
        needs one still compiling waits for it. The sets within the latest attempt's slices go first
        (`trainer.attempt.compile_ahead`). Each is a `compile_ahead` event. Returns a future that is done
        when all are."""
        futures = []
        for slices in slice_sets:
            key = slice_set_key(slices)
            with self._lock:
                if key in self.layouts or self.ahead.pending(key) is not None:
                    continue
            devices = [d for ids in key for d in ids]
            futures.append(self.ahead.submit(key, devices, partial(self._compile_one, key, slices)))
        return _all_done(futures)

    def _compile_one(self, key: tuple, slices: list[list]) -> None:
        started, layout = time.perf_counter(), None
        try:
            layout = slice_layout(self.spec, slices).compiled(self.spec)
        except Exception as e:  # a layout that does not compile fails its own attempt later, not this run
            log.warning("compiling ahead for slices of %d devices failed: %s", sum(map(len, slices)), e)
        with self._lock:  # in the cache before it leaves the queue's in-progress map: never in neither
            if layout is not None:
                self.layouts.setdefault(key, layout)
                self._evict()
        if layout is None:
            return
        self.events.emit(
            catalogue.COMPILE_AHEAD,
            devices=layout.mesh.size,
            micro_steps=layout.batch.micro_steps,
            seconds=round(time.perf_counter() - started, 3),
        )

    def _evict(self) -> None:
        while len(self.layouts) > MAX_LAYOUTS:  # many distinct slice sets: drop the least recently used
            del self.layouts[next(iter(self.layouts))]

    def close(self) -> None:
        """Stop compiling ahead (a compile in progress finishes; none queued starts)."""
        self.ahead.close()

    def __call__(
        self, slices: list[list], parts: AttemptParts | None = None, *, not_after: int | None = None
    ) -> Attempt:
        """Everything one attempt needs, on the mesh over `slices` (the active ones), fresh except the layout.

        `parts`: what the cluster adds (`AttemptParts`: the snapshot source, the step's and the replay
        check's wrappers, Orbax's multiprocessing options and barrier); none given: none of them.
        `not_after`: restore the newest saved state of at most this step (a rollback to a verified state).
        """
        parts = parts or AttemptParts()
        stack = contextlib.ExitStack()
        try:
            key = slice_set_key(slices)
            self.ahead.prefer(d for s in key for d in s)  # survivors' sets first: the next resize's
            with self._lock:
                layout = self.layouts.get(key)
            layout = layout or slice_layout(self.spec, slices)
            # Data first: a bad dataset or tokenizer must stop the run before any compile or device work.
            iterator, eval_iterator = self._iterators(layout, stack)
            layout = self._compiled(key, layout)
            checkpointer = self._checkpointer(stack, parts.checkpoint_multiprocessing, parts.checkpoint_barrier)
            restored = self._restore(layout, checkpointer, parts.snapshots, not_after)
            if restored.data_state is not None:
                iterator.set_state(restored.data_state)
            layout = self._with_base(layout)
            step_fn = layout.step_fn if parts.wrap_step is None else parts.wrap_step(layout.step_fn)
            evaluator = self._evaluator(layout, eval_iterator)
            attempt = self._attempt(layout, restored, step_fn, iterator, checkpointer, evaluator, stack)
            sdc_fn = attempt.sdc_fn
            if parts.wrap_replay is not None and sdc_fn is not None:
                sdc_fn = parts.wrap_replay(sdc_fn)
            return dataclasses.replace(attempt, num_slices=len(slices), sdc_fn=sdc_fn)
        except BaseException:
            stack.close()
            raise

    def _iterators(self, layout: SliceLayout, stack: contextlib.ExitStack) -> tuple[Any, Any]:
        """The train iterator and, with eval on, the eval iterator (rewound before every evaluation,
        never checkpointed), on this process's rows of each global batch; `stack` closes them."""
        spec = self.spec
        iterator = make_train_iterator(
            spec.data,
            vocab_size=spec.model.vocab_size,
            global_batch_size=layout.batch.global_batch_size,
            process_index=layout.loader_index,
            process_count=layout.loader_count,
        )
        stack.callback(iterator.close)
        if layout.eval_batch is None:
            return iterator, None
        eval_iterator = make_eval_iterator(
            spec.data,
            spec.eval.grain_eval_files,
            vocab_size=spec.model.vocab_size,
            global_batch_size=layout.eval_batch.global_batch_size,
            process_index=layout.eval_loader[0],
            process_count=layout.eval_loader[1],
        )
        stack.callback(eval_iterator.close)
        return iterator, eval_iterator

    def _compiled(self, key: tuple, layout: SliceLayout) -> SliceLayout:
        """The slice set's layout with its compiled steps: the cached one (`compile_cached`), else `layout`
        compiled now and kept (`compile_done`)."""
        ahead = self.ahead.pending(key)
        if ahead is not None:
            with self.phases.enter("compile"):
                ahead.result()  # compiling in the background right now: wait for it, do not compile twice
        with self._lock:
            cached = self.layouts.pop(key, None)
            if cached is not None:
                self.layouts[key] = cached  # most recently used
        if cached is not None:
            self.events.emit(
                catalogue.COMPILE_CACHED, devices=cached.mesh.size, micro_steps=cached.batch.micro_steps
            )
            return cached
        with self.phases.enter("compile"):
            layout = layout.compiled(self.spec)
        with self._lock:
            self.layouts[key] = layout
            self._evict()
        self.events.emit(
            catalogue.COMPILE_DONE,
            seconds=round(layout.compile_s, 3),
            eval_seconds=round(layout.eval_compile_s, 3),
            devices=layout.mesh.size,
            micro_steps=layout.batch.micro_steps,
        )
        return layout

    def _with_base(self, layout: SliceLayout) -> SliceLayout:
        """The layout as this attempt runs it: with a frozen model (LoRA's base, DPO's reference), its compiled
        steps bound to it, read onto this mesh (load_parameters_path, else initialised from init_weights_seed)
        once per attempt and held by the bound steps only (never saved, never taken from the trained state).
        Otherwise: as is."""
        if layout.abstract_base is None:
            return layout
        spec = self.spec
        with self.phases.enter("restore"):
            if spec.checkpoint.load_parameters_path:
                from trainer.checkpoint import load_parameters

                base = load_parameters(spec.checkpoint.load_parameters_path, layout.abstract_base)
            else:
                base = init_base(spec.model, layout.base_shardings, seed=spec.init_weights_seed)
            jax.block_until_ready(base)

        def bound(fn):
            return None if fn is None else partial(_with_third, fn, base)

        return dataclasses.replace(
            layout, step_fn=bound(layout.step_fn), eval_fn=bound(layout.eval_fn), sdc_fn=bound(layout.sdc_fn)
        )

    def _checkpointer(self, stack: contextlib.ExitStack, multiprocessing, barrier):
        """A fresh checkpointer (advancing the save fence); `stack` closes it."""
        checkpointer = open_checkpointer(
            self.checkpoint_dir,
            self.spec.checkpoint,
            on_event=self.events,
            multiprocessing=multiprocessing,
            barrier_sync_fn=barrier,
            fence=self.fence,
            storage_faults=self.storage_faults,
            due=self.checkpoint_due,
        )
        # A normal finish has already waited for its saves; after a failure, settle an in-flight save
        # for a bounded time (Orbax finishes or fails it in the background; it never counts until
        # committed).
        close_s = CLOSE_TIMEOUT_S if multiprocessing is None else MULTIPROCESS_CLOSE_TIMEOUT_S
        stack.callback(partial(checkpointer.close, timeout_s=close_s))
        return checkpointer

    def _restore(
        self, layout: SliceLayout, checkpointer, snapshots: SnapshotSource | None, not_after: int | None = None
    ) -> Restored:
        """The train state by the one restore order (`trainer.attempt.restore`), on the devices."""
        spec = self.spec
        t0 = time.perf_counter()
        self.events.emit(catalogue.RESTORE_START)
        with self.phases.enter("restore"):
            restored = restore_state(
                layout.abstract_state,
                checkpoints=checkpointer,
                snapshots=snapshots,
                load_full_state_path=spec.checkpoint.load_full_state_path,
                # A LoRA run's load_parameters_path is its frozen base (`_with_base`), not what trains.
                load_parameters_path=""
                if layout.abstract_base is not None
                else spec.checkpoint.load_parameters_path,
                fresh_state=partial(self._fresh_state, layout),
                not_after=not_after,
            )
            jax.block_until_ready(restored.state)
        seconds = round(time.perf_counter() - t0, 4)
        self.events.emit(
            catalogue.RESTORE_END, source=restored.label, seconds=seconds, bytes=tree_nbytes(restored.state)
        )
        return restored

    def _attempt(
        self, layout: SliceLayout, restored: Restored, step_fn, iterator, checkpointer, evaluator, stack
    ) -> Attempt:
        spec, batch = self.spec, layout.batch
        start_step = int(jax.device_get(restored.state["step"]))
        _log_ready(layout, start_step, restored.label)
        length = spec.data.max_target_length
        return Attempt(
            mesh=layout.mesh,
            batch_layout=batch,
            state=restored.state,
            start_step=start_step,
            restored_from=restored.label,
            step_fn=step_fn,
            batch_sharding=layout.batch_sharding,
            iterator=iterator,
            checkpointer=checkpointer,
            flops_per_step=model.training_flops_per_token(spec.model, length) * batch.global_batch_size * length,
            sequence_length=length,
            checkpoint_metadata=self._metadata(layout),
            stack=stack,
            evaluator=evaluator,
            sdc_fn=layout.sdc_fn,
        )

    def _metadata(self, layout: SliceLayout) -> dict:
        """What each saved step records besides its state: the run config, the mesh and batch layout, and a
        LoRA run's base identity (`trainer.checkpoint.base_identity`, checked before a resume compiles)."""
        spec, batch = self.spec, layout.batch
        metadata = {
            "config": spec.config_record,
            "mesh": dict(layout.mesh.shape),
            "global_batch_size": batch.global_batch_size,
            "micro_steps": batch.micro_steps,
        }
        if layout.abstract_base is not None:
            from trainer.checkpoint import base_identity

            metadata[base_identity.RECORD_KEY] = base_identity.base_record(
                spec.checkpoint.load_parameters_path, spec.init_weights_seed
            )
        return metadata

    def _evaluator(self, layout: SliceLayout, iterator) -> Evaluator | None:
        if iterator is None:
            return None
        ev = self.spec.eval
        sharding = layout.batch_sharding
        return Evaluator(
            eval_fn=layout.eval_fn,
            iterator=iterator,
            device_batch=lambda b: {k: jax.make_array_from_process_local_data(sharding, v) for k, v in b.items()},
            schedule=EvalSchedule(ev.eval_interval, ev.eval_start_step, self.spec.steps),
            batches=ev.eval_steps,
            target_loss=ev.target_eval_loss,
        )

    def _fresh_state(self, layout: SliceLayout, params=None) -> dict:
        if params is None:
            return init_state(
                self.spec.model,
                layout.optimizer,
                layout.shardings,
                seed=self.spec.init_weights_seed,
                lora=self.spec.lora,
            )
        return state_around(params, layout.optimizer, layout.shardings)


def _with_third(fn: Callable, base, first, batch):
    """`fn(first, batch, base)`: a LoRA step bound to its base, called as the full-training step is."""
    return fn(first, batch, base)


def _log_ready(layout: SliceLayout, start_step: int, source: str) -> None:
    batch = layout.batch
    log.debug(  # the attempt_start event says it to people
        "attempt ready: mesh=%s global_batch=%d micro_steps=%d lr_scale=%.3f start_step=%d source=%s "
        "loader_shard=%d/%d",
        dict(layout.mesh.shape),
        batch.global_batch_size,
        batch.micro_steps,
        batch.lr_scale,
        start_step,
        source,
        layout.loader_index,
        layout.loader_count,
    )
