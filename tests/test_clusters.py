"""The supervisor as a retry policy over a `Cluster`, and each cluster on its own.

A scripted cluster drives the supervisor (no devices, no processes); `LocalCluster` runs on the test's
CPU devices as virtual slices; `ProcessCluster` runs over a fake membership and a fake coordination
client. The whole path is exercised by tests/test_elastic.py (one process) and tests/test_multiprocess.py
(several, soak tier).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import jax
import pytest
from jax.experimental.multihost_utils import ProcessFailureError

from trainer.attempt.builder import AttemptParts
from trainer.attempt.outcome import Finished, Rollback, ScaleUp
from trainer.config.schema import ElasticConfig
from trainer.distributed.fatal import PeerFailed
from trainer.elastic.cluster import ActiveSlices, Cluster, FixedCluster
from trainer.elastic.errors import ElasticGiveUp, SlicesUnavailable
from trainer.elastic.faults import FaultInjector
from trainer.elastic.local_cluster import LocalCluster
from trainer.elastic.process_cluster import ProcessCluster
from trainer.elastic.snapshot import HostSnapshots
from trainer.elastic.supervisor import Supervisor
from trainer.failures.slice_loss import Outages, SliceLoss, slice_down_error
from trainer.process.preemption import Preempted

ELASTIC = ElasticConfig(elastic_enabled=True, elastic_poll_interval_seconds=0.01, elastic_timeout_seconds=30)


class Events:
    def __init__(self):
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, name, **fields):
        self.emitted.append((name, fields))

    def names(self) -> list[str]:
        return [name for name, _ in self.emitted]

    def of(self, name: str) -> list[dict]:
        return [fields for n, fields in self.emitted if n == name]


class Profiler:
    def close(self):
        pass


class Attempt:
    def __init__(self, start_step: int = 0):
        self.start_step = start_step
        self.restored_from = "init"
        self.batch_layout = SimpleNamespace(global_batch_size=8, micro_steps=1, lr_scale=1.0)
        self.iterator = SimpleNamespace(get_state=lambda: {"position": 0})
        self.checkpointer = None
        self.closed = False

    def close(self):
        self.closed = True


class ScriptedCluster(Cluster):
    """A Cluster whose answers the test sets: `waits` (ActiveSlices or an exception, one per wait) and
    `causes` (err -> cause); it records every call."""

    def __init__(self, num_slices: int = 2, *, waits=None, causes=None):
        self.num_slices = num_slices
        self.waits = list(waits or [])
        self.causes = causes or (lambda err: None)
        self.calls: list[tuple] = []
        self.generation = 0

    def wait_for_slices(self, min_slices):
        self.calls.append(("wait_for_slices", min_slices))
        answer = self.waits.pop(0) if self.waits else ActiveSlices(list(range(self.num_slices)))
        if isinstance(answer, BaseException):
            raise answer
        if answer.fresh_devices:
            self.generation += 1
        return answer

    def devices(self, active):
        return [[(s, self.generation)] for s in active]

    def slice_down_cause(self, err):
        self.calls.append(("slice_down_cause", err))
        return self.causes(err)

    def fail(self, err):
        self.calls.append(("fail", err))

    def attempt_parts(self, active, snapshots):
        self.calls.append(("attempt_parts", list(active)))
        return AttemptParts(snapshots=snapshots, wrap_step="guard")

    def at_step_boundary(self, next_step, in_flight=None):
        self.calls.append(("at_step_boundary", next_step))

    def returning(self, active):
        return list

    def hand_over(self, attempt):
        self.calls.append(("hand_over", attempt))

    def propose_stop(self, last_step):
        self.calls.append(("propose_stop", last_step))

    def close(self):
        self.calls.append(("close",))

    def called(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


class Attempts:
    """attempts(slices, parts): records what each attempt got; `forget_compiled`, `compile_ahead` and
    `close` like AttemptBuilder's."""

    def __init__(self):
        self.built: list[tuple[list, AttemptParts]] = []
        self.attempts: list[Attempt] = []
        self.forgotten = 0
        self.compiled_ahead: list[list] = []

    def __call__(self, slices, parts, *, not_after=None):
        self.built.append((slices, parts))
        self.attempts.append(Attempt(start_step=len(self.built) - 1))
        return self.attempts[-1]

    def forget_compiled(self):
        self.forgotten += 1

    def compile_ahead(self, slice_sets):
        self.compiled_ahead.extend(slice_sets)

    def close(self):
        pass


