"""Silent data corruption: a slice's devices compute wrong numbers, or its copy of the state changes.

    step=N,slice=K,corrupt=1           slice K's devices compute on wrong numbers in step N, once per run
    step=N,slice=K,corrupt=persistent  ... in every step from N on (a bad chip)
    step=N,slice=K,flip=1              a bit of slice K's copy of the parameters flips after step N's
                                       update, once per run (a memory fault: the replicas diverge)

The faults act on the device buffers of the slice's devices and nothing else, the layer where silent data
corruption arises: the programs that run there (the train step, the replay check of
`trainer.attempt.sdc`) compute on what those devices hold, and every detector sees only what the devices
computed.

- `wrong_inputs`: the slice's devices read different token ids than the batch holds (a chip that
  computes wrong numbers: its gradients are wrong, and the cross-replica sum spreads them to every
  replica, so the replicas stay identical);
- `flip_bits`: one mantissa bit of the first element of each of the slice's parameter shards flips (a
  memory fault: that slice's copy of the parameters differs from the other replicas' from then on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from trainer.failures.kind import SLICES, FailureKind, Fields, Injection, InjectionContext, entry_error
from trainer.observe import catalogue

CAUSE = "silent_data_corruption"  # a rollback's cause (trainer.attempt.outcome.Rollback)


@dataclasses.dataclass(frozen=True)
class Corruption:
    """Slice `slice`'s devices compute on wrong numbers in step `step` (from `step` on when `persistent`)."""

    step: int
    slice: int
    persistent: bool = False


@dataclasses.dataclass(frozen=True)
class MemoryFlip:
    """A bit of slice `slice`'s copy of the parameters flips after step `step`'s update."""

    step: int
    slice: int


def parse(entry: str, fields: Fields, num_slices: int) -> Corruption | MemoryFlip:
    kind = "corrupt" if "corrupt" in fields else "flip"
    values = ("1", "persistent") if kind == "corrupt" else ("1",)
    try:
        if set(fields) != {"step", "slice", kind} or fields[kind] not in values:
            raise ValueError
        step, slice_index = int(fields["step"]), int(fields["slice"])
    except ValueError:
        raise entry_error(
            entry,
            "silent data corruption is step=N,slice=K,corrupt=1, step=N,slice=K,corrupt=persistent or "
            "step=N,slice=K,flip=1 (N, K integers)",
        ) from None
    if step < 1 or slice_index < 0:
        raise entry_error(entry, "step must be >= 1 and slice >= 0")
    if slice_index >= num_slices:
        raise entry_error(entry, f"slice must be in [0, {num_slices})")
    if kind == "flip":
        return MemoryFlip(step, slice_index)
    return Corruption(step, slice_index, persistent=fields[kind] == "persistent")


# ---- what lands on the devices ---------------------------------------------------------------------------


