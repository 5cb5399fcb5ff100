"""The supervisor: runs train attempts and, with elastic_enabled, retries them in-process across slice failures.

Every run goes through it (one code path): without elastic_enabled a slice failure ends the run,
but nan_policy=rollback, snapshots and the profiler window work the same either way.

Semantics follow pathwaysutils' `Manager.elastic_retry`: before each attempt wait for enough slices
(`wait_for_slices`); a `JaxRuntimeError` that pathwaysutils classifies as slice-down ends the attempt
and is retried; a `ScaleUpSignalError` raised at a step boundary re-enters with the returned slices;
anything else propagates. What we add: the same code on local virtual slices, host-RAM snapshots,
replica-resize with a batch policy, no-loss scale-up, executable reuse and a measured timeline.

Pause-and-resume: `elastic_min_slice_count=-1` waits for every slice. Replica-resize: with
`1 <= elastic_min_slice_count < num_slices` the next attempt runs on whatever healthy slices exist
(at least that many) and grows back when the others return.

Several processes (jax.distributed, no Pathways): a slice is a group of processes and `membership`
(trainer.distributed) replaces the health checks: a peer lost during a step raises
`ProcessFailureError` on every survivor at that step (a slice-down event); waiting is rounds of
`live_devices`; a replacement seen in a step's round is a scale-up at that step, on every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import jax
from jax.experimental.multihost_utils import ProcessFailureError
from pathwaysutils.elastic import elastic as pw_elastic
from pathwaysutils.elastic.manager import ScaleUpSignalError

from trainer.attempt import Attempt, build_attempt
from trainer.config.schema import RunConfig
from trainer.distributed.transfer import shared_snapshot_source
from trainer.elastic.errors import ElasticGiveUp
from trainer.elastic.faults import FaultInjector, Outages, parse_fault_schedule
from trainer.elastic.slices import make_checker
from trainer.elastic.snapshot import HostSnapshots
from trainer.loop import train_loop
from trainer.nonfinite import NonFinitePolicy, RollbackRequested
from trainer.observe.profiler import StepProfiler
from trainer.observe.rundir import RunPaths

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RecoveryClock:
    """What the timeline needs across attempts: last completed step and when the failure was seen."""

    last_step: int = 0
    detected_at: float | None = None
    downtime_s: float = 0.0
    steps_lost: int = 0
    failures: int = 0


class _StepHooks:
    """Runs at every step boundary of an attempt: timeline, snapshots, fault injection, scale-up."""

    def __init__(self, sup: Supervisor, active: list[int]):
        self.sup, self.active = sup, active
        self.first_step_seen = False
        self.next_scale_check = time.monotonic()

    def __call__(self, step: int, attempt: Attempt) -> None:
        sup = self.sup
        sup.clock.last_step = step
        sup.profiler.after_step(step, attempt.state)
        if not self.first_step_seen:
            self.first_step_seen = True
            if sup.clock.detected_at is not None:
                jax.block_until_ready(attempt.state)  # the timeline's "first step" means completed
                down = time.time() - sup.clock.detected_at
                sup.clock.downtime_s += down
                sup.events.emit(
                    "first_step_after_recovery",
                    step=step,
                    seconds_since_detection=round(down, 3),
                    slices=self.active,
                )
                sup.clock.detected_at = None
        period = sup.cfg.elastic.snapshot_period
        if period and step % period == 0:
            sup.snapshots.take(step, attempt.state, attempt.iterator.get_state())
        if sup.injector is not None:
            sup.injector.at_step_boundary(step + 1, in_flight=attempt.state)
        if sup.membership is not None:  # every step: each process saw the same round at this step
            arrived = sup.membership.arrived(self.active)
            if arrived:
                self._scale_up(step, attempt, arrived)
        elif len(self.active) < sup.total and time.monotonic() >= self.next_scale_check:
            self.next_scale_check = time.monotonic() + sup.cfg.elastic.elastic_poll_interval_seconds
            self._maybe_scale_up(step, attempt)

    def _maybe_scale_up(self, step: int, attempt: Attempt) -> None:
        sup = self.sup
        inactive = {i: sup.slice_to_devices[i] for i in sup.slice_to_devices if i not in self.active}
        back = pw_elastic.get_active_slice_indices(
            inactive, make_checker(inactive, sup.outages, single_controller=sup.single_controller)
        )
        if back:
            self._scale_up(step, attempt, back)

    def _scale_up(self, step: int, attempt: Attempt, back) -> None:
        sup = self.sup
        # Snapshot first, synchronously: the grown attempt restores this exact step, losing nothing.
        sup.snapshots.take(step, attempt.state, attempt.iterator.get_state(), block=True)
        if sup.membership is not None and attempt.checkpointer is not None:
            _settle_save(attempt.checkpointer)  # every process is alive: let an in-flight save commit
        sup.events.emit("scale_up_requested", step=step, returning=sorted(back), active=self.active)
        raise ScaleUpSignalError(f"slices {sorted(back)} are back")


def _settle_save(checkpointer) -> None:
    from trainer.checkpoint import CheckpointSaveError

    try:
        checkpointer.wait()
    except CheckpointSaveError as e:  # already logged and emitted; the snapshot carries the state
        log.warning("%s", e)


class Supervisor:
    def __init__(
        self,
        cfg: RunConfig,
        slices: list[list],
        *,
        paths: RunPaths,
        events,
        sinks,
        stop_requested,
        membership=None,
    ):
        self.cfg, self.paths, self.events, self.sinks = cfg, paths, events, sinks
        self.stop_requested = stop_requested
        self.membership = membership  # several processes, elastic: trainer.distributed.membership.Membership
        self.formation = None
        self.slice_to_devices = dict(enumerate(slices))
        self.total = len(slices)
        e = cfg.elastic
        self.min_slices = self.total if e.elastic_min_slice_count == -1 else e.elastic_min_slice_count
        self.single_controller = cfg.mesh.enable_single_controller
        self.outages = None if self.single_controller else Outages()
        self.injector = None
        if not self.single_controller and membership is None:
            faults = parse_fault_schedule(e.fault_schedule, self.total)
            self.injector = FaultInjector(faults, self.outages, paths.local / "chaos", events)
        self.checker = make_checker(self.slice_to_devices, self.outages, single_controller=self.single_controller)
        self.snapshots = HostSnapshots(events)
        self.layouts: dict = {}  # slice set -> attempt.Layout (mesh, shardings, compiled step)
        self.clock = RecoveryClock()
        self.nonfinite = NonFinitePolicy(cfg.observe.nan_policy, events)
        self.profiler = StepProfiler(cfg.observe, paths.local / "profile", events)
        self.skip_batches: set[int] = set()
        self.failure_seen_at: float | None = None

    def wait_for_slices(self) -> list[int]:
        e = self.cfg.elastic
        if not e.elastic_enabled:
            return sorted(self.slice_to_devices)
        t0 = time.time()
        self.events.emit("wait_start", min_slices=self.min_slices, total_slices=self.total)
        try:
            if self.membership is not None:  # slices in mesh order, agreed by every process
                self.formation = self.membership.wait_for_slices(
                    self.min_slices, timeout_s=e.elastic_timeout_seconds, poll_s=e.elastic_poll_interval_seconds
                )
                return self._waited(list(self.formation.slices), t0)
            active = pw_elastic.wait_for_slices(
                slice_count=self.min_slices,
                poll_interval=e.elastic_poll_interval_seconds,
                timeout=e.elastic_timeout_seconds,
                slice_to_devices=self.slice_to_devices,
                checker=self.checker,
            )
        except TimeoutError as err:
            self.events.emit("wait_timeout", seconds=round(time.time() - t0, 3), error=str(err))
            raise ElasticGiveUp(
                f"fewer than {self.min_slices} slices healthy after "
                f"elastic_timeout_seconds={e.elastic_timeout_seconds}: {err}"
            ) from None
        return self._waited(sorted(active), t0)

    def _waited(self, active: list[int], t0: float) -> list[int]:
        log.info("Sufficient slices active: %d >= %d", len(active), self.min_slices)
        self.events.emit("wait_end", active=active, seconds=round(time.time() - t0, 3))
        return active

    def run_attempt(self, number: int, active: list[int]):
        cfg = self.cfg
        step_guard = None if self.injector is None else (lambda fn: self.injector.guard(fn, active))
        restore_source, multiprocessing = self.snapshots.restore_source, None
        if self.membership is not None:
            step_guard = lambda fn: self.membership.guard(fn, active)  # noqa: E731
            timeout_s = cfg.elastic.elastic_timeout_seconds
            restore_source = shared_snapshot_source(
                self.snapshots,
                self.events,
                barrier=lambda: self.membership.barrier(
                    "attempt_start", self.formation, active, timeout_s=timeout_s
                ),
            )
            multiprocessing = self.membership.checkpoint_options(active, self.formation)
        attempt = build_attempt(
            cfg,
            [self.slice_to_devices[i] for i in active],
            checkpoint_dir=self.paths.checkpoints,
            events=self.events,
            total_slices=self.total,
            layout_cache=self.layouts,
            restore_source=restore_source,
            wrap_step=step_guard,
            checkpoint_multiprocessing=multiprocessing,
        )
        with contextlib.closing(attempt):
            rewound = max(0, self.clock.last_step - attempt.start_step) if number > 1 else 0
            self.clock.steps_lost += rewound
            self.events.emit(
                "attempt_start",
                attempt=number,
                slices=active,
                start_step=attempt.start_step,
                source=attempt.restored_from,
                steps_rewound=rewound,
                global_batch_size=attempt.plan.global_batch_size,
                micro_steps=attempt.plan.micro_steps,
                lr_scale=attempt.plan.lr_scale,
            )
            log.info(
                "attempt %d: slices=%s global_batch=%d micro_steps=%d lr_scale=%.3f from %s (rewound %d steps)",
                number,
                active,
                attempt.plan.global_batch_size,
                attempt.plan.micro_steps,
                attempt.plan.lr_scale,
                attempt.restored_from,
                rewound,
            )
            self.nonfinite.already_skipped = frozenset(self.skip_batches)
            if self.injector is not None:
                self.injector.at_step_boundary(attempt.start_step + 1)
            try:
                return train_loop(
                    attempt,
                    self.sinks,
                    self.events,
                    steps=cfg.train.steps,
                    nonfinite=self.nonfinite,
                    stop_requested=self.stop_requested,
                    before_step=self.profiler.before_step,
                    after_step=_StepHooks(self, active),
                    skip_batches=frozenset(self.skip_batches),
                )
            except BaseException:
                self.failure_seen_at = time.time()  # before teardown: detection time, not teardown time
                raise
            finally:
                self.profiler.close()
                self.paths.sync()

    def run(self):
        number = 0
        while True:
            number += 1
            active = self.wait_for_slices()
            try:
                result = self.run_attempt(number, active)
                self.snapshots.settle()
                self._summary()
                return result
            except ScaleUpSignalError as err:
                self.events.emit("scale_up", step=self.clock.last_step, detail=str(err))
            except RollbackRequested as req:
                log.warning("%s", req)
                self.skip_batches.add(req.step)
                self.events.emit("rollback", step=req.step, last_step=self.clock.last_step)
            except ProcessFailureError as err:  # several processes: a peer died during the step
                if not self.cfg.elastic.elastic_enabled:
                    raise
                self._on_slice_down(number, active, err)
            except jax.errors.JaxRuntimeError as err:
                # Several processes: a collective that failed outside a step (restore, first use of a
                # mesh) is a slice-down event too; the next membership round shows who is alive.
                if not (
                    self.cfg.elastic.elastic_enabled
                    and (
                        self.membership is not None
                        or pw_elastic.is_error_due_to_slice_down(err, log_traceback=False)
                    )
                ):
                    raise
                self._on_slice_down(number, active, err)

    def _on_slice_down(self, number: int, active: list[int], err: Exception) -> None:
        log.warning("Slice down event detected. Retrying.")
        self.clock.failures += 1
        seen = self.failure_seen_at or time.time()
        self.clock.detected_at = seen
        self.snapshots.settle()
        # Stamped with the time the error reached the train function; teardown_s is what closing the
        # failed attempt (in-flight save, iterator, profiler) took after that.
        self.events.emit(
            "slice_down_detected",
            attempt=number,
            last_step=self.clock.last_step,
            slices=active,
            error=str(err).splitlines()[0],
            failures=self.clock.failures,
            time=seen,
            teardown_s=round(time.time() - seen, 3),
        )
        self.failure_seen_at = None
        if self.clock.failures > self.cfg.elastic.elastic_max_retries:
            self._summary()
            raise ElasticGiveUp(
                f"{self.clock.failures} slice failures exceed elastic_max_retries="
                f"{self.cfg.elastic.elastic_max_retries}; newest committed checkpoint is intact"
            )

    def _summary(self) -> None:
        self.events.emit(
            "elastic_summary",
            failures=self.clock.failures,
            steps_lost=self.clock.steps_lost,
            downtime_s=round(self.clock.downtime_s, 3),
        )


def run_supervised(
    cfg: RunConfig, slices: list[list], *, paths: RunPaths, events, sinks, stop_requested, membership=None
):
    return Supervisor(
        cfg, slices, paths=paths, events=events, sinks=sinks, stop_requested=stop_requested, membership=membership
    ).run()
