"""The supervisor: runs train attempts and, with elastic_enabled, retries them in-process across slice failures.

Every run goes through it (one code path): without elastic_enabled a slice failure ends the run, but
nan_policy=rollback, snapshots and the profiler window work the same either way.

Semantics follow pathwaysutils' `Manager.elastic_retry`: before each attempt wait for enough slices
(`wait_for_slices`); a `JaxRuntimeError` that pathwaysutils classifies as slice-down ends the attempt
and is retried; returning slices end it at a step boundary and the next attempt runs on them too;
anything else propagates. What we add: the same code on local virtual slices, host-RAM snapshots,
replica-resize with a batch policy, no-loss scale-up, executable reuse and a measured timeline.

Pause-and-resume: `elastic_min_slice_count=-1` waits for every slice. Replica-resize: with
`1 <= elastic_min_slice_count < num_slices` the next attempt runs on whatever healthy slices exist
(at least that many) and grows back when the others return.

When a slice dies at step N (its step fails; the steps before it completed):
1. The step raises out of the train loop (the loop first writes step N-1's metrics) and out of
   `run_attempt`, which notes the time; closing the attempt settles an in-flight save for a bounded time.
2. `_on_slice_down` counts the failure (giving up when failures come faster than progress:
   `trainer.elastic.retry_budget`) and starts the downtime clock.
3. `wait_for_slices` waits until enough slices are healthy (all of them under pause-and-resume).
4. The next attempt is built on them (`trainer.attempt`: a slice set seen before reuses its compiled
   step) and restores by the one restore order (`trainer.restore`): the newest host snapshot, else the
   newest committed checkpoint. The steps between that point and N-1 are counted as lost.
5. Its first completed step ends the downtime (`trainer.elastic.boundary`); training goes on. When the
   lost slice returns, the loop ends at a step boundary with a scale-up outcome: the state is
   snapshotted synchronously and the next attempt, on every slice, restores exactly that step.

Several processes (jax.distributed, no Pathways): a slice is a group of processes and `membership`
replaces the health checks: a peer lost during a step raises `ProcessFailureError` on every survivor at
that step (a slice-down event); waiting is rounds of `live_devices`; a replacement seen in a step's
round is a scale-up at that step, on every process. A formation after a failure may come with fresh
devices (new CPU communicators): the slices' devices are read again and compiled plans dropped. An error
that is neither a lost peer nor a failed collective is this process's own: it is recorded for every
process (`trainer.distributed.fatal`) and ends the job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import jax
from jax.experimental.multihost_utils import ProcessFailureError
from pathwaysutils.elastic import elastic as pw_elastic

from trainer.attempt import Attempt
from trainer.config.schema import ElasticConfig
from trainer.distributed import fatal
from trainer.distributed.fatal import PeerFailed
from trainer.distributed.heartbeat import watch_orbax_barriers
from trainer.elastic.boundary import RecoveryStats, StepBoundary
from trainer.elastic.errors import ElasticGiveUp, SlicesUnavailable
from trainer.elastic.retry_budget import RetryBudget
from trainer.elastic.shared_snapshots import SharedSnapshots
from trainer.elastic.slices import ReturnPoller, make_checker
from trainer.elastic.snapshot import HostSnapshots
from trainer.loop import ROLLBACK, SCALE_UP, Outcome
from trainer.preemption import Preempted, phase

log = logging.getLogger(__name__)

FATAL_WAIT_S = 120.0  # how long a process that failed waits for the others to see why (they see it within
# one collective timeout, or at their next round)


class Supervisor:
    """The recovery policy. Its parts come in built (`trainer.run.build_supervisor`):

    attempts   slices -> Attempt (`trainer.attempt.AttemptBuilder`)
    run_loop   (attempt, boundary=...) -> Outcome (`trainer.loop.train_loop` with the run's sinks and policy)
    injector   the fault injector on local virtual slices (`outages` are its down slices), or None
    membership live processes when several run elastically, or None
    local_checkpoint_period  every this many steps the snapshot is also written to the local tier
    process_faults  several processes: errors injected into this process (fault_schedule), or None
    heartbeat_dead_after_s  several processes: a checkpoint barrier gives up on a peer whose heartbeat
               stopped this long ago
    previous_last_step  the last step an earlier process of this run recorded (a restart after the
               process was lost): the first attempt counts the steps it rewinds behind it as lost
    """

    def __init__(
        self,
        elastic: ElasticConfig,
        slices: list[list],
        *,
        attempts: Callable[..., Attempt],
        run_loop: Callable[..., Outcome],
        events,
        profiler,
        snapshots: HostSnapshots,
        injector=None,
        outages=None,
        membership=None,
        single_controller: bool = False,
        sync: Callable[[], None] = lambda: None,
        local_checkpoint_period: int = 0,
        wait_for_local_write: bool = False,
        previous_last_step: int | None = None,
        process_faults=None,
        heartbeat_dead_after_s: float = 10.0,
        coordinated_stop=None,
    ):
        self.process_faults = process_faults
        self.coordinated_stop = coordinated_stop
        self.heartbeat_dead_after_s = heartbeat_dead_after_s
        self.elastic = elastic
        self.local_checkpoint_period = local_checkpoint_period
        self.wait_for_local_write = wait_for_local_write
        self.previous_last_step = previous_last_step
        self.attempts = attempts
        self.run_loop = run_loop
        self.events = events
        self.profiler = profiler
        self.snapshots = snapshots
        self.sync = sync
        self.injector = injector
        self.outages = outages
        self.membership = membership
        self.single_controller = single_controller
        self.slice_to_devices = dict(enumerate(slices))
        self.total = len(slices)
        count = elastic.elastic_min_slice_count
        self.min_slices = self.total if count == -1 else count
        self.checker = make_checker(self.slice_to_devices, outages, single_controller=single_controller)
        self.stats = RecoveryStats()
        self.formation = None  # several processes: the formation of the current attempt
        self._failure_seen_at: float | None = None
        self._failure_marks: list[int] = []  # the run's furthest step at each failure

    # ---- the retry loop ----------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            return self._run()
        except Preempted:  # SIGTERM outside a step boundary (trainer.preemption)
            self.emergency_save()
            if self.coordinated_stop is not None:  # several processes: the others stop too
                self.coordinated_stop.propose_after(self.stats.last_step)
            raise
        finally:
            if self.membership is not None:
                watch_orbax_barriers(None)  # Orbax's own barriers again, outside the attempts

    def _run(self) -> Outcome:
        number = 0
        while True:
            number += 1
            active = self.wait_for_slices()
            try:
                outcome = self.run_attempt(number, active)
            except (ProcessFailureError, jax.errors.JaxRuntimeError) as err:
                cause = self._slice_down_cause(err)
                if cause is None:
                    self._fail(err)
                    raise
                self._on_slice_down(number, active, err, cause)
                continue
            except (PeerFailed, ElasticGiveUp, KeyboardInterrupt):
                raise
            except Exception as err:
                self._fail(err)
                raise
            if outcome.kind == SCALE_UP:
                back = list(outcome.returning)
                self.events.emit("scale_up", step=outcome.step, detail=f"slices {back} are back")
            elif outcome.kind == ROLLBACK:
                log.warning("non-finite loss/gradients at step %d: rolling back, skipping its batch", outcome.step)
                self.events.emit("rollback", step=outcome.step, last_step=self.stats.last_step)
            else:
                self.snapshots.settle()
                self._summary()
                return outcome

    def emergency_save(self) -> None:
        """A stop outside a step boundary: write the newest host snapshot to the local tier when it is newer
        than the local tier's newest step (the run resumes from the newest of the tiers). Safe to call from
        the stop watchdog's thread."""
        step = self.snapshots.persist_latest()
        if step is not None:
            log.warning("stopping: host snapshot of step %d written to the local checkpoint tier", step)

    def _slice_down_cause(self, err: Exception) -> str | None:
        """Why `err` is a slice-down event ("peer_lost", "collective_failed", "slice_down"), or None when it
        is not one and ends the run.

        Several processes: an error that is neither a lost peer nor a failed collective (out of memory, a
        compile error) is this process's own and ends the job. Otherwise a round first, so that a peer's
        recorded fatal error is seen (PeerFailed) before its departure or its missing part of a collective
        is taken for a lost peer; a dead or restarted peer is a lost peer, a failed collective with every
        peer alive (one was slow, a connection broke) is retried on fresh communicators."""
        if not self.elastic.elastic_enabled:
            return None
        if self.membership is not None:
            if not isinstance(err, ProcessFailureError) and not fatal.is_collective_failure(err):
                return None  # this process's own error: recorded (by _fail) before any round
            self.membership.round()
            fatal.check(self.membership.client, self.membership.me)
            return "peer_lost" if isinstance(err, ProcessFailureError) else "collective_failed"
        if isinstance(err, ProcessFailureError):
            return "peer_lost"
        return "slice_down" if pw_elastic.is_error_due_to_slice_down(err, log_traceback=False) else None

    def _fail(self, err: BaseException) -> None:
        """Several processes: this process's own error ends every process (trainer.distributed.fatal)."""
        if self.membership is None:
            return
        self.events.emit(
            "fatal_error", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        )
        try:
            self.membership.fail(err, wait_s=FATAL_WAIT_S)
        except Exception as e:  # the cause is what matters; never hide it behind a failure to tell the others
            log.warning("could not tell the other processes about this failure: %s", e)

    def wait_for_slices(self) -> list[int]:
        with phase("waiting_for_slices"):
            return self._wait_for_slices()

    def _wait_for_slices(self) -> list[int]:
        e = self.elastic
        if not e.elastic_enabled:
            return sorted(self.slice_to_devices)
        t0 = time.time()
        self.events.emit("wait_start", min_slices=self.min_slices, total_slices=self.total)
        try:
            if self.membership is not None:  # slices in mesh order, agreed by every process
                clients = self.membership.fresh_clients
                stop = self.coordinated_stop
                self.formation = self.membership.wait_for_slices(
                    self.min_slices,
                    timeout_s=e.elastic_timeout_seconds,
                    poll_s=e.elastic_poll_interval_seconds,
                    should_stop=stop.agreed if stop is not None else lambda: False,
                )
                if self.membership.fresh_clients != clients:  # new device objects; executables went with the old
                    self.slice_to_devices = dict(enumerate(self.membership.slice_devices()))
                    forget = getattr(self.attempts, "forget_compiled", None)
                    if forget is not None:
                        forget()
                active = list(self.formation.slices)
            else:
                active = sorted(
                    pw_elastic.wait_for_slices(
                        slice_count=self.min_slices,
                        poll_interval=e.elastic_poll_interval_seconds,
                        timeout=e.elastic_timeout_seconds,
                        slice_to_devices=self.slice_to_devices,
                        checker=self.checker,
                    )
                )
        except TimeoutError as err:
            self.events.emit("wait_timeout", seconds=round(time.time() - t0, 3), error=str(err))
            raise SlicesUnavailable(
                f"fewer than {self.min_slices} slices healthy after "
                f"elastic_timeout_seconds={e.elastic_timeout_seconds}: {err}"
            ) from None
        log.info("Sufficient slices active: %d >= %d", len(active), self.min_slices)
        self.events.emit("wait_end", active=active, seconds=round(time.time() - t0, 3))
        return active

    # ---- one attempt -------------------------------------------------------------------------------

    def run_attempt(self, number: int, active: list[int]) -> Outcome:
        with phase("building_attempt"):
            attempt = self.attempts([self.slice_to_devices[i] for i in active], **self._attempt_parts(active))
        with contextlib.closing(attempt):
            rewound = max(0, self.stats.last_step - attempt.start_step) if number > 1 else 0
            if number == 1 and self.previous_last_step is not None:
                rewound = max(0, self.previous_last_step - attempt.start_step)
                self.events.emit(
                    "restart_resumed",
                    last_step=self.previous_last_step,
                    start_step=attempt.start_step,
                    source=attempt.restored_from,
                    steps_lost=rewound,
                )
            self.stats.steps_lost += rewound
            plan = attempt.plan
            self.events.emit(
                "attempt_start",
                attempt=number,
                slices=active,
                start_step=attempt.start_step,
                source=attempt.restored_from,
                steps_rewound=rewound,
                global_batch_size=plan.global_batch_size,
                micro_steps=plan.micro_steps,
                lr_scale=plan.lr_scale,
            )
            log.info(
                "attempt %d: slices=%s global_batch=%d micro_steps=%d lr_scale=%.3f from %s (rewound %d steps)",
                number,
                active,
                plan.global_batch_size,
                plan.micro_steps,
                plan.lr_scale,
                attempt.restored_from,
                rewound,
            )
            if self.injector is not None:
                self.injector.at_step_boundary(attempt.start_step + 1)
            self.snapshots.attempt_started()
            try:
                outcome = self.run_loop(attempt, boundary=self._boundary(active))
                if outcome.kind == SCALE_UP:
                    self._hand_over(attempt, outcome, active)
                return outcome
            except BaseException:
                self._failure_seen_at = time.time()  # before teardown: detection time, not teardown time
                raise
            finally:
                self.snapshots.attempt_ended()
                self.profiler.close()
                self.sync()

    def _attempt_parts(self, active: list[int]) -> dict:
        """Restore source, step guard and checkpoint options of an attempt on `active`."""
        if self.membership is None:
            guard = None if self.injector is None else (lambda fn: self.injector.guard(fn, active))
            return {"snapshots": self.snapshots, "wrap_step": guard}
        membership, formation, timeout_s = self.membership, self.formation, self.elastic.elastic_timeout_seconds
        barrier = membership.checkpoint_barrier(active, formation, dead_after_s=self.heartbeat_dead_after_s)
        watch_orbax_barriers(barrier)  # a peer lost in any of Orbax's barriers is a ProcessFailureError
        return {
            "snapshots": SharedSnapshots(
                self.snapshots,
                self.events,
                barrier=lambda: membership.barrier("attempt_start", formation, active, timeout_s=timeout_s),
            ),
            "wrap_step": lambda fn: membership.guard(
                fn if self.process_faults is None else self.process_faults.wrap(fn), active
            ),
            "checkpoint_multiprocessing": membership.checkpoint_options(active, formation),
            "checkpoint_barrier": barrier,
        }

    def _boundary(self, active: list[int]) -> StepBoundary:
        if self.membership is not None:  # every step: each process saw the same round at this step
            returning = lambda: self.membership.arrived(active)  # noqa: E731
        else:
            returning = ReturnPoller(
                self.slice_to_devices,
                active,
                self.outages,
                single_controller=self.single_controller,
                interval_s=self.elastic.elastic_poll_interval_seconds,
            )
        return StepBoundary(
            active=active,
            stats=self.stats,
            events=self.events,
            profiler=self.profiler,
            snapshots=self.snapshots,
            snapshot_period=self.elastic.snapshot_period,
            local_checkpoint_period=self.local_checkpoint_period,
            wait_for_local_write=self.wait_for_local_write,
            injector=self.injector,
            returning=returning,
        )

    def _hand_over(self, attempt: Attempt, outcome: Outcome, active: list[int]) -> None:
        """Scale-up: snapshot the live state synchronously, so the grown attempt restores this exact step."""
        self.snapshots.take(outcome.step, outcome.state, attempt.iterator.get_state(), block=True)
        if self.membership is not None:
            _settle_save(attempt.checkpointer)  # every process is alive: let an in-flight save commit
        self.events.emit("scale_up_requested", step=outcome.step, returning=list(outcome.returning), active=active)

    # ---- failures ----------------------------------------------------------------------------------

    def _on_slice_down(self, number: int, active: list[int], err: Exception, cause: str = "slice_down") -> None:
        log.warning("Slice down event detected. Retrying.")
        self.stats.failures += 1
        seen = self._failure_seen_at or time.time()
        self.stats.failed_at = seen
        self.snapshots.settle()
        # Stamped with the time the error reached the train function; teardown_s is what closing the
        # failed attempt (in-flight save, iterator, profiler) took after that.
        self.events.emit(
            "slice_down_detected",
            attempt=number,
            last_step=self.stats.last_step,
            slices=active,
            error=str(err).splitlines()[0],
            cause=cause,
            failures=self.stats.failures,
            time=seen,
            teardown_s=round(time.time() - seen, 3),
        )
        self._failure_seen_at = None
        self._failure_marks.append(self.stats.furthest_step)
        budget = RetryBudget(self.elastic.elastic_max_retries, self.elastic.elastic_retry_window_steps)
        if budget.exhausted(self._failure_marks, self.stats.furthest_step):
            self._summary()
            recent = budget.counting(self._failure_marks, self.stats.furthest_step)
            raise ElasticGiveUp(
                f"{recent} slice failures within {budget.window_steps} steps of progress "
                f"(elastic_retry_window_steps) exceed elastic_max_retries={budget.max_retries}: failures come "
                "faster than the run progresses; the newest committed checkpoint is intact"
            )

    def _summary(self) -> None:
        self.events.emit(
            "elastic_summary",
            failures=self.stats.failures,
            steps_lost=self.stats.steps_lost,
            downtime_s=round(self.stats.downtime_s, 3),
        )


def _settle_save(checkpointer) -> None:
    from trainer.checkpoint import CheckpointSaveError

    try:
        checkpointer.wait()
    except CheckpointSaveError as e:  # already logged and emitted; the snapshot carries the state
        log.warning("%s", e)
