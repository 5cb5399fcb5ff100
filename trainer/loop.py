"""The step loop of one attempt: batch -> compiled step -> metrics (one step late) -> maybe save."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from trainer.attempt import Attempt
from trainer.data.batch import fingerprint
from trainer.nonfinite import NonFinitePolicy
from trainer.observe.peaks import peak_tflops
from trainer.observe.sinks import Sinks

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoopResult:
    final_step: int
    preempted: bool


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    metrics: dict
    fingerprint: str


class MetricsReader:
    """Turns a finished step's device metrics into the metrics.jsonl record.

    Step time is the interval between consecutive steps' metrics becoming ready on the host; reading
    step s happens after step s+1 was dispatched, so the device is never idle waiting for logging.
    """

    def __init__(
        self,
        attempt: Attempt,
        sinks: Sinks,
        nonfinite: NonFinitePolicy,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.attempt, self.sinks, self.nonfinite, self.clock = attempt, sinks, nonfinite, clock
        self.last_ready = clock()
        cfg = attempt.cfg
        self.peak = peak_tflops(attempt.mesh.devices.flat[0].device_kind, cfg.observe.peak_tflops_per_device)
        self.tokens_per_step = attempt.plan.global_batch_size * cfg.data.max_target_length

    def read(self, pending: _Pending, *, last: bool = False) -> dict[str, Any]:
        m = jax.device_get(pending.metrics)
        now = self.clock()
        step_time, self.last_ready = now - self.last_ready, now
        devices = self.attempt.mesh.size
        tflops = self.attempt.flops_per_step / step_time / devices / 1e12
        record = {
            "step": pending.step,
            "loss": float(m["loss"]),
            "learning_rate": float(m["learning_rate"]),
            "grad_norm": float(m["grad_norm"]),
            "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "tflops_per_device": tflops,
            "mfu": None if self.peak is None else tflops / self.peak,
            "global_batch_size": self.attempt.plan.global_batch_size,
            "pid": os.getpid(),
            "time": time.time(),
            "batch_fingerprint": pending.fingerprint,
            "loss_tokens": int(m["tokens"]),
            "z_loss": float(m["z_loss"]),
            "aux_loss": float(m["aux_loss"]),
            "devices": devices,
            "finite": bool(m["finite"]),
            "skipped_steps": self.nonfinite.skipped_steps,
        }
        if last:
            record["last"] = True
        self.sinks.write(record)
        self.nonfinite.check(record)
        return record


def train_loop(
    attempt: Attempt,
    sinks: Sinks,
    events,
    *,
    steps: int,
    nonfinite: NonFinitePolicy,
    stop_requested: Callable[[], bool] = lambda: False,
    before_step: Callable[[int], None] = lambda step: None,
    after_step: Callable[[int, Attempt], None] = lambda step, attempt: None,
    skip_batches: frozenset[int] = frozenset(),
) -> LoopResult:
    """Run steps start_step+1 .. `steps`. Returns early (preempted) when `stop_requested()` turns true.

    `skip_batches`: steps whose batch is discarded once (nan_policy=rollback), the next batch used instead.
    """
    reader = MetricsReader(attempt, sinks, nonfinite)
    ckpt, state, step = attempt.checkpointer, attempt.state, attempt.start_step
    pending: _Pending | None = None
    try:
        while step < steps:
            if step + 1 in skip_batches:
                next(attempt.iterator)  # the batch that produced a non-finite update is skipped
            before_step(step + 1)
            host_batch = next(attempt.iterator)
            fp = fingerprint(host_batch)
            state, metrics = attempt.step_fn(state, attempt.device_batch(host_batch))
            step += 1
            attempt.state = state  # the donated input is gone; keep the live state reachable for savers
            if pending is not None:
                reader.read(pending)  # blocks on step-1 only, while `step` runs on the device
            pending = _Pending(step, metrics, fp)
            final = step == steps
            # The iterator has yielded exactly `step` batches: its state pairs with this model state.
            if ckpt is not None and ckpt.should_save(step, final=final):
                t0 = time.perf_counter()
                jax.block_until_ready(state)  # the save copies it; timed apart from the save's own work
                waited = time.perf_counter() - t0
                if ckpt.save(step, state, attempt.iterator.get_state(), _metadata(attempt)):
                    events.emit(
                        "checkpoint_save_blocked",
                        step=step,
                        seconds=round(time.perf_counter() - t0, 4),
                        waited_for_step_s=round(waited, 4),
                    )
            after_step(step, attempt)
            if stop_requested() and not final:
                reader.read(pending, last=True)
                pending = None
                if ckpt is not None:
                    ckpt.save(step, state, attempt.iterator.get_state(), _metadata(attempt), force=True)
                    ckpt.wait()
                events.emit("preempted", step=step)
                return LoopResult(step, preempted=True)
    except BaseException:
        # A failure or scale-up signal ends the attempt; the step before it did complete: keep its record.
        _flush_best_effort(reader, pending)
        raise
    if pending is not None:
        reader.read(pending, last=True)
    if ckpt is not None:
        ckpt.wait()
    return LoopResult(step, preempted=False)


def _flush_best_effort(reader: MetricsReader, pending: _Pending | None) -> None:
    if pending is None:
        return
    try:
        reader.read(pending)
    except Exception as e:  # its device buffers may be gone with the failed slice
        log.warning("metrics of step %d lost with the failure: %s", pending.step, e)


def _metadata(attempt: Attempt) -> dict:
    from trainer.config.loader import to_flat_dict

    return {
        "config": to_flat_dict(attempt.cfg),
        "mesh": dict(attempt.mesh.shape),
        "global_batch_size": attempt.plan.global_batch_size,
        "micro_steps": attempt.plan.micro_steps,
    }
