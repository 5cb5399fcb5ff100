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


def test_a_restart_of_the_same_job_takes_it_at_once_a_stale_one_after_the_bound(tmp_path):
    clock = Clock()
    RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/a", pid=1), clock=clock).acquire()
    restarted = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/a", pid=2), clock=clock)
    assert restarted.acquire()["taken_over"] == "same_job"

    other = RunLease(tmp_path, stale_s=60, owner=_owner("jobset:ns/b", host="host-b"), clock=clock)
    clock.now += 59
    with pytest.raises(LeaseHeld):
        other.acquire()
    clock.now += 2  # the holder's heartbeat is now 61 s old
    taken = other.acquire()
    assert taken["generation"] == 3 and taken["taken_over"].startswith("stale_")


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
