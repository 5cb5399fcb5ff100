"""Silent-data-corruption check (`sdc_check_period`): a chip that computes wrong numbers, or a replica
whose copy of the parameters changed, is caught and its slice named.

Every `period` steps, before the step runs (its input state is still there: the step donates it):

1. The replicas are compared. Data-parallel replicas hold the same parameters bit for bit; each computes
   a digest of its own copy (`replica_digests`: per leaf, the wrapping sum of its bit patterns, so any
   flipped bit changes it), and a replica that differs from the majority names its slice (with two
   slices both are suspects). This finds a memory fault that already landed, at any step since the
   last check.
2. The step is replayed. Each data-parallel replica computes its part of the step twice from the same
   state and batch (`trainer.program.step.make_replica_checksums`: the objective's parts and every
   gradient leaf's sum, before the reduction across replicas): once on its own rows, once with the batch
   rotated by one slice, so that each slice computes the next slice's rows. Steps are bitwise
   deterministic, so on healthy devices the two results for any rows are equal bit for bit wherever
   they were computed. Rows whose results differ were computed by their own slice in one run and by the
   previous slice in the other; the slice common to every mismatch is the suspect (with two slices both
   are). This finds a chip computing wrong numbers at the checked step.

A mismatch emits `sdc_detected` and the loop returns a rollback to the newest state verified clean: the
state after the step before the last check that passed (`SdcCheck.verified_step`), not merely the newest
one saved (with `sdc_quarantine` the suspect slice is treated as lost first). What the check cannot see:
a one-shot wrong gradient at an unchecked step is summed into every replica's update, so the replicas
stay identical and no later replay finds it; only a fault that persists until a check (a bad chip), or
one that makes the replicas differ, is found. The check costs about two steps' forward and backward
passes and one pass over the parameters per `period` steps; each checked step's record carries it as
`sdc_check_s`, which goodput counts as its own cause.

A rollback is bounded (`RollbackGuard`): a detection that blames devices the last rollback blamed, at or
before that rollback's step (the replay from the verified state met the same fault again, with no
progress past it), means the corruption persists on those devices, a broken chip, and rolling back again
would loop. The run stops with `SdcPersists` (exit 3, `gave_up`) and the event `sdc_persists` naming the
step, the devices, their processes and the fix: replace or drain the hosts of those processes. A
detection after the run got past the last rollback's step, or one on other devices (with
`sdc_quarantine` the blamed slice is out of service after a rollback), is a fresh incident and rolls back.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from trainer.errors import GaveUp
from trainer.observe import catalogue

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """`slices`: the slices whose rows' results differ between the two runs; `suspects`: the slice(s)
    every mismatch implicates (empty: no mismatch)."""

    slices: tuple[int, ...]
    suspects: tuple[int, ...]


def rotate(host_batch: dict[str, np.ndarray], slices: int) -> dict[str, np.ndarray]:
    """The batch with each slice's rows moved to the previous slice (slice s gets slice s+1's rows): the
    batch's rows are laid out over the data axis slice by slice."""
    rows = next(iter(host_batch.values())).shape[0]
    return {k: np.roll(v, -(rows // slices), axis=0) for k, v in host_batch.items()}


def compare(original: np.ndarray, rotated: np.ndarray, slices: int) -> Verdict:
    """`original[r]`: replica r's results on its own rows; `rotated[r]`: on the rows of the replica one
    slice later. Compared bit for bit, per replica's rows."""
    per_slice = original.shape[0] // slices
    aligned = np.roll(rotated, per_slice, axis=0)  # aligned[r]: rows of replica r, by the previous slice
    a, b = np.ascontiguousarray(original).view(np.uint32), np.ascontiguousarray(aligned).view(np.uint32)
    bad = sorted({r // per_slice for r in range(original.shape[0]) if not np.array_equal(a[r], b[r])})
    if not bad:
        return Verdict((), ())
    suspects = set.intersection(*({s, (s - 1) % slices} for s in bad))
    return Verdict(tuple(bad), tuple(sorted(suspects)))


def _leaf_digest(x: jax.Array) -> jax.Array:
    """The wrapping uint32 sum of `x`'s bit patterns: exact and order-free, and any one flipped bit
    changes it."""
    width = jnp.dtype(x.dtype).itemsize * 8
    if width > 32 or width not in (8, 16, 32):
        x = x.astype(jnp.float32)
        width = 32
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}")).astype(jnp.uint32)
    return jnp.sum(bits, dtype=jnp.uint32)


def replica_digests(mesh: Mesh, axis: str = "data") -> Callable:
    """`digests(params) -> uint32 [replicas, leaves]`: each data-parallel replica's digest of its own copy
    of the parameters (their shardings replicate them over `axis`), row r from replica r."""

    def per_replica(params):
        row = jnp.stack([_leaf_digest(leaf) for leaf in jax.tree.leaves(params)])
        return jax.lax.all_gather(row, axis)

    if mesh.shape.get(axis, 1) == 1:
        return jax.jit(lambda params: jnp.stack([_leaf_digest(leaf) for leaf in jax.tree.leaves(params)])[None])
    return jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=PartitionSpec(),
            out_specs=PartitionSpec(),
            axis_names={axis},
            check_vma=False,
        )
    )


def odd_replicas(digests: np.ndarray, slices: int) -> Verdict:
    """The slices whose replicas' digests differ from the majority's (all that differ when no digest is
    held by more than half of the replicas)."""
    per_slice = digests.shape[0] // slices
    rows = [d.tobytes() for d in np.ascontiguousarray(digests)]
    counts = {r: rows.count(r) for r in rows}
    if len(counts) == 1:
        return Verdict((), ())
    common, n = max(counts.items(), key=lambda kv: kv[1])
    majority = common if n * 2 > len(rows) else None
    if majority is None:
        bad = sorted({r // per_slice for r in range(len(rows))})
    else:
        bad = sorted({r // per_slice for r, row in enumerate(rows) if row != majority})
    return Verdict(tuple(bad), tuple(bad))


def slice_devices(mesh: Mesh, slices: int, suspects: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(device id, process index) of every device of the `suspects` slices of `mesh`, whose data axis (the
    first) lays the `slices` out slice by slice, sorted by device id."""
    per_slice = mesh.devices.reshape(slices, -1)
    return tuple(sorted((d.id, d.process_index) for s in suspects for d in per_slice[s]))


class SdcPersists(GaveUp):
    """The check found corruption again on the devices the last rollback blamed, before the run got past
    that rollback's step: rolling back again would loop (exit 3)."""


@dataclasses.dataclass(frozen=True)
class Incident:
    """A detection that rolled the run back: the step checked and the (device id, process index) blamed."""

    step: int
    devices: tuple[tuple[int, int], ...]


def persists(last: Incident | None, new: Incident) -> bool:
    """Whether `new` is `last` again: it blames one of the same devices at or before `last`'s step (the
    replay from the verified state hit it again without getting past it). Progress past that step, or a
    detection on other devices only, is a fresh incident."""
    if last is None:
        return False
    same = {d for d, _ in last.devices} & {d for d, _ in new.devices}
    return bool(same) and new.step <= last.step


class RollbackGuard:
    """Remembers the last rollback an SDC detection caused and ends the run (`SdcPersists`, event
    `sdc_persists`) when a detection repeats it (`persists`)."""

    def __init__(self, events):
        self.events = events
        self.last: Incident | None = None

    def detected(self, new: Incident, slices: tuple[int, ...]) -> None:
        """A detection at `new.step` blaming `slices` (their devices `new.devices`): remembered as the last
        rollback, or SdcPersists when it repeats the last one."""
        last, self.last = self.last, new
        if not persists(last, new):
            return
        devices = sorted(d for d, _ in new.devices)
        processes = sorted({p for _, p in new.devices})
        fix = (
            f"replace or drain the hosts of process(es) {processes} (the JAX process ids whose devices these "
            "are: JAX_PROCESS_ID, SLURM_PROCID or the JobSet's slice x nodes per slice + pod index), or set "
            "sdc_quarantine=true to train on without their slice; then rerun the same command to resume from "
            "the newest checkpoint"
        )
        self.events.emit(
            catalogue.SDC_PERSISTS,
            step=new.step,
            last_rollback_step=last.step,
            slices=list(slices),
            devices=devices,
            processes=processes,
            fix=fix,
        )
        raise SdcPersists(
            f"silent data corruption at step {new.step} on devices {devices} (slice(s) {list(slices)}) again "
            f"after the rollback from step {last.step} blamed them: the corruption persists on those devices; "
            f"{fix}"
        )


AUTO = -1  # sdc_check_period auto: planned from measured step and check times
WARMUP_STEPS = 5  # step times measured before an auto period is planned
PLANNED_CHECK_STEPS = 2.0  # a check's cost, in steps, until one was measured (two forward and backward passes)


class SdcCheck:
    """Runs the check at the steps it is due, reports a mismatch (`sdc_detected`) and knows the newest
    step verified clean (`verified_step`: the state the last passing check started from).

    `period` > 0: every `period` steps (at multiples of it). AUTO: `plan(step_s, check_s) -> period` is
    asked once WARMUP_STEPS step times are measured (the median of the recent ones; a check's cost is
    taken as PLANNED_CHECK_STEPS steps until one ran on a mesh whose programs were already compiled) and
    again after each check; the check is due `period` steps after the previous one (or after the
    attempt's start). Event `sdc_period_planned`."""

    def __init__(
        self,
        period: int,
        events,
        *,
        plan: Callable[[float, float], int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if period == AUTO and plan is None:
            raise ValueError("an auto sdc_check_period needs a plan")
        self.period = period
        self.events = events
        self.plan = plan
        self.clock = clock
        self.verified_step: int | None = None
        self.guard = RollbackGuard(events)
        self._digests: dict[Mesh, Callable] = {}
        self._planned = 0  # AUTO: the period in use (0: not planned yet)
        self._since = 0  # AUTO: the step of the last check, or of the attempt's start
        self._step_times: collections.deque[float] = collections.deque(maxlen=50)
        self._check_s: float | None = None

    @classmethod
    def off(cls, events) -> SdcCheck:
        """The check of `sdc_check_period=0`: never due."""
        return cls(0, events)

    def attempt_started(self, start_step: int) -> None:
        """An attempt starts from `start_step`: its state is the one the run goes on from, and no state after
        it is verified any more (it is computed again)."""
        if self.verified_step is None or self.verified_step > start_step:
            self.verified_step = start_step
        self._since = start_step

    def step_timed(self, step: int, seconds: float) -> None:
        """A step's measured time (its metrics record): what an auto period is planned from."""
        if self.period != AUTO:
            return
        self._step_times.append(seconds)
        if not self._planned and len(self._step_times) >= WARMUP_STEPS:
            self._replan(step)

    def _replan(self, step: int) -> None:
        step_s = statistics.median(self._step_times)
        check_s = PLANNED_CHECK_STEPS * step_s if self._check_s is None else self._check_s
        period = max(1, int(self.plan(step_s, check_s)))
        if period != self._planned:
            self._planned = period
            self.events.emit(
                catalogue.SDC_PERIOD_PLANNED,
                step=step,
                period=period,
                step_s=round(step_s, 6),
                check_s=round(check_s, 6),
                measured=self._check_s is not None,
            )

    def due(self, step: int, slices: int) -> bool:
        """Whether `step` is checked (on one slice there is nothing to compare)."""
        if slices < 2 or self.period == 0:
            return False
        if self.period > 0:
            return step % self.period == 0
        return self._planned > 0 and step - self._since >= self._planned

    def __call__(self, attempt, params, host_batch: dict[str, np.ndarray], step: int) -> tuple[Verdict, float]:
        """Check `step` (not yet run) from `params` and its batch; returns the verdict and its seconds."""
        t0 = self.clock()
        slices = attempt.num_slices
        fresh = attempt.mesh not in self._digests  # its programs compile now: the time is not a check's
        digests = self._digests.setdefault(attempt.mesh, replica_digests(attempt.mesh))
        verdict, kind = odd_replicas(np.asarray(jax.device_get(digests(params))), slices), "replicas_differ"
        if not verdict.slices:
            original = attempt.sdc_fn(params, attempt.device_batch(host_batch))
            rotated = attempt.sdc_fn(params, attempt.device_batch(rotate(host_batch, slices)))
            original, rotated = (np.asarray(x) for x in jax.device_get((original, rotated)))
            verdict, kind = compare(original, rotated, slices), "replay_differs"
        seconds = self.clock() - t0
        self._since = step
        if not fresh:
            self._check_s = seconds
        if self.period == AUTO and self._step_times:
            self._replan(step)
        if not verdict.slices:
            self.verified_step = step - 1
            return verdict, seconds
        self.events.emit(
            catalogue.SDC_DETECTED,
            step=step,
            slices=list(verdict.suspects),
            mismatched=list(verdict.slices),
            kind=kind,
            verified_step=self.verified_step,
            seconds=round(seconds, 4),
        )
        log.error(
            "silent data corruption at step %d (%s): slices %s differ; suspect slice(s) %s; newest state "
            "verified clean: step %s",
            step,
            kind.replace("_", " "),
            list(verdict.slices),
            list(verdict.suspects),
            self.verified_step,
        )
        blamed = Incident(step, slice_devices(attempt.mesh, slices, verdict.suspects))
        self.guard.detected(blamed, verdict.suspects)  # SdcPersists: the last rollback's fault again
        return verdict, seconds