def _supervisor(cluster, script, *, elastic=ELASTIC, snapshots=None, events=None):
    """A supervisor whose loop, per attempt, raises or returns the next item of `script`."""
    script = list(script)

    def run_loop(attempt, boundary):
        item = script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    events = events or Events()
    attempts = Attempts()
    sup = Supervisor(
        elastic,
        cluster,
        attempts=attempts,
        run_loop=run_loop,
        events=events,
        profiler=Profiler(),
        snapshots=snapshots or HostSnapshots(events),
    )
    return sup, attempts, events


def _data_loss():
    return jax.errors.JaxRuntimeError("DATA_LOSS: slice(s) [1] lost during the step (test)")


# ---- the supervisor over a scripted cluster ----------------------------------------------------


def test_a_slice_down_event_is_counted_and_retried_on_the_slices_the_cluster_gives(caplog):
    elastic = ElasticConfig(elastic_enabled=True, elastic_min_slice_count=1)
    cluster = ScriptedCluster(2, waits=[ActiveSlices([0, 1]), ActiveSlices([1])], causes=lambda e: "slice_down")
    sup, attempts, events = _supervisor(cluster, [_data_loss(), Finished(5)], elastic=elastic)
    with caplog.at_level(logging.INFO, logger="trainer.elastic.supervisor"):
        outcome = sup.run()
    assert isinstance(outcome, Finished)
    assert "Slice down event detected. Retrying." in caplog.text
    assert "Sufficient slices active: 2 >= 1" in caplog.text and "Sufficient slices active: 1 >= 1" in caplog.text
    assert cluster.called("wait_for_slices") == [("wait_for_slices", 1)] * 2
    assert [slices for slices, _ in attempts.built] == [[[(0, 0)], [(1, 0)]], [[(1, 0)]]]
    assert attempts.built[0][1] == AttemptParts(
        snapshots=sup.snapshots,
        wrap_step="guard",
        wrap_replay=None,
        checkpoint_multiprocessing=None,
        checkpoint_barrier=None,
    )
    (down,) = events.of("slice_down_detected")
    assert down["cause"] == "slice_down" and down["attempt"] == 1 and down["slices"] == [0, 1]
    assert down["failures"] == 1 and down["error"].startswith("DATA_LOSS")
    assert [a["slices"] for a in events.of("attempt_start")] == [[0, 1], [1]]
    assert events.of("elastic_summary") == [{"failures": 1, "steps_lost": 0, "downtime_s": 0.0}]
    assert events.names().count("wait_start") == 2 and events.names().count("wait_end") == 2
    assert cluster.called("fail") == [] and cluster.called("close") == [("close",)]
    assert cluster.called("at_step_boundary") == [("at_step_boundary", 1), ("at_step_boundary", 2)]


def test_survivor_sets_compile_ahead_largest_first_since_one_lost_slice_is_the_likeliest_failure():
    elastic = ElasticConfig(elastic_enabled=True, elastic_min_slice_count=1)
    cluster = ScriptedCluster(3)
    cluster.compiles_ahead = True
    sup, attempts, _ = _supervisor(cluster, [Finished(5)], elastic=elastic)
    sup.run()
    queued = attempts.compiled_ahead
    assert [[s for [(s, _)] in slices] for slices in queued] == [[0, 1], [0, 2], [1, 2], [0], [1], [2]]


