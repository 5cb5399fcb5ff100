"""Several processes joined by jax.distributed (no Pathways), elastic: a slice is a group of processes.

`Membership` (`trainer.elastic.membership`) replaces the health checks: a peer lost during a step raises
`ProcessFailureError` on every survivor at that step (a slice-down event); waiting is rounds of
`live_devices` until a stable formation, which every process agrees on (its slices in mesh order); a
replacement seen in a step's round is a scale-up at that step, on every process. A formation after a
failure may come with fresh devices (new CPU communicators): the slices' devices are read again and the
result says so, for compiled plans to be dropped.

An error that is neither a lost peer nor a failed collective is this process's own: it is recorded for
every process (`trainer.distributed.fatal`) and ends the job. Snapshots are shared between processes
(`SharedSnapshots`), behind a barrier of the formation; Orbax's barriers watch the members' heartbeats
(`trainer.distributed.heartbeat`) for the attempt, and get Orbax's own back at the end of the run. A
process's own errors can be injected (`ProcessFaultInjector`); a stop the job agreed on
(`CoordinatedStop.agreed`) ends a wait for slices.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from jax.experimental.multihost_utils import ProcessFailureError

from trainer.attempt.builder import AttemptParts
from trainer.distributed import fatal
from trainer.distributed.heartbeat import watch_orbax_barriers
from trainer.elastic.cluster import ActiveSlices, Cluster
from trainer.elastic.membership import Formation, Membership
from trainer.elastic.shared_snapshots import SharedSnapshots
from trainer.elastic.snapshot import HostSnapshots
from trainer.failures.process_death import ProcessFaultInjector
from trainer.observe import catalogue

log = logging.getLogger(__name__)

FATAL_WAIT_S = 120.0  # how long a process that failed waits for the others to see why (they see it within
# one collective timeout, or at their next round)


class ProcessCluster(Cluster):
    """`membership`: the live processes; `timeout_s` bounds a wait for slices and the barrier before an
    attempt's first collective, `poll_s` spaces the rounds of a wait; `dead_after_s`: a checkpoint barrier
    gives up on a peer whose heartbeat stopped this long ago; `process_faults`: errors injected into this
    process, or None; `stop`: the job's coordinated stop (`trainer.distributed.stop.CoordinatedStop`), or
    None; `fatal_wait_s`: how long this process's own error waits for the others to see it."""

    def __init__(
        self,
        membership: Membership,
        *,
        events,
        timeout_s: float,
        poll_s: float,
        dead_after_s: float,
        process_faults: ProcessFaultInjector | None = None,
        stop=None,
        fatal_wait_s: float = FATAL_WAIT_S,
    ):
        self.membership = membership
        self.events = events
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.dead_after_s = dead_after_s
        self.process_faults = process_faults
        self.stop = stop
        self.fatal_wait_s = fatal_wait_s
        self.slice_to_devices = dict(enumerate(membership.slice_devices()))
        self.formation: Formation | None = None  # the formation of the current attempt

    @property
    def num_slices(self) -> int:
        return len(self.slice_to_devices)

    def wait_for_slices(self, min_slices: int) -> ActiveSlices:
        """Slices in mesh order, agreed by every process."""
        membership, stop = self.membership, self.stop
        clients = membership.fresh_clients
        self.formation = membership.wait_for_slices(
            min_slices,
            timeout_s=self.timeout_s,
            poll_s=self.poll_s,
            should_stop=stop.agreed if stop is not None else lambda: False,
        )
        fresh = membership.fresh_clients != clients
        if fresh:  # new device objects; executables went with the old
            self.slice_to_devices = dict(enumerate(membership.slice_devices()))
        return ActiveSlices(list(self.formation.slices), fresh_devices=fresh)

    def devices(self, active: Sequence[int]) -> list[list]:
        return [self.slice_to_devices[i] for i in active]

    def slice_down_cause(self, err: Exception) -> str | None:
        """An error that is neither a lost peer nor a failed collective (out of memory, a compile error) is
        this process's own and ends the job. Otherwise a round first, so that a peer's recorded fatal error
        is seen (PeerFailed) before its departure or its missing part of a collective is taken for a lost
        peer; a dead or restarted peer is a lost peer, a failed collective with every peer alive (one was
        slow, a connection broke) is retried on fresh communicators."""
        if not isinstance(err, ProcessFailureError) and not fatal.is_collective_failure(err):
            return None  # this process's own error: recorded (by fail) before any round
        self.membership.round()
        fatal.check(self.membership.client, self.membership.me)
        return "peer_lost" if isinstance(err, ProcessFailureError) else "collective_failed"

    def fail(self, err: BaseException) -> None:
        """This process's own error ends every process (trainer.distributed.fatal)."""
        self.events.emit(
            catalogue.FATAL_ERROR, error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        )
        try:
            self.membership.fail(err, wait_s=self.fatal_wait_s)
        except Exception as e:  # the cause is what matters; never hide it behind a failure to tell the others
            log.warning("could not tell the other processes about this failure: %s", e)

    def attempt_parts(self, active: list[int], snapshots: HostSnapshots) -> AttemptParts:
        membership, formation, timeout_s = self.membership, self.formation, self.timeout_s
        barrier = membership.checkpoint_barrier(active, formation, dead_after_s=self.dead_after_s)
        watch_orbax_barriers(barrier)  # a peer lost in any of Orbax's barriers is a ProcessFailureError
        faults = self.process_faults
        return AttemptParts(
            snapshots=SharedSnapshots(
                snapshots,
                self.events,
                barrier=lambda: membership.barrier("attempt_start", formation, active, timeout_s=timeout_s),
            ),
            wrap_step=lambda fn: membership.guard(fn if faults is None else faults.wrap(fn), active),
            checkpoint_multiprocessing=membership.checkpoint_options(active, formation),
            checkpoint_barrier=barrier,
        )

    def at_step_boundary(self, next_step: int, in_flight=None) -> None:
        pass  # lost processes are killed from outside; a process's own errors are injected in its step

    def returning(self, active: list[int]) -> Callable[[], list[int]]:
        membership = self.membership
        return lambda: membership.arrived(active)  # every step: each process saw the same round at this step

    def hand_over(self, attempt) -> None:
        _let_save_commit(attempt.checkpointer)  # every process is alive: let an in-flight save commit

    def propose_stop(self, last_step: int) -> None:
        if self.stop is not None:  # the others stop at the agreed step
            self.stop.propose_after(last_step)

    def close(self) -> None:
        watch_orbax_barriers(None)  # Orbax's own barriers again, outside the attempts


def _let_save_commit(checkpointer) -> None:
    from trainer.checkpoint import CheckpointSaveError

    try:
        checkpointer.wait()
    except CheckpointSaveError as e:  # already logged and emitted; the snapshot carries the state
        log.warning("%s", e)