def on_devices(x: jax.Array, devices: Collection, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`x` with `fn` applied to its shards on `devices` (each on its own device), every other shard as is."""
    chosen = set(devices)
    if not any(s.device in chosen for s in x.addressable_shards):
        return x
    shards = [jax.device_put(fn(s.data), s.device) if s.device in chosen else s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


def _other_token(ids: jax.Array) -> jax.Array:
    return jnp.where(ids > 0, ids - 1, ids + 1).astype(ids.dtype)


def wrong_inputs(batch: dict, devices: Collection) -> dict:
    """`batch` (device arrays) as the devices in `devices` would compute on it with a fault: every token id
    they hold is off by one (still a valid id)."""
    return {k: on_devices(v, devices, _other_token) if k == "inputs" else v for k, v in batch.items()}


def _flip_first(x: jax.Array) -> jax.Array:
    """`x` with one bit of its first element flipped: the mantissa bit worth 1/8 of the leading digit."""
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or x.size == 0:
        return x
    bits = jnp.dtype(f"uint{dtype.itemsize * 8}")
    mask = np.array(1 << (jnp.finfo(dtype).nmant - 3), dtype=bits)
    first = (0,) * x.ndim
    flipped = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x[first], bits) ^ mask, dtype)
    return x.at[first].set(flipped)


def flip_bits(params, devices: Collection):
    """`params` (device arrays) with a bit of the first element of each shard flipped on `devices` only."""
    return jax.tree.map(lambda p: on_devices(p, devices, _flip_first), params)


# ---- the injector --------------------------------------------------------------------------------------


class CorruptionInjection(Injection):
    """Wrong numbers on a slice's devices in the step and in its replay check; a memory fault after a step."""

    def __init__(self, faults: tuple, context: InjectionContext):
        self.corrupt = [f for f in faults if isinstance(f, Corruption)]
        self.flips = {f.step: f.slice for f in faults if isinstance(f, MemoryFlip)}
        self.context = context
        self._corrupting: dict[int, int] = {}  # one-shot corruptions under way: step -> slice (this attempt)

    def attempt_started(self) -> None:
        self._corrupting.clear()  # a one-shot corruption belongs to the attempt that first computed it

    def corrupting(self, step: int, where: str) -> int | None:
        """The slice whose devices compute wrong numbers while `step` is computed (by the replay check, then
        by the step itself): a persistent fault's slice from its step on; a one-shot fault's slice the first
        time the run computes its step (both the check and the step of that attempt), never again."""
        once, emit = self.context.once_per_run, self.context.events.emit
        for f in self.corrupt:
            if f.persistent and step >= f.step:
                if once(f"corrupt_from_step_{f.step}_slice_{f.slice}"):
                    emit(catalogue.SDC_INJECTED, step=step, slice=f.slice, where=where, persistent=True)
                return f.slice
        if step in self._corrupting:
            return self._corrupting[step]
        for f in self.corrupt:
            if not f.persistent and f.step == step and once(f"corrupt_at_step_{step}"):
                emit(catalogue.SDC_INJECTED, step=step, slice=f.slice, where=where)
                self._corrupting[step] = f.slice
                return f.slice
        return None

    def _wrong(self, step: int, batch, slices: Mapping[int, list], where: str):
        bad = self.corrupting(step, where=where)
        return wrong_inputs(batch, slices[bad]) if bad is not None and bad in slices else batch

    def replay_batch(self, step: int, batch, slices: Mapping[int, list]):
        return self._wrong(step, batch, slices, "sdc_check")

    def before_step(self, step: int, state, batch, slices: Mapping[int, list]):
        return self._wrong(step, batch, slices, "step")

    def after_step(self, step: int, state, metrics: dict, slices: Mapping[int, list]):
        self._corrupting.pop(step, None)  # the step computed it: a replay of the step is clean
        bad = self.flips.get(step)
        if bad is None or bad not in slices or not self.context.once_per_run(f"flip_at_step_{step}"):
            return state, metrics
        self.context.events.emit(catalogue.SDC_INJECTED, step=step, slice=bad, where="memory")
        return dict(state, params=flip_bits(state["params"], slices[bad])), metrics


def injection(faults: tuple, context: InjectionContext) -> CorruptionInjection | None:
    return CorruptionInjection(faults, context) if faults else None


KIND = FailureKind(
    name="silent_data_corruption",
    keys=frozenset({"corrupt", "flip"}),
    parse=parse,
    faults=(Corruption, MemoryFlip),
    grammar="step=N,slice=K,corrupt=1|persistent | step=N,slice=K,flip=1",
    scope=SLICES,
    injection=injection,
    injected_by="trainer.failures.corruption:CorruptionInjection",
    detected_by="trainer.attempt.sdc:SdcCheck",
    outcome="rollback to the newest state verified clean; with sdc_quarantine the named slice is taken out",
    events=(catalogue.SDC_INJECTED, catalogue.SDC_DETECTED, catalogue.SDC_QUARANTINED, catalogue.ROLLBACK),
    goodput_cause="sdc_check",
    planner_term="trainer.plan.model:sdc_check_period",
)