def test_this_process_own_error_is_told_to_the_cluster_then_raised():
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    cluster = ScriptedCluster(causes=lambda e: None)
    sup, attempts, events = _supervisor(cluster, [oom])
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        sup.run()
    assert cluster.called("slice_down_cause") == [("slice_down_cause", oom)]
    assert cluster.called("fail") == [("fail", oom)]
    assert cluster.calls[-1] == ("close",)
    assert "slice_down_detected" not in events.names()


def test_an_error_that_is_no_device_error_is_told_to_the_cluster_without_asking_why():
    bug = ValueError("a bug")
    cluster = ScriptedCluster(causes=lambda e: pytest.fail("only device and peer errors are classified"))
    sup, _, _ = _supervisor(cluster, [bug])
    with pytest.raises(ValueError, match="a bug"):
        sup.run()
    assert cluster.called("fail") == [("fail", bug)]


def test_another_process_failure_seen_while_classifying_ends_this_one_without_failing_it():
    def peer_failed(err):
        raise PeerFailed("process 2 failed: JaxRuntimeError: RESOURCE_EXHAUSTED; every process stops")

    cluster = ScriptedCluster(causes=peer_failed)
    sup, _, _ = _supervisor(cluster, [ProcessFailureError(set())])
    with pytest.raises(PeerFailed, match="process 2 failed"):
        sup.run()
    assert cluster.called("fail") == [] and cluster.calls[-1] == ("close",)


def test_failures_faster_than_progress_give_up_by_the_retry_budget():
    elastic = ElasticConfig(elastic_enabled=True, elastic_max_retries=2, elastic_retry_window_steps=50)
    cluster = ScriptedCluster(causes=lambda e: "slice_down")
    sup, attempts, events = _supervisor(cluster, [_data_loss() for _ in range(5)], elastic=elastic)
    with pytest.raises(ElasticGiveUp, match="3 slice failures within 50 steps"):
        sup.run()
    assert len(attempts.built) == 3 and len(events.of("slice_down_detected")) == 3
    assert events.of("elastic_summary")[-1]["failures"] == 3
    assert cluster.called("fail") == []  # giving up is the policy's decision, not this process's error


def test_without_elastic_enabled_the_cluster_is_not_waited_for_and_a_slice_failure_ends_the_run():
    cluster = ScriptedCluster(3, causes=lambda e: pytest.fail("nothing is retried without elastic_enabled"))
    sup, attempts, events = _supervisor(cluster, [_data_loss()], elastic=ElasticConfig())
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        sup.run()
    assert cluster.called("wait_for_slices") == [] and "wait_start" not in events.names()
    assert [a["slices"] for a in events.of("attempt_start")] == [[0, 1, 2]]
    assert len(cluster.called("fail")) == 1


def test_a_sigterm_outside_the_step_loop_saves_the_newest_snapshot_and_proposes_the_stop(tmp_path):
    snapshots = HostSnapshots(Events())
    saved = []
    snapshots.persist_latest = lambda: saved.append("persisted") or 7
    cluster = ScriptedCluster(waits=[ActiveSlices([0, 1]), Preempted("waiting_for_slices")])
    sup, _, _ = _supervisor(cluster, [Rollback(4)], snapshots=snapshots)
    sup.stats.last_step = 4
    with pytest.raises(Preempted, match="waiting_for_slices"):
        sup.run()
    assert saved == ["persisted"]
    assert cluster.called("propose_stop") == [("propose_stop", 4)]
    assert cluster.calls[-1] == ("close",)


def test_fresh_devices_from_a_formation_drop_the_compiled_plans_and_the_next_attempt_uses_them():
    cluster = ScriptedCluster(
        2, waits=[ActiveSlices([0, 1]), ActiveSlices([1, 0], fresh_devices=True)], causes=lambda e: "peer_lost"
    )
    sup, attempts, _ = _supervisor(cluster, [ProcessFailureError(set()), Finished(3)])
    sup.run()
    assert attempts.forgotten == 1
    assert [slices for slices, _ in attempts.built] == [[[(0, 0)], [(1, 0)]], [[(1, 1)], [(0, 1)]]]


