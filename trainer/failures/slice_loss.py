"""Slice loss: a slice of one controller's (virtual) slices fails mid-step.

Schedule entries (`fault_schedule`):

    step=N,slice=K[,down_s=S][,down_steps=M]       slice K fails step N; back after S seconds and M more steps
    rate=R,seed=S[,slice=K][,down_s=D][,step=N]    seeded Poisson failures, R per second of wall time

Besides the schedule, `trainer.chaos` asks a live trainer to lose a slice (a request file in the run's
chaos directory, `trainer.failures.chaos_requests`).

A failure marks a slice down until its down time has passed. The step that next runs on a down slice
fails with `jax.errors.JaxRuntimeError("DATA_LOSS: ...")`, the error Pathways raises when a slice is
lost mid-computation, so pathwaysutils' classifier and the same recovery path handle it.

A `rate=` source fails slices at exponential gaps of mean 1/R seconds of wall time, counted from the
boundary before step N (default 1), on slice K or a seeded random slice. Each failure fires at the first
step boundary at or after its time, so one that falls in a recovery kills that recovery's first step, as
a real failure would; several due at one boundary are one recovery. `python -m trainer.plan` models the
same rule, which is how `benchmarks/goodput_planner.py` checks it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax

from trainer.failures.chaos_requests import attempt_of, names_attempt
from trainer.failures.kind import SLICES, FailureKind, Fields, Injection, InjectionContext, Kill, entry_error
from trainer.io.jsonl import read_jsonl
from trainer.observe import catalogue

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SliceLoss:
    """Slice `slice` fails step `step` and stays down `down_s` seconds and `down_steps` more steps."""

    step: int
    slice: int
    down_s: float = 0.0
    down_steps: int = 0


@dataclasses.dataclass(frozen=True)
class RandomSliceLoss:
    """Failures at exponential gaps of mean 1/`rate` seconds from the boundary before `step`, on `slice`
    (-1: a seeded random one of `slices`), each down `down_s` seconds; `seed` replays them exactly."""

    rate: float
    seed: int
    slices: int
    slice: int = -1
    down_s: float = 0.0
    step: int = 1


def parse(entry: str, fields: Fields, num_slices: int) -> SliceLoss | RandomSliceLoss:
    fault = _random(entry, fields, num_slices) if "rate" in fields else _fixed(entry, fields)
    if fault.slice >= num_slices:
        raise entry_error(entry, f"slice must be in [0, {num_slices})")
    return fault


def _fixed(entry: str, fields: Fields) -> SliceLoss:
    if set(fields) - {"step", "slice", "down_s", "down_steps"} or not {"step", "slice"} <= set(fields):
        raise entry_error(entry, "a slice failure is step=N,slice=K[,down_s=S][,down_steps=M] or rate=R,seed=S")
    try:
        step, slice_index = int(fields["step"]), int(fields["slice"])
        fault = SliceLoss(step, slice_index, float(fields.get("down_s", 0)), int(fields.get("down_steps", 0)))
    except ValueError:
        raise entry_error(entry, "step and slice are integers, down_s seconds") from None
    if fault.slice < 0 or fault.step < 1 or fault.down_s < 0:
        raise entry_error(entry, "slice must be >= 0, step >= 1, down_s >= 0")
    return fault


def _random(entry: str, fields: Fields, num_slices: int) -> RandomSliceLoss:
    if set(fields) - {"rate", "seed", "slice", "down_s", "step"} or "seed" not in fields:
        raise entry_error(
            entry,
            "a random source is rate=R,seed=S[,slice=K][,down_s=D][,step=N] (R failures per second, S an "
            "integer seed)",
        )
    try:
        fault = RandomSliceLoss(
            float(fields["rate"]),
            int(fields["seed"]),
            num_slices,
            int(fields.get("slice", -1)),
            float(fields.get("down_s", 0)),
            int(fields.get("step", 1)),
        )
    except ValueError:
        raise entry_error(entry, "rate and down_s are numbers, seed, slice and step integers") from None
    if not (0 < fault.rate < float("inf")) or fault.step < 1 or fault.down_s < 0 or fault.slice < -1:
        raise entry_error(
            entry,
            "rate must be a finite number > 0 (failures per second), step >= 1, down_s >= 0, slice >= 0 (or "
            "left out for a random slice)",
        )
    return fault


class PoissonFaults:
    """Failure times of one `rate=` entry: exponential gaps from the first boundary at or past its step,
    on the wall clock the outages use, seeded so a schedule replays exactly."""

    def __init__(self, fault: RandomSliceLoss):
        self.fault = fault
        self.rng = random.Random(fault.seed)
        self.next_at: float | None = None

    def due(self, next_step: int, now: float) -> list[Kill]:
        """Every failure whose time has come by `now`."""
        if next_step < self.fault.step:
            return []
        if self.next_at is None:
            self.next_at = now + self.rng.expovariate(self.fault.rate)
        out = []
        while now >= self.next_at:
            victim = self.fault.slice if self.fault.slice >= 0 else self.rng.randrange(self.fault.slices)
            cause = f"fault_schedule rate={self.fault.rate:g},seed={self.fault.seed}"
            out.append(Kill(victim, self.fault.down_s, cause))
            self.next_at += self.rng.expovariate(self.fault.rate)
        return out


class Outages:
    """Which virtual slices are down, and until when (injectable clock)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.steps_run = 0  # steps the job has started, advanced by the injector at step boundaries
        self._down_until: dict[int, float] = {}
        self._down_until_step: dict[int, int] = {}
        self._unreported: set[int] = set()

    def mark_down(self, slice_index: int, down_s: float, down_steps: int = 0) -> None:
        """The slice fails the next step that uses it (even with down_s=0) and stays unhealthy for down_s
        seconds and until down_steps more steps have run (on the surviving slices)."""
        self._down_until[slice_index] = self.clock() + down_s
        self._down_until_step[slice_index] = self.steps_run + down_steps
        self._unreported.add(slice_index)

    def take_failures(self, slices: Iterable[int]) -> list[int]:
        """Slices among `slices` that must fail the current step: down now, or killed since last asked."""
        failed = sorted(set(self.down(slices)) | (self._unreported & set(slices)))
        self._unreported -= set(failed)
        return failed

    def is_down(self, slice_index: int) -> bool:
        until = self._down_until.get(slice_index)
        if until is None:
            return False
        return self.clock() < until or self.steps_run < self._down_until_step[slice_index]

    def down(self, slices: Iterable[int]) -> list[int]:
        return [s for s in slices if self.is_down(s)]


