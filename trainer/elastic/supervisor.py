"""The supervisor: runs train attempts and, with elastic_enabled, retries them in-process across slice failures.

Every run goes through it (one code path): without elastic_enabled a slice failure ends the run, but
nan_policy=rollback, snapshots and the profiler window work the same either way.

The supervisor is the retry policy over a `Cluster` (`trainer.elastic.cluster`): the cluster says which
slices are healthy, whether an error is a slice-down event, and what an attempt needs from the machines it
runs on; the supervisor decides what to do about it. `LocalCluster` (`trainer.elastic.local_cluster`) is
one controller (Pathways, or local virtual slices with injected faults); `ProcessCluster`
(`trainer.elastic.process_cluster`) is several processes joined by jax.distributed, where a slice is a
group of processes and `Membership` replaces the health checks; `FixedCluster` is several processes
without elastic_enabled. The run's backend (`trainer.elastic.backends`) picks one; every capability
the supervisor uses is in the `Cluster` contract, with a default where a cluster lacks it.

Semantics follow pathwaysutils' `Manager.elastic_retry`: before each attempt wait for enough slices
(`Cluster.wait_for_slices`); an error the cluster classifies as slice-down (`Cluster.slice_down_cause`:
on Pathways pathwaysutils' classifier, with several processes a lost peer or a failed collective) ends
the attempt and is retried; returning slices end it at a step boundary and the next attempt runs on them
too; anything else propagates, after the cluster told the other processes (`Cluster.fail`). What we add:
the same code on local virtual slices and on several processes, host-RAM snapshots, replica-resize with a
batch policy, no-loss scale-up, executable reuse and a measured timeline.

Pause-and-resume: `elastic_min_slice_count=-1` waits for every slice. Replica-resize: with
`1 <= elastic_min_slice_count < num_slices` the next attempt runs on whatever healthy slices exist
(at least that many) and grows back when the others return.

When a slice dies at step N (its step fails; the steps before it completed):
1. The step raises out of the train loop (the loop first writes step N-1's metrics) and out of
   `run_attempt`, which notes the time; closing the attempt settles an in-flight save for a bounded time.
2. The cluster classifies the error (with several processes after a round, so that a peer's own recorded
   error ends this process too); `_on_slice_down` counts the failure (giving up when failures come
   faster than progress: `trainer.elastic.retry_budget`) and starts the downtime clock.
3. `wait_for_slices` waits until enough slices are healthy (all of them under pause-and-resume). A
   formation that brings fresh devices (new communicators) drops the compiled plans.
4. The next attempt is built on them (`trainer.attempt.builder`: a slice set seen before reuses its compiled
   step; the cluster's `AttemptParts` give its snapshot source, step guard and checkpoint barrier) and
   restores by the one restore order (`trainer.attempt.restore`): the newest host snapshot, else the newest
   committed checkpoint. The steps between that point and N-1 are counted as lost.
5. Its first completed step ends the downtime (`trainer.elastic.boundary`); training goes on. When the
   lost slice returns (`Cluster.returning`), the loop ends at a step boundary with a scale-up outcome: the
   state is snapshotted synchronously (and the cluster settles what it must: `Cluster.hand_over`) and the
   next attempt, on every slice, restores exactly that step.

A SIGTERM outside a step boundary (`Preempted`) writes the newest host snapshot to the local tier and
asks the cluster to stop the other processes too (`Cluster.propose_stop`); the cluster is closed when the
run ends, however it ends (`Cluster.close`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from itertools import combinations
from typing import Any, Protocol

import jax
from jax.experimental.multihost_utils import ProcessFailureError

from trainer.attempt.builder import MAX_LAYOUTS, Attempt, AttemptParts
from trainer.attempt.outcome import SDC, Outcome, Rollback, ScaleUp
from trainer.config.schema import ElasticConfig
from trainer.distributed.fatal import PeerFailed
from trainer.elastic.boundary import RecoveryStats, StepBoundary
from trainer.elastic.cluster import Cluster
from trainer.elastic.errors import ElasticGiveUp, SlicesUnavailable
from trainer.elastic.periods import FixedPeriods
from trainer.elastic.retry_budget import RetryBudget
from trainer.elastic.snapshot import HostSnapshots
from trainer.observe import catalogue
from trainer.process.preemption import Phases, Preempted

log = logging.getLogger(__name__)


class Attempts(Protocol):
    """What builds the attempts of a run (`trainer.attempt.builder.AttemptBuilder`)."""

    def __call__(self, slices: list[list], parts: AttemptParts, *, not_after: int | None = None) -> Attempt:
        """One attempt on `slices` (the active ones' devices) with the cluster's `parts`."""

    def forget_compiled(self) -> None:
        """Drop every compiled plan: the devices they were compiled for are gone."""

    def compile_ahead(self, slice_sets: list[list[list]]) -> Any:
        """Compile the steps of each slice set in the background."""

    def close(self) -> None:
        """The run is over: stop compiling ahead."""


class Supervisor:
    """The recovery policy over a `Cluster`. Its parts come in built (`trainer.run.build_supervisor`):

    cluster    the slices and what differs between one controller and several processes
               (`trainer.elastic.cluster`)
    attempts   (slices, parts) -> Attempt (`Attempts`: `trainer.attempt.builder.AttemptBuilder`)
    run_loop   (attempt, boundary=...) -> Outcome (`attempt.loop.train_loop` with the run's sinks and policy)
    snapshots  this process's host-RAM snapshots (`trainer.elastic.snapshot.HostSnapshots`)
    sync       copies the run's logs to their final place (`RunPaths.sync`), after every attempt
    periods    the snapshot and local-tier periods (`trainer.elastic.periods`: numbers, or planned when
               `auto`); none given: snapshot_period as a number (auto: none)
    phases     the process's phases (waiting for slices and building an attempt are phases of their own)
    previous_last_step  the last step an earlier process of this run recorded (a restart after the
               process was lost): the first attempt counts the steps it rewinds behind it as lost
    """

    def __init__(
        self,
        elastic: ElasticConfig,
        cluster: Cluster,
        *,
        attempts: Attempts,
        run_loop: Callable[..., Outcome],
        events,
        profiler,
        snapshots: HostSnapshots,
        sync: Callable[[], None] = lambda: None,
        periods=None,
        wait_for_local_write: bool = False,
        previous_last_step: int | None = None,
        phases: Phases | None = None,
    ):
        self.elastic = elastic
        self.cluster = cluster
        self.attempts = attempts
        self.run_loop = run_loop
        self.events = events
        self.profiler = profiler
        self.snapshots = snapshots
        self.sync = sync
        self.periods = periods or FixedPeriods(snapshot=max(0, elastic.snapshot_period))
        self.phases = phases or Phases()
        self.wait_for_local_write = wait_for_local_write
        self.previous_last_step = previous_last_step
        self.total = cluster.num_slices
        count = elastic.elastic_min_slice_count
        self.min_slices = self.total if count == -1 else count
        self.stats = RecoveryStats()
        self._failure_seen_at: float | None = None
        self._failure_marks: list[int] = []  # the run's furthest step at each failure
        self._not_after: int | None = None  # a rollback's bound on the next attempt's restored step

    # ---- the retry loop ----------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            return self._run()
        except Preempted:  # SIGTERM outside a step boundary (trainer.process.preemption)
            self.emergency_save()
            self.cluster.propose_stop(self.stats.last_step)  # several processes: the others stop too
            raise
        finally:
            self.attempts.close()
            self.cluster.close()

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
                    self.cluster.fail(err)
                    raise
                self._on_slice_down(number, active, err, cause)
                continue
            except (PeerFailed, ElasticGiveUp, KeyboardInterrupt):
                raise
            except Exception as err:
                self.cluster.fail(err)
                raise
            if isinstance(outcome, ScaleUp):
                back = list(outcome.returning)
                self.events.emit(catalogue.SCALE_UP, step=outcome.step, detail=f"slices {back} are back")
            elif isinstance(outcome, Rollback):
                self._roll_back(outcome)
            else:
                self.snapshots.wait_for_copy()
                self._summary()
                return outcome

    def _roll_back(self, outcome: Rollback) -> None:
        """The next attempt restores the newest saved state before `outcome.step` (and not after its bound)."""
        self._quarantine(outcome)
        why = outcome.cause or "non-finite loss/gradients"
        log.warning("%s at step %d: rolling back to the newest saved state", why, outcome.step)
        cause = {"cause": outcome.cause} if outcome.cause else {}
        if outcome.not_after is not None:
            self._not_after = cause["not_after"] = outcome.not_after
        self.events.emit(catalogue.ROLLBACK, step=outcome.step, last_step=self.stats.last_step, **cause)

    def _quarantine(self, outcome: Rollback) -> None:
        """sdc_quarantine: the one slice a failed replay check named is treated as lost from now on."""
        if outcome.cause != SDC or not self.elastic.sdc_quarantine or len(outcome.suspects) != 1:
            return
        (suspect,) = outcome.suspects
        if self.cluster.quarantine(suspect):
            self.events.emit(catalogue.SDC_QUARANTINED, step=outcome.step, slice=suspect)
        else:
            log.warning(
                "sdc_quarantine: this cluster cannot take slice %d out of service; it stays in use", suspect
            )

    def emergency_save(self) -> None:
        """A stop outside a step boundary: write the newest host snapshot to the local tier when it is newer
        than the local tier's newest step (the run resumes from the newest of the tiers). Safe to call from
        the stop watchdog's thread."""
        step = self.snapshots.persist_latest()
        if step is not None:
            log.warning("stopping: host snapshot of step %d written to the local checkpoint tier", step)

    def _slice_down_cause(self, err: Exception) -> str | None:
        """Why `err` is a slice-down event ("peer_lost", "collective_failed", "slice_down"), or None when it
        is not one and ends the run (always None without elastic_enabled). The cluster decides; it may raise
        PeerFailed (another process's own error, seen first)."""
        if not self.elastic.elastic_enabled:
            return None
        return self.cluster.slice_down_cause(err)

    def wait_for_slices(self) -> list[int]:
        with self.phases.enter("waiting_for_slices"):
            return self._wait_for_slices()

    def _wait_for_slices(self) -> list[int]:
        e = self.elastic
        if not e.elastic_enabled:
            return list(range(self.total))
        t0 = time.time()
        self.events.emit(catalogue.WAIT_START, min_slices=self.min_slices, total_slices=self.total)
        try:
            ready = self.cluster.wait_for_slices(self.min_slices)
            if ready.fresh_devices:  # the compiled plans ran on device objects that are gone
                self.attempts.forget_compiled()
            active = ready.active
        except TimeoutError as err:
            self.events.emit(catalogue.WAIT_TIMEOUT, seconds=round(time.time() - t0, 3), error=str(err))
            raise SlicesUnavailable(
                f"fewer than {self.min_slices} slices healthy after "
                f"elastic_timeout_seconds={e.elastic_timeout_seconds}: {err}"
            ) from None
        log.info("Sufficient slices active: %d >= %d", len(active), self.min_slices)
        self.events.emit(catalogue.WAIT_END, active=active, seconds=round(time.time() - t0, 3))
        return active

    # ---- one attempt -------------------------------------------------------------------------------

    def run_attempt(self, number: int, active: list[int]) -> Outcome:
        with self.phases.enter("building_attempt"):
            parts = self.cluster.attempt_parts(active, self.snapshots)
            attempt = self.attempts(self.cluster.devices(active), parts, not_after=self._not_after)
            self._not_after = None
        if number == 1:
            self._compile_ahead(active)
        with contextlib.closing(attempt):
            rewound = max(0, self.stats.last_step - attempt.start_step) if number > 1 else 0
            if number == 1 and self.previous_last_step is not None:
                rewound = max(0, self.previous_last_step - attempt.start_step)
                self.events.emit(
                    catalogue.RESTART_RESUMED,
                    last_step=self.previous_last_step,
                    start_step=attempt.start_step,
                    source=attempt.restored_from,
                    steps_lost=rewound,
                )
            self.stats.steps_lost += rewound
            batch = attempt.batch_layout
            self.events.emit(
                catalogue.ATTEMPT_START,
                attempt=number,
                slices=active,
                start_step=attempt.start_step,
                source=attempt.restored_from,
                steps_rewound=rewound,
                global_batch_size=batch.global_batch_size,
                micro_steps=batch.micro_steps,
                lr_scale=batch.lr_scale,
            )
            log.debug(  # the attempt_start event says it to people
                "attempt %d: slices=%s global_batch=%d micro_steps=%d lr_scale=%.3f from %s (rewound %d steps)",
                number,
                active,
                batch.global_batch_size,
                batch.micro_steps,
                batch.lr_scale,
                attempt.restored_from,
                rewound,
            )
            self.cluster.at_step_boundary(attempt.start_step + 1)  # faults due before the first step
            self.snapshots.attempt_started()
            self.periods.attempt_started(attempt.start_step)
            try:
                outcome = self.run_loop(attempt, boundary=self._boundary(active))
                if isinstance(outcome, ScaleUp):
                    self._hand_over(attempt, outcome, active)
                return outcome
            except BaseException:
                self._failure_seen_at = time.time()  # before teardown: detection time, not teardown time
                raise
            finally:
                self.snapshots.attempt_ended()
                self.profiler.close()
                self.sync()

    def _compile_ahead(self, active: list[int]) -> None:
        """Replica-resize: compile the steps for every set of survivors the run may continue on, in the
        background, so the first resize finds its executable (one controller only: its devices, and so
        executables compiled for them, outlive attempts)."""
        if not (self.elastic.elastic_enabled and self.cluster.compiles_ahead):
            return
        # Largest first: one lost slice (the likeliest failure) needs a set of len(active) - 1.
        low = max(1, self.min_slices)
        sets = [list(c) for k in range(len(active) - 1, low - 1, -1) for c in combinations(active, k)]
        if not sets:
            return
        if len(sets) >= MAX_LAYOUTS:
            log.info("not compiling ahead: %d survivor sets exceed the layout cache (%d)", len(sets), MAX_LAYOUTS)
            return
        log.info("compiling ahead for %d survivor sets: %s", len(sets), sets)
        self.attempts.compile_ahead([self.cluster.devices(s) for s in sets])

    def _boundary(self, active: list[int]) -> StepBoundary:
        return StepBoundary(
            active=active,
            stats=self.stats,
            events=self.events,
            profiler=self.profiler,
            snapshots=self.snapshots,
            periods=self.periods,
            wait_for_local_write=self.wait_for_local_write,
            injector=self.cluster,  # its at_step_boundary: fault injection on local virtual slices
            returning=self.cluster.returning(active),
        )

    def _hand_over(self, attempt: Attempt, outcome: ScaleUp, active: list[int]) -> None:
        """Scale-up: snapshot the live state synchronously, so the grown attempt restores this exact step."""
        self.snapshots.take(outcome.step, outcome.state, attempt.iterator.get_state(), block=True)
        self.cluster.hand_over(attempt)  # several processes: an in-flight save commits first
        self.events.emit(
            catalogue.SCALE_UP_REQUESTED, step=outcome.step, returning=list(outcome.returning), active=active
        )

    # ---- failures ----------------------------------------------------------------------------------

    def _on_slice_down(self, number: int, active: list[int], err: Exception, cause: str = "slice_down") -> None:
        log.warning("Slice down event detected. Retrying.")
        self.stats.failures += 1
        seen = self._failure_seen_at or time.time()
        self.stats.failed_at = seen
        self.snapshots.wait_for_copy()
        # Stamped with the time the error reached the train function; teardown_s is what closing the
        # failed attempt (in-flight save, iterator, profiler) took after that.
        self.events.emit(
            catalogue.SLICE_DOWN_DETECTED,
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
            catalogue.ELASTIC_SUMMARY,
            failures=self.stats.failures,
            steps_lost=self.stats.steps_lost,
            downtime_s=round(self.stats.downtime_s, 3),
        )