def test_scale_up_snapshots_the_live_state_lets_the_cluster_hand_over_and_runs_on_every_slice():
    events = Events()
    snapshots = HostSnapshots(events)
    taken = []
    snapshots.take = lambda step, state, data_state, **kw: taken.append((step, state, data_state, kw))
    cluster = ScriptedCluster(3, waits=[ActiveSlices([0, 1]), ActiveSlices([0, 1, 2])])
    sup, attempts, _ = _supervisor(
        cluster,
        [ScaleUp(6, state="live", returning=(2,)), Finished(9)],
        snapshots=snapshots,
        events=events,
    )
    sup.run()
    assert taken == [(6, "live", {"position": 0}, {"block": True})]
    assert len(cluster.called("hand_over")) == 1
    assert events.of("scale_up_requested") == [{"step": 6, "returning": [2], "active": [0, 1]}]
    assert events.of("scale_up") == [{"step": 6, "detail": "slices [2] are back"}]
    assert [a["slices"] for a in events.of("attempt_start")] == [[0, 1], [0, 1, 2]]
    assert all(a.closed for a in attempts.attempts)


def test_slices_not_back_in_time_are_unavailable():
    cluster = ScriptedCluster(waits=[TimeoutError("1 complete slice(s) [0] < 2 after 30 s")])
    sup, _, events = _supervisor(cluster, [])
    with pytest.raises(SlicesUnavailable, match="elastic_timeout_seconds=30"):
        sup.run()
    assert events.of("wait_timeout")[0]["error"].startswith("1 complete slice")
    assert cluster.called("fail") == []


# ---- LocalCluster: one controller, local virtual slices ----------------------------------------


def _local(num_slices: int = 2, *, faults=(), outages=None):
    outages = outages or Outages()
    events = Events()
    injector = FaultInjector(list(faults), outages, None, events)
    slices = [[d] for d in jax.devices()[:num_slices]]
    return LocalCluster(slices, timeout_s=10, poll_s=0.01, outages=outages, injector=injector), events


