"""Slice failures on local (virtual) slices: scheduled in config or requested from outside the job.

A failure marks a slice down until its down time has passed. The step that next runs on a down slice
fails with `jax.errors.JaxRuntimeError("DATA_LOSS: ...")`, the error Pathways raises when a slice is
lost mid-computation, so pathwaysutils' classifier and the same recovery path handle it.

Besides failures at fixed steps, `fault_schedule` takes a seeded Poisson source,
`rate=R,seed=S[,slice=K][,down_s=D][,step=N]`: failures at exponential gaps of mean 1/R seconds of wall
time, counted from the boundary before step N (default 1), on slice K or a seeded random slice. Each
failure fires at the first step boundary at or after its time, so one that falls in a recovery kills
that recovery's first step, as a real failure would; several due at one boundary are one recovery.
`python -m trainer.plan` models the same rule, which is how `benchmarks/goodput_planner.py` checks it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import jax.numpy as jnp

from trainer.config.fault_schedule import Fault
from trainer.elastic.chaos_requests import attempt_of, names_attempt
from trainer.elastic.device_faults import flip_bits, wrong_inputs
from trainer.io.jsonl import read_jsonl
from trainer.observe import catalogue

log = logging.getLogger(__name__)


class PoissonFaults:
    """Failure times of one `rate=` entry: exponential gaps from the first boundary at or past its step,
    on the wall clock the outages use, seeded so a schedule replays exactly."""

    def __init__(self, fault: Fault):
        self.fault = fault
        self.rng = random.Random(fault.seed)
        self.next_at: float | None = None

    def due(self, next_step: int, now: float) -> list[tuple[int, float, str, int]]:
        """The (slice, down_s, cause, down_steps) of every failure whose time has come by `now`."""
        if next_step < self.fault.step:
            return []
        if self.next_at is None:
            self.next_at = now + self.rng.expovariate(self.fault.rate)
        out = []
        while now >= self.next_at:
            victim = self.fault.slice if self.fault.slice >= 0 else self.rng.randrange(self.fault.slices)
            cause = f"fault_schedule rate={self.fault.rate:g},seed={self.fault.seed}"
            out.append((victim, self.fault.down_s, cause, 0))
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


class FaultInjector:
    """Fires scheduled faults and `trainer.chaos` requests; fails steps that run on a down slice.

    A chaos request is honoured only by the process it names (see `_stale`), never by a later run.

    Lives for the whole run (a scheduled fault fires once, not once per attempt). The loop calls
    `at_step_boundary(next_step)` between steps; a compiled step is wrapped by `guard`.
    """

    def __init__(self, faults: list[Fault], outages: Outages, chaos_dir: Path | None, events):
        self.pending = sorted(
            (f for f in faults if not (f.nan or f.rate or f.slow_s or f.hang_s or f.spike or f.corrupt or f.flip)),
            key=lambda f: f.step,
        )
        self.stalls = {f.step: f.slow_s for f in faults if f.slow_s}  # step -> seconds the host stalls after it
        self.hangs = {f.step: f.hang_s for f in faults if f.hang_s}  # step -> seconds its dispatch blocks
        self.spikes = {f.step: f.spike for f in faults if f.spike}  # step -> factor on its loss and update
        self.corrupt = [f for f in faults if f.corrupt]  # slices whose devices compute wrong numbers
        self.flips = {f.step: f.slice for f in faults if f.flip}  # step -> the slice whose params copy changes
        self._corrupting: dict[int, int] = {}  # one-shot corruptions under way: step -> slice (this attempt)
        self.random_sources = [PoissonFaults(f) for f in faults if f.rate]
        self.nan_steps = {f.step for f in faults if f.nan}
        self.outages = outages
        self.chaos_dir = chaos_dir
        self.events = events
        self.last_cause = ""
        self.next_step = 1
        self._own_attempt: dict | None = None  # see _attempt

    def at_step_boundary(self, next_step: int, in_flight=None) -> None:
        """Fire the faults due before `next_step`. `in_flight` is the output of the step still running
        on the devices (dispatch runs a step ahead): a due fault first waits for it, so the slice dies
        exactly at the device-side boundary and its kill time is when that step really ended, not when
        the host loop passed the boundary. Nothing is waited for when no fault is due."""
        if next_step != self.next_step:
            self.outages.steps_run += 1
        self.next_step = next_step
        if stall := self.stalls.pop(next_step - 1, 0.0):  # once: a replayed step runs at full speed
            self.events.emit(
                catalogue.HOST_STALLED, step=next_step - 1, seconds=stall, cause="fault_schedule slow_s"
            )
            time.sleep(stall)
        if hang := self.hangs.pop(next_step, 0.0):
            self._hang(next_step, hang)
        due = []
        while self.pending and self.pending[0].step <= next_step:
            f = self.pending.pop(0)
            due.append((f.slice, f.down_s, f"fault_schedule step={f.step}", f.down_steps))
        for source in self.random_sources:
            due += source.due(next_step, self.outages.clock())
        due += [(slice_index, down_s, source, 0) for slice_index, down_s, source in self._chaos_requests()]
        if due and in_flight is not None:
            jax.block_until_ready(in_flight)
        for fault in due:
            self._fire(*fault)

    def _once_per_run(self, name: str) -> bool:
        """True the first time in the run (not only in this process) that fault `name` fires: a marker in
        the run's chaos directory keeps a restarted process that trains the step again from firing it again."""
        marker = None if self.chaos_dir is None else self.chaos_dir / name
        if marker is not None and marker.exists():
            return False
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("fired\n")
        return True

    def _hang(self, step: int, seconds: float) -> None:
        """Block before step `step`'s dispatch, raising nothing (once per run)."""
        if not self._once_per_run(f"hang_at_step_{step}"):
            return
        self.events.emit(catalogue.HANG_INJECTED, step=step, seconds=seconds, cause="fault_schedule hang_s")
        time.sleep(seconds)

    def _fire(self, slice_index: int, down_s: float, cause: str, down_steps: int = 0) -> None:
        self.outages.mark_down(slice_index, down_s, down_steps)
        self.last_cause = cause
        self.events.emit(
            catalogue.SLICE_KILLED,
            slice=slice_index,
            step=self.next_step,
            down_s=down_s,
            down_steps=down_steps,
            cause=cause,
        )

    def _chaos_requests(self):
        """(slice, down_s, cause) of each new request in chaos_dir meant for this process; every request
        read is renamed (.done, or .ignored when stale) so it is read once."""
        if self.chaos_dir is None or not self.chaos_dir.is_dir():
            return []
        out = []
        for entry in sorted(os.scandir(self.chaos_dir), key=lambda e: e.name):
            if not entry.name.endswith(".json"):
                continue
            path = Path(entry.path)
            try:
                request = json.loads(path.read_text())
                kill = (int(request["slice"]), float(request.get("down_s", 0)), f"chaos {path.name}")
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

    def corrupting(self, step: int, where: str) -> int | None:
        """The slice whose devices compute wrong numbers while `step` is computed (by the replay check, then
        by the step itself): a persistent fault's slice from its step on; a one-shot fault's slice the first
        time the run computes its step (both the check and the step of that attempt), never again."""
        for f in self.corrupt:
            if f.persistent and step >= f.step:
                if self._once_per_run(f"corrupt_from_step_{f.step}_slice_{f.slice}"):
                    emit = self.events.emit
                    emit(catalogue.SDC_INJECTED, step=step, slice=f.slice, where=where, persistent=True)
                return f.slice
        if step in self._corrupting:
            return self._corrupting[step]
        for f in self.corrupt:
            if not f.persistent and f.step == step and self._once_per_run(f"corrupt_at_step_{step}"):
                self.events.emit(catalogue.SDC_INJECTED, step=step, slice=f.slice, where=where)
                self._corrupting[step] = f.slice
                return f.slice
        return None

    def _flip(self, step: int, state, slice_devices: dict[int, list]):
        """After `step`'s update: a scheduled memory fault changes one slice's copy of the parameters."""
        bad = self.flips.get(step)
        if bad is None or bad not in slice_devices or not self._once_per_run(f"flip_at_step_{step}"):
            return state
        self.events.emit(catalogue.SDC_INJECTED, step=step, slice=bad, where="memory")
        return dict(state, params=flip_bits(state["params"], slice_devices[bad]))

    def guard_replay(self, check_fn, slice_devices: dict[int, list]):
        """The replay check's program as it runs on the slices: a slice with a corruption due computes it
        on wrong numbers, as the step does (`guard`)."""

        def guarded(params, batch):
            bad = self.corrupting(self.next_step, where="sdc_check")
            if bad is not None and bad in slice_devices:
                batch = wrong_inputs(batch, slice_devices[bad])
            return check_fn(params, batch)

        return guarded

    def _spike(self, factor: float, before, state, metrics):
        """A loss spike: the step's loss and gradient norm times `factor`, and its update to the params
        too (what a bad batch's gradients do to the model; Adam's update is nearly scale-free, so the
        update itself is scaled)."""
        self.events.emit(catalogue.SPIKE_INJECTED, step=self.next_step, factor=factor)
        params = jax.tree.map(lambda b, a: b + factor * (a - b), before, state["params"])
        metrics = dict(metrics, loss=metrics["loss"] * factor, grad_norm=metrics["grad_norm"] * factor)
        return dict(state, params=params), metrics

    def guard(self, step_fn, slice_devices: dict[int, list]):
        """`step_fn` as it runs on the active slices (`slice_devices`: each one's devices): it raises the
        Pathways slice-down error while any of them is down, and a corruption or memory fault scheduled
        for the step lands on its slice's devices."""
        self._corrupting.clear()  # a one-shot corruption belongs to the attempt that first computed it
        active_slices = list(slice_devices)

        def guarded(state, batch):
            down = self.outages.take_failures(active_slices)
            if down:
                raise slice_down_error(down, self.last_cause or "slice down")
            step = self.next_step
            factor = self.spikes.pop(step, 0.0)
            if factor and not self._once_per_run(f"spike_at_step_{step}"):
                factor = 0.0
            before = jax.tree.map(jnp.copy, state["params"]) if factor else None  # the step donates its input
            bad = self.corrupting(step, where="step")
            if bad is not None and bad in slice_devices:
                batch = wrong_inputs(batch, slice_devices[bad])
            state, metrics = step_fn(state, batch)
            self._corrupting.pop(step, None)  # the step computed it: a replay of the step is clean
            if factor:
                state, metrics = self._spike(factor, before, state, metrics)
            state = self._flip(step, state, slice_devices)
            if step in self.nan_steps:
                self.nan_steps.discard(step)  # fires once, like a slice fault
                self.events.emit(catalogue.NAN_INJECTED, step=step)
                metrics = dict(metrics, loss=metrics["loss"] * float("nan"), finite=metrics["finite"] & False)
            return state, metrics

        return guarded
