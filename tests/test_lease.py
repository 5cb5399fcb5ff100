"""One job per run directory: the lease protocol on a local disk, with injected owners and clocks.

The object-store side (create-only writes with `ifGenerationMatch=0`) runs against a real GCS-API server
in tests/test_gcs_checkpoints.py; the protocol is the same code.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from trainer.checkpoint.fence import FencedWrite, SaveFence
from trainer.checkpoint.lease import LeaseHeld, Owner, RunLease, _alive_here, job_identity


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _owner(job: str = "", host: str = "host-a", pid: int = 4242) -> Owner:
    return Owner(host=host, pid=pid, job=job, boot="b", started="1")


def test_a_second_job_on_a_live_lease_is_refused_naming_the_owner(tmp_path):
    clock = Clock()
    first = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/a"), clock=clock)
    taken = first.acquire()
    assert taken["generation"] == 1 and "previous_owner" not in taken

    clock.now += 30
    second = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/b", host="host-b"), clock=clock)
    with pytest.raises(LeaseHeld, match="in use by job jobset:ns/a on host host-a, pid 4242 .*run_name="):
        second.acquire()
    assert first.still_ours()


def test_a_released_lease_is_taken_at_once_and_the_event_says_from_whom(tmp_path):
    clock = Clock()
    first = RunLease(tmp_path, stale_s=60, owner=_owner("slurm:1"), clock=clock)
    first.acquire()
    first.release()

    second = RunLease(tmp_path, stale_s=60, owner=_owner("slurm:2"), clock=clock)
    taken = second.acquire()
    assert taken["generation"] == 2 and taken["taken_over"] == "released"
    assert "slurm:1" in taken["previous_owner"]
    assert not first.still_ours()


class Sleeps:
    """An injected sleep that moves the fake clock (and may let the holder beat meanwhile)."""

    def __init__(self, clock: Clock, meanwhile=lambda: None):
        self.clock, self.meanwhile, self.slept = clock, meanwhile, []

    def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock.now += seconds
        self.meanwhile()


def test_a_restart_of_the_same_job_takes_it_at_once_a_stale_one_after_the_bound(tmp_path):
    clock = Clock()
    RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/a", pid=1), clock=clock).acquire()
    restarted = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/a", pid=2), clock=clock)
    assert restarted.acquire()["taken_over"] == "same_job"

    sleeps = Sleeps(clock)
    other = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/b", host="host-b"), clock=clock, sleep=sleeps)
    clock.now += 61  # the holder's heartbeat is now 61 s old
    taken = other.acquire()
    assert taken["generation"] == 3 and taken["taken_over"].startswith("stale_")
    assert sleeps.slept == [], "a stale holder is taken over at once"


def test_a_holder_on_another_host_that_stopped_beating_is_waited_out_then_taken_over(tmp_path):
    """A holder killed -9 (or whose node was lost) on another host: its heartbeat stops. The next job
    waits until the heartbeat is stale instead of exiting 2, then takes the run over."""
    clock = Clock()
    RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/a", host="host-a"), clock=clock).acquire()
    clock.now += 31  # silent for more than 3 heartbeat intervals (10 s each at stale_s=60)

    sleeps = Sleeps(clock)
    taker = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/b", host="host-b"), clock=clock, sleep=sleeps)
    taken = taker.acquire()
    assert taken["generation"] == 2 and taken["taken_over"].startswith("stale_")
    assert 29 <= sum(sleeps.slept) <= 29 + 10, "waited until the heartbeat was stale, not longer"
    assert max(sleeps.slept) <= 10, "re-read at least every heartbeat interval"
    assert taker.still_ours()


def test_a_holder_that_beats_again_while_waited_on_is_live_and_the_start_is_refused(tmp_path):
    """Its heartbeats look 40 s old from here (its clock runs 40 s behind this host's), older than 3 missed
    beats, but it renews: a new heartbeat while it is waited on makes it live."""
    clock = Clock()
    behind = Clock(clock.now - 40)
    holder = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/a", host="host-a"), clock=behind)
    holder.acquire()

    def holder_beats():
        behind.now = clock.now - 40
        holder.renew()
        assert len(sleeps.slept) < 20, "still waiting on a holder that keeps beating"

    sleeps = Sleeps(clock, meanwhile=holder_beats)
    other = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/b", host="host-b"), clock=clock, sleep=sleeps)
    with pytest.raises(LeaseHeld, match="in use by job jobset:ns/a"):
        other.acquire()
    assert len(sleeps.slept) == 1 and holder.still_ours()


def test_a_holder_beating_on_time_is_refused_without_waiting(tmp_path):
    clock = Clock()
    RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/a", host="host-a"), clock=clock).acquire()
    clock.now += 20  # within 3 heartbeat intervals: live
    sleeps = Sleeps(clock)
    other = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/b", host="host-b"), clock=clock, sleep=sleeps)
    with pytest.raises(LeaseHeld):
        other.acquire()
    assert sleeps.slept == []


def test_a_dead_process_of_this_host_is_taken_over_at_once(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = Owner.this_process()
    dead = Owner(dead.host, int(gone.stdout), "", dead.boot, dead.started)
    RunLease(tmp_path, stale_s=3600, owner=dead).acquire()

    assert RunLease(tmp_path, stale_s=3600).acquire()["taken_over"] == "owner_process_gone"


def test_a_live_process_of_this_host_is_not_taken_for_dead(tmp_path):
    me = Owner.this_process()
    assert _alive_here(dataclasses.asdict(me)) is True, "this process, by pid, boot and start time"
    reused = dataclasses.replace(me, started=str(int(me.started or 0) + 1))
    assert _alive_here(dataclasses.asdict(reused)) is False, "a reused pid is not its old owner"
    assert _alive_here({**dataclasses.asdict(me), "host": "elsewhere"}) is None, "another host: unknown"
    RunLease(tmp_path, stale_s=3600).acquire()  # this very process
    other = RunLease(tmp_path, stale_s=3600, owner=dataclasses.replace(me, job="x"))
    with pytest.raises(LeaseHeld):
        other.acquire()


def test_a_holder_taken_over_while_frozen_finds_out_and_its_saves_are_fenced(tmp_path):
    clock = Clock()
    frozen = RunLease(tmp_path, stale_s=60, owner=_owner("a"), clock=clock)
    frozen.acquire()
    fence = SaveFence(frozen)
    epoch = fence.advance()
    fence.check(epoch, 10)  # still ours: commits

    clock.now += 120
    RunLease(tmp_path, stale_s=60, owner=_owner("b", host="host-b"), clock=clock).acquire()

    assert not frozen.renew() and frozen.lost
    with pytest.raises(FencedWrite, match="no longer holds the run's lease"):
        fence.check(epoch, 20)


def test_old_generations_are_pruned(tmp_path):
    clock = Clock()
    for i in range(8):
        lease = RunLease(tmp_path, stale_s=60, owner=_owner(f"job{i}"), clock=clock)
        lease.acquire()
        lease.release()
    assert sorted(int(p.stem) for p in (tmp_path / "lease").iterdir()) == [5, 6, 7, 8]


def test_the_job_is_named_by_the_scheduler_it_runs_under():
    assert job_identity({"JOBSET_NAME": "run-1", "POD_NAMESPACE": "ml"}) == "jobset:ml/run-1"
    assert job_identity({"SLURM_JOB_ID": "77"}) == "slurm:77"
    assert job_identity({"TRAINER_JOB_ID": "x", "SLURM_JOB_ID": "77"}) == "trainer:x"
    assert job_identity({}) == ""