def slice_down_error(slices: list[int], how: str) -> jax.errors.JaxRuntimeError:
    return jax.errors.JaxRuntimeError(f"DATA_LOSS: slice(s) {slices} lost during the step ({how})")


class SliceLossInjection(Injection):
    """Scheduled, random and requested slice failures: due at step boundaries, felt by the next step that
    runs on the slice. A chaos request is honoured only by the process it names (see `_stale`), never by a
    later run."""

    def __init__(self, faults: tuple, context: InjectionContext):
        self.pending = sorted((f for f in faults if isinstance(f, SliceLoss)), key=lambda f: f.step)
        self.random_sources = [PoissonFaults(f) for f in faults if isinstance(f, RandomSliceLoss)]
        self.outages = context.outages
        self.chaos_dir = context.chaos_dir
        self.events = context.events
        self.last_cause = ""
        self._last_step = 1
        self._own_attempt: dict | None = None  # see _attempt

    def at_boundary(self, next_step: int) -> list[Kill]:
        if next_step != self._last_step:
            self.outages.steps_run += 1
        self._last_step = next_step
        due = []
        while self.pending and self.pending[0].step <= next_step:
            f = self.pending.pop(0)
            due.append(Kill(f.slice, f.down_s, f"fault_schedule step={f.step}", f.down_steps))
        for source in self.random_sources:
            due += source.due(next_step, self.outages.clock())
        return due + self._chaos_requests()

    def fire(self, kill: Kill, step: int) -> None:
        self.outages.mark_down(kill.slice, kill.down_s, kill.down_steps)
        self.last_cause = kill.cause
        self.events.emit(
            catalogue.SLICE_KILLED,
            slice=kill.slice,
            step=step,
            down_s=kill.down_s,
            down_steps=kill.down_steps,
            cause=kill.cause,
        )

    def before_step(self, step: int, state, batch, slices: Mapping[int, list]):
        down = self.outages.take_failures(list(slices))
        if down:
            raise slice_down_error(down, self.last_cause or "slice down")
        return batch

    def _chaos_requests(self) -> list[Kill]:
        """A kill of each new request in chaos_dir meant for this process; every request read is renamed
        (.done, or .ignored when stale) so it is read once."""
        if self.chaos_dir is None or not self.chaos_dir.is_dir():
            return []
        out = []
        for entry in sorted(os.scandir(self.chaos_dir), key=lambda e: e.name):
            if not entry.name.endswith(".json"):
                continue
            path = Path(entry.path)
            try:
                request = json.loads(path.read_text())
                kill = Kill(int(request["slice"]), float(request.get("down_s", 0)), f"chaos {path.name}")
            except (ValueError, KeyError, TypeError, OSError) as e:
                log.error("ignoring unreadable chaos request %s: %s", path, e)
                path.rename(path.with_suffix(".done"))
                continue
            stale = self._stale(request, path)
            if stale:
                log.warning("ignoring chaos request %s: %s", path, stale)
                path.rename(path.with_suffix(".ignored"))
                continue
            out.append(kill)
            path.rename(path.with_suffix(".done"))
        return out

    def _stale(self, request: dict, path: Path) -> str:
        """Why a request is not for this process ("" when it is). The run directory outlives its processes:
        a request the previous attempt never read must not kill the run resumed in the same directory.
        `trainer.chaos` names the attempt it validated as live (its start event's pid and time); a request
        written by hand, without a target, counts when it is newer than this process's start event."""
        mine = self._attempt()
        if "target" in request:
            if names_attempt(request, mine):
                return ""
            if mine is None:
                return f"it is for the trainer attempt {request['target']}; this process wrote no start event here"
            return (
                f"it is for the trainer attempt {request['target']}, not this one {mine}: left by an earlier "
                f"run of this directory"
            )
        if mine is not None and path.stat().st_mtime < mine["started"]:
            return f"written before this process started ({mine}): left by an earlier run of this directory"
        return ""

    def _attempt(self) -> dict | None:
        """This process's identity as `trainer.chaos` sees it: its last start event in the run's events.jsonl
        (the chaos directory's parent), or None outside a run directory. Read only once a request exists."""
        if self._own_attempt is None:
            events = read_jsonl(self.chaos_dir.parent / "events.jsonl")
            mine = [e for e in events if e.get("event") == catalogue.START and e.get("pid") == os.getpid()]
            self._own_attempt = attempt_of(mine[-1]) if mine else None
        return self._own_attempt


KIND = FailureKind(
    name="slice_loss",
    keys=frozenset({"down_s", "down_steps", "rate", "seed"}),
    parse=parse,
    faults=(SliceLoss, RandomSliceLoss),
    grammar="step=N,slice=K[,down_s=S][,down_steps=M] | rate=R,seed=S[,slice=K][,down_s=D][,step=N]",
    scope=SLICES,
    injection=SliceLossInjection,  # always: outside requests need it even with nothing scheduled
    injected_by="trainer.failures.slice_loss:SliceLossInjection",
    detected_by="trainer.elastic.cluster:Cluster.slice_down_cause",
    outcome="the attempt ends; the supervisor waits for slices and restores the newest state (elastic_enabled)",
    events=(catalogue.SLICE_KILLED, catalogue.SLICE_DOWN_DETECTED, catalogue.ATTEMPT_START),
    goodput_cause="wasted_progress",
    planner_term="trainer.plan.model:expected",
    fallback=True,  # step=N,slice=K carries no key of its own
)