def test_local_cluster_classifies_by_pathwaysutils_and_takes_a_lost_process_for_a_lost_peer():
    cluster, _ = _local()
    assert cluster.slice_down_cause(slice_down_error([1], "test")) == "slice_down"
    assert cluster.slice_down_cause(ProcessFailureError(set())) == "peer_lost"
    assert cluster.slice_down_cause(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")) is None
    cluster.fail(RuntimeError("own"))  # nobody else to tell
    cluster.propose_stop(3)
    cluster.close()


def test_local_cluster_waits_for_the_healthy_slices_and_sees_a_returning_one():
    clock = [0.0]
    outages = Outages(clock=lambda: clock[0])
    cluster, _ = _local(3, outages=outages)
    outages.mark_down(1, down_s=5)
    ready = cluster.wait_for_slices(2)
    assert ready == ActiveSlices([0, 2])
    assert cluster.devices(ready.active) == [[jax.devices()[0]], [jax.devices()[2]]]
    assert cluster.returning([0, 2])() == []  # slice 1 is still down
    clock[0] = 10.0
    assert cluster.returning([0, 2])() == [1]


def test_local_cluster_injects_faults_at_step_boundaries_and_its_step_guard_fails_on_a_down_slice():
    cluster, events = _local(2, faults=[SliceLoss(step=3, slice=1, down_s=60)])
    snapshots = HostSnapshots(events)
    parts = cluster.attempt_parts([0, 1], snapshots)
    assert parts.snapshots is snapshots and parts.checkpoint_barrier is None
    step = parts.wrap_step(lambda state, batch: (state, {"loss": 1.0, "finite": True}))
    cluster.at_step_boundary(1)
    assert step(0, None) == (0, {"loss": 1.0, "finite": True})
    cluster.at_step_boundary(3)
    assert [f["slice"] for f in events.of("slice_killed")] == [1]
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        step(0, None)
    assert cluster.wait_for_slices(1) == ActiveSlices([0])


def test_local_cluster_on_pathways_has_no_injector():
    cluster = LocalCluster([[d] for d in jax.devices()[:2]], timeout_s=1, poll_s=0.01, single_controller=True)
    parts = cluster.attempt_parts([0, 1], "snapshots")
    assert parts == AttemptParts(snapshots="snapshots")
    cluster.at_step_boundary(1)


# ---- ProcessCluster: several processes over a membership -----------------------------------------


class Client:
    """The coordination service's key-value calls that trainer.distributed.fatal uses."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value):
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]


class FakeMembership:
    """What ProcessCluster asks of a Membership, recorded."""

    def __init__(self, num_slices: int = 3, me: int = 1):
        self.client = Client()
        self.me = me
        self.num_slices = num_slices
        self.fresh_clients = 0
        self.calls: list[tuple] = []
        self.next_fresh = False

    def slice_devices(self):
        return [[f"dev{s}.{self.fresh_clients}"] for s in range(self.num_slices)]

    def round(self):
        self.calls.append(("round",))
        return {p: 0 for p in range(self.num_slices)}

    def wait_for_slices(self, min_slices, *, timeout_s, poll_s, should_stop):
        self.calls.append(("wait_for_slices", min_slices, timeout_s, poll_s, should_stop()))
        if self.next_fresh:
            self.fresh_clients += 1
        return SimpleNamespace(slices=(1, 2, 0), key="sig_0")

    def fail(self, err, *, wait_s):
        self.calls.append(("fail", err, wait_s))

    def checkpoint_barrier(self, active, formation, *, dead_after_s):
        return ("barrier", tuple(active), formation.key, dead_after_s)

    def checkpoint_options(self, active, formation):
        return ("options", tuple(active), formation.key)

    def barrier(self, name, formation, active, *, timeout_s):
        self.calls.append(("barrier", name, formation.key, tuple(active), timeout_s))

    def guard(self, fn, active):
        return ("guarded", fn, tuple(active))

    def arrived(self, active):
        return [s for s in range(self.num_slices) if s not in active]


class Stop:
    def __init__(self, agreed=False):
        self._agreed = agreed
        self.proposed: list[int] = []

    def agreed(self):
        return self._agreed

    def propose_after(self, step):
        self.proposed.append(step)


def _process(membership=None, **kw):
    membership = membership or FakeMembership()
    events = Events()
    kw = {"timeout_s": 30.0, "poll_s": 0.5, "dead_after_s": 10.0, "fatal_wait_s": 0.1, **kw}
    return ProcessCluster(membership, events=events, **kw), membership, events


def test_process_cluster_waits_for_a_formation_in_mesh_order_and_rereads_fresh_devices():
    stop = Stop(agreed=False)
    cluster, membership, _ = _process(stop=stop)
    assert cluster.num_slices == 3
    assert cluster.wait_for_slices(2) == ActiveSlices([1, 2, 0], fresh_devices=False)
    assert membership.calls[-1] == ("wait_for_slices", 2, 30.0, 0.5, False)  # the stop is asked
    membership.next_fresh = True
    assert cluster.wait_for_slices(2) == ActiveSlices([1, 2, 0], fresh_devices=True)
    assert cluster.devices([2, 0]) == [["dev2.1"], ["dev0.1"]]


def test_process_cluster_own_errors_end_the_job_peers_and_collectives_are_retried_after_a_round():
    cluster, membership, events = _process()
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while allocating")
    assert cluster.slice_down_cause(oom) is None and membership.calls == []  # no round before fail()
    assert cluster.slice_down_cause(ProcessFailureError(set())) == "peer_lost"
    gloo = jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer")
    assert cluster.slice_down_cause(gloo) == "collective_failed"
    assert membership.calls == [("round",), ("round",)]
    membership.client.kv["trainer/fatal"] = '{"process": 2, "cause": "RuntimeError: bug", "exit_code": 1}'
    with pytest.raises(PeerFailed, match="process 2 failed: RuntimeError: bug"):
        cluster.slice_down_cause(ProcessFailureError(set()))

    cluster.fail(oom)
    (told,) = events.of("fatal_error")
    assert told == {"error": "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while allocating"}
    assert membership.calls[-1] == ("fail", oom, 0.1)


def test_process_cluster_never_hides_the_cause_behind_a_failure_to_tell_the_others(caplog):
    cluster, membership, _ = _process()

    def unreachable(err, *, wait_s):
        raise RuntimeError("coordination service gone")

    membership.fail = unreachable
    with caplog.at_level(logging.WARNING):
        cluster.fail(ValueError("a bug"))
    assert "could not tell the other processes" in caplog.text


def test_process_cluster_attempt_parts_share_snapshots_guard_steps_and_watch_orbax_barriers():
    from orbax.checkpoint._src.multihost import multihost

    from trainer.elastic.shared_snapshots import SharedSnapshots

    faults = SimpleNamespace(wrap=lambda fn: ("faulty", fn))
    cluster, membership, _ = _process(process_faults=faults, dead_after_s=7.0)
    cluster.wait_for_slices(3)
    original = multihost.get_barrier_sync_fn
    snapshots = HostSnapshots(Events())
    try:
        parts = cluster.attempt_parts([1, 2, 0], snapshots)
        assert multihost.get_barrier_sync_fn is not original  # Orbax's barriers go through the heartbeat one
        assert parts.checkpoint_barrier == ("barrier", (1, 2, 0), "sig_0", 7.0)
        assert parts.checkpoint_multiprocessing == ("options", (1, 2, 0), "sig_0")
        assert parts.wrap_step("step") == ("guarded", ("faulty", "step"), (1, 2, 0))
        assert isinstance(parts.snapshots, SharedSnapshots) and parts.snapshots.snapshots is snapshots
        parts.snapshots.barrier()
        assert membership.calls[-1] == ("barrier", "attempt_start", "sig_0", (1, 2, 0), 30.0)
    finally:
        cluster.close()
    assert multihost.get_barrier_sync_fn is original


def test_process_cluster_returning_slices_hand_over_and_stop():
    from trainer.checkpoint import CheckpointSaveError

    stop = Stop()
    cluster, _, _ = _process(stop=stop)
    assert cluster.returning([0, 1])() == [2]
    waited = []

    def wait():
        waited.append(True)
        raise CheckpointSaveError(4, "save of step 4 failed")

    cluster.hand_over(SimpleNamespace(checkpointer=SimpleNamespace(wait=wait)))  # logged, not raised
    assert waited == [True]
    cluster.propose_stop(9)
    assert stop.proposed == [9]
    cluster.at_step_boundary(3)  # nothing injected between steps


# ---- FixedCluster: several processes without elastic_enabled -----------------------------------


def test_fixed_cluster_keeps_every_slice_and_only_proposes_the_stop():
    stop = Stop()
    cluster = FixedCluster([["a"], ["b"]], stop=stop)
    assert cluster.num_slices == 2 and cluster.wait_for_slices(1) == ActiveSlices([0, 1])
    assert cluster.devices([1]) == [["b"]]
    assert cluster.slice_down_cause(ProcessFailureError(set())) is None
    assert cluster.attempt_parts([0, 1], "snaps") == AttemptParts(snapshots="snaps")
    assert cluster.returning([0, 1])() == []
    cluster.propose_stop(5)
    assert stop.proposed == [5]
    FixedCluster([["a"]]).propose_stop(5)  # one process: nothing to propose
