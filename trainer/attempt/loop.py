"""The step loop of one attempt: batch -> compiled step -> metrics (one step late) -> maybe save.

It returns what ended it, at a step boundary (`trainer.attempt.outcome`), through one end path; the
supervisor decides what follows. Only a failure (a lost slice, a bug) leaves it as an exception.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax

from trainer.attempt.builder import Attempt
from trainer.attempt.loss_spikes import LossSpikePolicy
from trainer.attempt.nonfinite import NonFinitePolicy
from trainer.attempt.outcome import (
    LOSS_SPIKE,
    SDC,
    Finished,
    Outcome,
    Preempted,
    Rollback,
    ScaleUp,
    TargetReached,
)
from trainer.attempt.sdc import SdcCheck
from trainer.data.batch import fingerprint
from trainer.observe import catalogue
from trainer.observe.peaks import peak_tflops
from trainer.observe.sinks import Sinks
from trainer.process.preemption import EVALUATING, SAVING, STEPPING, Phases

log = logging.getLogger(__name__)


class Boundary(Protocol):
    """Work between steps (`trainer.elastic.boundary.StepBoundary`)."""

    def before_step(self, step: int) -> None: ...

    def after_step(self, step: int, state, data_state: Callable[[], dict]) -> list[int]: ...

    def before_stop(self, step: int, state, data_state: dict) -> None:
        """A stop (SIGTERM) at `step`: save what is fastest to save first (the local tier)."""

    def saves_at(self, step: int) -> bool:
        """Whether `after_step(step, ...)` will save the state (a snapshot, the local tier)."""


class _NoBoundary:
    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int, state, data_state) -> list[int]:
        return []

    def before_stop(self, step: int, state, data_state: dict) -> None:
        pass

    def saves_at(self, step: int) -> bool:
        return False


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    metrics: dict
    fingerprint: str
    sdc_check_s: float | None = None  # the replay check's seconds, when this step was checked


class StepRecords:
    """Turns a finished step's device metrics into its metrics.jsonl record (no I/O, no policy).

    Step time is the interval between consecutive steps' metrics becoming ready on the host; reading
    step s happens after step s+1 was dispatched, so the device is never idle waiting for logging.
    """

    def __init__(
        self,
        *,
        flops_per_step: float,
        tokens_per_step: int,
        global_batch_size: int,
        devices: int,
        peak_tflops: float | None,
        timer: Callable[[], float] = time.perf_counter,
    ):
        self.flops_per_step = flops_per_step
        self.tokens_per_step = tokens_per_step
        self.devices = devices
        self.global_batch_size = global_batch_size
        self.peak = peak_tflops
        self.timer = timer
        self.last_ready = timer()
        self.device_wait = 0.0  # waits for the devices outside `record` since the last record (a save's)

    def waited_for_devices(self, seconds: float) -> None:
        """The loop blocked on the devices for `seconds` (before a save): not this host's own time."""
        self.device_wait += seconds

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` spent between steps on other work (an evaluation) out of the next step time."""
        self.last_ready += seconds

    def record(self, pending: _Pending, *, skipped_steps: int) -> dict[str, Any]:
        waiting = self.timer()
        m = jax.device_get(pending.metrics)
        now = self.timer()
        step_time, self.last_ready = now - self.last_ready, now
        # The rest of the step time this host spent on its own work (batch, boundary, saves), not waiting
        # for the devices: the slowest process of a slow step is the one with the most (observe/slowsteps).
        host_time = step_time - (now - waiting) - self.device_wait
        self.device_wait = 0.0
        tflops = self.flops_per_step / step_time / self.devices / 1e12
        return {
            "step": pending.step,
            "loss": float(m["loss"]),
            "learning_rate": float(m["learning_rate"]),
            "grad_norm": float(m["grad_norm"]),
            "step_time_s": step_time,
            "host_time_s": host_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "tflops_per_device": tflops,
            "mfu": None if self.peak is None else tflops / self.peak,
            "global_batch_size": self.global_batch_size,
            "pid": os.getpid(),
            "time": time.time(),
            "batch_fingerprint": pending.fingerprint,
            "loss_tokens": int(m["tokens"]),
            "z_loss": float(m["z_loss"]),
            "aux_loss": float(m["aux_loss"]),
            "devices": self.devices,
            "finite": bool(m["finite"]),
            "skipped_steps": skipped_steps,
            **({} if pending.sdc_check_s is None else {"sdc_check_s": pending.sdc_check_s}),
            **{k: float(v) for k, v in m.items() if "/" in k},  # objective=dpo: TRL's rewards/*, logps/*
        }


def train_loop(
    attempt: Attempt,
    *,
    steps: int,
    sinks: Sinks,
    events,
    nonfinite: NonFinitePolicy,
    peak_tflops_per_device: float = 0.0,
    boundary: Boundary | None = None,
    stop_requested: Callable[[int], bool] = lambda step: False,
    interrupt_eval: Callable[[], bool] = lambda: False,
    spikes: LossSpikePolicy | None = None,
    sdc: SdcCheck | None = None,
    phases: Phases | None = None,
    beat: Callable[[int], None] = lambda step: None,
) -> Outcome:
    """Run steps start_step+1 .. `steps` (a batch `nonfinite` rolled back is skipped).

    `peak_tflops_per_device` overrides the device's known peak for MFU (0: look it up). `stop_requested`
    is asked at every step boundary (SIGTERM: save and return `preempted`), `interrupt_eval` between
    evaluation batches (one process: a SIGTERM ends an evaluation early; the step boundary then stops).
    `spikes`: loss-spike rollback; when on, a step's record is read before anything saves that step, so
    every saved state predates a spike found in it. `sdc`: the silent-data-corruption check, run before
    the steps it is due at. `phases`: the process's phases (the loop marks its own: a SIGTERM in them is
    acted on at the step boundary); `beat(step)`: step `step` completed (the progress watchdog's signal)."""
    boundary = boundary or _NoBoundary()
    spikes = spikes or LossSpikePolicy.off(events)
    sdc = sdc or SdcCheck.off(events)
    phases = phases or Phases()
    spikes.attempt_started(attempt.start_step)
    sdc.attempt_started(attempt.start_step)
    records = _step_records(attempt, peak_tflops_per_device)

    ckpt = attempt.checkpointer
    iterator, state, step = attempt.iterator, attempt.state, attempt.start_step
    pending: _Pending | None = None

    def record_pending(*, last: bool = False) -> Rollback | None:
        """Write the pending step's record (blocks on that step only); a rollback when nan_policy or the
        spike policy asks to go back to before it."""
        nonlocal pending
        done, pending = pending, None
        if done is None:
            return None
        record = records.record(done, skipped_steps=nonfinite.skipped_steps)
        if last:
            record["last"] = True
        sinks.write(record)
        beat(done.step)
        sdc.step_timed(done.step, record["step_time_s"])
        if nonfinite.check(record):
            return Rollback(done.step)
        return Rollback(done.step, cause=LOSS_SPIKE) if spikes.check(record) else None

    outcome: Outcome | None = None
    try:
        with phases.enter(STEPPING):  # a SIGTERM here is acted on at the step boundary (process.preemption)
            while outcome is None and step < steps:
                if nonfinite.skips(step + 1):
                    next(iterator)  # the batch that produced a non-finite update is skipped
                boundary.before_step(step + 1)
                host_batch, fp = _next_batch(iterator, spikes)
                checked = None
                if sdc.due(step + 1, attempt.num_slices):  # the check waits for the state
                    checked = record_pending() or _sdc_check(sdc, attempt, state, host_batch, step + 1, records)
                    if isinstance(checked, Rollback):
                        outcome = checked
                        break
                state, metrics = attempt.step_fn(state, attempt.device_batch(host_batch))
                step += 1
                if outcome := record_pending():  # blocks on step-1 only, while `step` runs on the device
                    break
                pending = _Pending(step, metrics, fp, checked)
                final = step == steps
                saving = ckpt.should_save(step, final=final)  # asked once: a planned period counts its saves
                if spikes.enabled and (saving or boundary.saves_at(step)):
                    if outcome := record_pending(last=final):  # no state of a spike's step is ever saved
                        break
                # The iterator has yielded exactly `step` batches: its state pairs with this model state.
                if saving:
                    _save(attempt, step, state, records, events, phases)
                # Evaluate after the save and before the boundary (snapshot, injected fault): a restore to
                # this step finds it evaluated; a rewind to before it trains and evaluates it again.
                if attempt.evaluator is not None and attempt.evaluator.due(step):
                    row = _evaluate(attempt.evaluator, step, state, records, sinks, interrupt_eval, phases)
                    if row is not None and attempt.evaluator.reached_target(row) and not final:
                        outcome = record_pending(last=True) or _target_reached(attempt, step, state, row, events)
                        break
                returning = boundary.after_step(step, state, iterator.get_state)
                if returning:
                    outcome = record_pending() or ScaleUp(step, state, tuple(sorted(returning)))
                elif stop_requested(step) and not final:
                    outcome = record_pending(last=True) or _stop(attempt, step, state, boundary, events)
            if outcome is None:
                outcome = record_pending(last=True) or _finish(ckpt, step)
    except BaseException:
        # A failure ends the attempt; the step before it did complete: keep its record.
        _write_best_effort(records, sinks, nonfinite, pending)
        raise
    return outcome


def _finish(ckpt, step: int) -> Finished:
    """Every step ran: the final save commits before the attempt ends."""
    ckpt.wait()
    return Finished(step)


def _target_reached(attempt: Attempt, step: int, state, row: dict, events) -> TargetReached:
    """The eval at `step` reached target_eval_loss: save that step, wait for its commit, and end."""
    attempt.checkpointer.save(step, state, attempt.iterator.get_state(), attempt.checkpoint_metadata)
    attempt.checkpointer.wait()
    events.emit(catalogue.TARGET_EVAL_LOSS_REACHED, step=step, eval_loss=row["eval_loss"])
    return TargetReached(step, row["eval_loss"])


def _save(attempt: Attempt, step: int, state, records: StepRecords, events, phases: Phases) -> None:
    """A periodic or final save of the state after `step`; the loop's blocked time is its own event."""
    with phases.enter(SAVING):
        _save_blocking(attempt, step, state, records, events)


def _save_blocking(attempt: Attempt, step: int, state, records: StepRecords, events) -> None:
    t0 = time.perf_counter()
    jax.block_until_ready(state)  # the save copies it; timed apart from the save's own work
    waited = time.perf_counter() - t0
    records.waited_for_devices(waited)
    if attempt.checkpointer.save(step, state, attempt.iterator.get_state(), attempt.checkpoint_metadata):
        events.emit(
            catalogue.CHECKPOINT_SAVE_BLOCKED,
            step=step,
            seconds=round(time.perf_counter() - t0, 4),
            waited_for_step_s=round(waited, 4),
        )


def _step_records(attempt: Attempt, peak_tflops_per_device: float) -> StepRecords:
    return StepRecords(
        flops_per_step=attempt.flops_per_step,
        tokens_per_step=attempt.batch_layout.global_batch_size * attempt.sequence_length,
        global_batch_size=attempt.batch_layout.global_batch_size,
        devices=attempt.mesh.size,
        peak_tflops=peak_tflops(attempt.mesh.devices.flat[0].device_kind, peak_tflops_per_device),
    )


def _next_batch(iterator, spikes: LossSpikePolicy) -> tuple[dict, str]:
    """The next batch and its fingerprint, past any batch a loss-spike rollback took out for good."""
    batch = next(iterator)
    while spikes.skips(fp := fingerprint(batch)):
        batch = next(iterator)
    return batch, fp


def _sdc_check(sdc: SdcCheck, attempt: Attempt, state, host_batch, step: int, records: StepRecords):
    """The replay check of `step` before it runs: its seconds (kept out of the step's time), or the
    rollback outcome when a slice computed wrong numbers."""
    t0 = time.perf_counter()
    jax.block_until_ready(state)  # the previous step's device time stays in its own step time
    records.waited_for_devices(time.perf_counter() - t0)
    verdict, seconds = sdc(attempt, state["params"], host_batch, step)
    records.exclude(seconds)
    if verdict.slices:
        return Rollback(step, cause=SDC, suspects=verdict.suspects, not_after=sdc.verified_step)
    return round(seconds, 4)


def _stop(attempt: Attempt, step: int, state, boundary: Boundary, events) -> Preempted:
    """A stop request (SIGTERM) at `step`: the fastest tier first (local), then the persistent checkpoint,
    inside the stop bound."""
    boundary.before_stop(step, state, attempt.iterator.get_state())
    attempt.checkpointer.save(step, state, attempt.iterator.get_state(), attempt.checkpoint_metadata, force=True)
    attempt.checkpointer.wait()
    events.emit(catalogue.PREEMPTED, step=step)
    return Preempted(step)


def _evaluate(
    evaluator, step: int, state, records: StepRecords, sinks: Sinks, interrupt, phases: Phases
) -> dict[str, Any] | None:
    """Evaluate the state after `step` and write its eval row; the eval's wall time is its own, not the
    step's (trainer.attempt.evaluate). None, with no row, when `interrupt()` ended it early (a SIGTERM)."""
    t0 = time.perf_counter()
    jax.block_until_ready(state)  # the step's remaining device time stays in the step's time
    records.waited_for_devices(time.perf_counter() - t0)
    with phases.enter(EVALUATING):
        row = evaluator(step, state["params"], interrupt=interrupt)
    records.exclude(time.perf_counter() - t0 if row is None else row["eval_time_s"])
    if row is None:
        log.warning("evaluation at step %d interrupted by a stop request: no eval row", step)
        return None
    sinks.write(row)
    return row


def _write_best_effort(records: StepRecords, sinks: Sinks, nonfinite: NonFinitePolicy, pending) -> None:
    if pending is None:
        return
    try:
        sinks.write(records.record(pending, skipped_steps=nonfinite.skipped_steps))
    except Exception as e:  # its device buffers may be gone with the failed slice
        log.warning("metrics of step %d lost with the failure: %s", pending.step, e)
