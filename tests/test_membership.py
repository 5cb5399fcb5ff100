"""Membership's formation protocol and the fatal-error protocol, without starting processes.

A fake coordination client (key-value store) and scripted rounds stand in for jax.distributed; the real
processes are exercised by tests/test_multiprocess.py (soak tier).
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from jax.experimental.multihost_utils import ProcessFailureError, live_devices

from trainer.distributed import fatal
from trainer.distributed.communicators import mesh_cliques
from trainer.elastic.membership import Membership, mesh_order


@pytest.fixture(autouse=True)
def _jax_live_devices_untouched():
    """A formation after a fresh client primes jax's live_devices with the new devices: undo it here."""
    yield
    live_devices.devices = None


class Dev:
    def __init__(self, i: int, generation: int = 0):
        self.id, self.process_index, self.generation = i, i, generation

    def __repr__(self):
        return f"Dev({self.id}, gen={self.generation})"


class FakeClient:
    """The coordination service's key-value calls the trainer uses."""

    def __init__(self):
        self.kv: dict[str, str] = {}
        self.counters: dict[str, int] = {}
        self.deleted: list[str] = []

    def key_value_increment(self, key, n):
        self.counters[key] = self.counters.get(key, 0) + n
        return self.counters[key]

    def key_value_set(self, key, value):
        if key in self.kv:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix + "/")]

    def key_value_delete(self, key):
        self.deleted.append(key)
        self.kv = {k: v for k, v in self.kv.items() if k != key and not k.startswith(key + "/")}


class Scripted(Membership):
    """A Membership whose rounds return what the test says; every other member arrives at each barrier
    when this process's first round there runs."""

    def __init__(self, n: int, me: int, client: FakeClient, *, fresh: bool = True, live=None, cliques_of=None):
        self.generation = 0
        self.rendezvous_forgotten = 0
        super().__init__(
            [Dev(i) for i in range(n)],
            1,
            process_index=me,
            client=client,
            events=None,
            fresh_devices=self._fresh if fresh else None,
            forget_rendezvous=self._forget if fresh else None,
            cliques_of=cliques_of,
        )
        self.live = live or {i: 100 + i for i in range(n)}

    def _fresh(self):
        self.generation += 1
        return [Dev(i, self.generation) for i in range(len(self.live))]

    def _forget(self):
        self.rendezvous_forgotten += 1

    def round(self):
        for key in list(self.client.counters):  # the other members have arrived
            self.client.counters[key] = len(self.live)
        self.previous, self.current = self.current, dict(self.live)
        return dict(self.live)


def test_the_mesh_order_is_fixed_per_slice_set_with_slice_0_last():
    assert mesh_order([0, 1, 2]) == [1, 2, 0]
    assert mesh_order([2, 0]) == [2, 0]
    assert mesh_order([2, 1]) == [1, 2]


def test_any_number_of_formations_keep_the_order_and_each_after_the_first_gets_a_fresh_client():
    client = FakeClient()
    m = Scripted(3, 0, client)
    m.round()
    first = m._form("sig", [0, 1, 2], timeout_s=5)
    assert first.slices == (1, 2, 0) and m.fresh_clients == 0  # nothing used yet: the client is fresh
    for n in range(1, 30):  # far past the 3! = 6 orders a new-order-per-rejoin scheme would allow
        f = m._form("sig", [0, 1, 2], timeout_s=5)
        assert f.slices == (1, 2, 0) and f.number == n
    assert m.fresh_clients == 29 and m.generation == 29
    assert all(d.generation == 29 for d in m.devices)  # the membership uses the new client's devices
    assert m.rendezvous_forgotten == 30  # process 0 is the lowest member of every formation


def _data_parallel_cliques(slices):
    """One device per slice on a data axis: mesh_cliques of that mesh."""
    devices = np.array([d for s in slices for d in s], dtype=object).reshape(-1, 1)
    return mesh_cliques(SimpleNamespace(devices=devices))


def test_mesh_cliques_are_the_cross_process_groups_along_every_axis_subset():
    devs = np.array([Dev(i) for i in range(4)], dtype=object).reshape(2, 2)  # data x fsdp, a process each
    groups = mesh_cliques(SimpleNamespace(devices=devs))
    assert groups == {(0, 1), (2, 3), (0, 2), (1, 3), (0, 1, 2, 3)}
    two_per_process = np.array([Dev(0), Dev(0), Dev(1), Dev(1)], dtype=object).reshape(2, 2)
    for i, d in enumerate(two_per_process.flat):
        d.id = 10 + i
    assert mesh_cliques(SimpleNamespace(devices=two_per_process)) == {(10, 12), (11, 13), (10, 11, 12, 13)}


def test_survivors_on_new_device_groups_keep_their_client_and_a_rejoin_renews_it():
    """3 slices of one process: the survivors of slice 1's loss run on groups they never used (no new
    client, compiled steps kept); when slice 1 rejoins, the full group is used again: a new client."""
    client = FakeClient()
    m = Scripted(3, 0, client, cliques_of=_data_parallel_cliques)
    m.round()
    m._form("a", [0, 1, 2], timeout_s=5)
    assert m.fresh_clients == 0 and m.cliques_used == {(0, 1, 2)}
    m._form("b", [0, 2], timeout_s=5)
    assert m.fresh_clients == 0 and m.cliques_used == {(0, 1, 2), (0, 2)}
    m._form("c", [0, 1, 2], timeout_s=5)
    assert m.fresh_clients == 1 and m.cliques_used == {(0, 1, 2)}, "used before: communicators renewed"
    m._form("d", [0, 1, 2], timeout_s=5)  # a retry on the same processes (a failed collective)
    assert m.fresh_clients == 2
    assert m.rendezvous_forgotten == 4, "the rendezvous keys are deleted at every formation all the same"


def test_only_the_lowest_member_deletes_the_rendezvous_keys():
    client = FakeClient()
    m = Scripted(3, 2, client)
    m.round()
    m._form("sig", [1, 2], timeout_s=5)
    assert m.rendezvous_forgotten == 0
    lowest = Scripted(3, 1, client)
    lowest.round()
    lowest._form("sig2", [1, 2], timeout_s=5)
    assert lowest.rendezvous_forgotten == 1


def test_without_fresh_clients_a_formation_takes_no_barrier():
    client = FakeClient()
    m = Scripted(3, 1, client, fresh=False)
    m.round()
    assert m._form("sig", [0, 1, 2], timeout_s=5).slices == (1, 2, 0)
    assert client.counters == {}


def test_a_member_that_dies_or_restarts_during_a_barrier_is_a_process_failure():
    client = FakeClient()
    m = Scripted(3, 0, client)
    m.round()
    m.live = {0: 100, 1: 101}  # process 2 died
    with pytest.raises(ProcessFailureError) as e:
        m._meet("x", [0, 1, 2], timeout_s=5)
    assert {d.process_index for d in e.value.failed_devices} == {2}
    m.live = {0: 100, 1: 101, 2: 999}  # process 2 restarted (a new incarnation)
    m.round()
    m.current = {0: 100, 1: 101, 2: 102}  # what the barrier's members were
    with pytest.raises(ProcessFailureError):
        m._meet("y", [0, 1, 2], timeout_s=5)


def test_a_barrier_times_out_when_members_never_arrive():
    client = FakeClient()
    m = Scripted(2, 0, client)
    m.round = lambda: {0: 100, 1: 101}  # rounds complete, but process 1 never arrives
    t = iter(range(100))
    m.clock = lambda: next(t)
    with pytest.raises(TimeoutError, match="did not all arrive"):
        m._meet("z", [0, 1], timeout_s=3)


def test_a_fatal_error_stops_every_other_process_with_its_cause():
    client = FakeClient()
    failing = Scripted(3, 2, client)
    failing.clock = iter(range(1000)).__next__
    failing.fail(MemoryError("RESOURCE_EXHAUSTED: out of memory allocating 3 GiB"), wait_s=3)
    record = json.loads(client.kv["trainer/fatal"])
    assert record == {
        "process": 2,
        "cause": "MemoryError: RESOURCE_EXHAUSTED: out of memory allocating 3 GiB",
        "exit_code": 1,  # its exit code, which every process ends with (trainer/errors.py)
    }
    fatal.check(client, 2)  # its own record does not stop it twice
    other = Scripted(3, 0, client)
    with pytest.raises(fatal.PeerFailed, match="process 2 failed: MemoryError: RESOURCE_EXHAUSTED") as raised:
        other.wait_for_slices(1, timeout_s=5, poll_s=0)
    assert raised.value.exit_code == 1
    with pytest.raises(fatal.PeerFailed):
        Scripted(3, 1, client)._meet("b", [0, 1], timeout_s=5)
    assert fatal.acknowledged(client) == {0, 1}
    fatal.publish(client, 1, ValueError("later"))  # the first cause recorded wins
    assert json.loads(client.kv["trainer/fatal"])["process"] == 2


def test_a_peers_transient_failure_ends_every_process_with_the_transient_code():
    from trainer.checkpoint import CheckpointSaveError
    from trainer.errors import EXIT_TRANSIENT

    client = FakeClient()
    fatal.publish(client, 1, CheckpointSaveError(10, "checkpoint save of step 10 failed: storage unavailable"))
    with pytest.raises(fatal.PeerFailed) as raised:
        fatal.check(client, 0)
    assert raised.value.exit_code == EXIT_TRANSIENT


def test_the_failing_process_waits_until_every_live_process_saw_the_cause():
    client = FakeClient()
    failing = Scripted(3, 2, client)
    seen = []

    def round_():
        seen.append(1)
        if len(seen) == 3:  # the others see the cause at their next round
            for p in (0, 1):
                client.kv[f"trainer/fatal_ack/{p}"] = "1"
        return {0: 1, 1: 1, 2: 1}

    failing.round = round_
    failing.fail(ValueError("bad batch"), wait_s=60)
    assert len(seen) == 3


@pytest.mark.parametrize(
    "message, collective",
    [
        ("UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:1457", True),
        ("UNKNOWN: Gloo context initialization failed: ALREADY_EXISTS: key cpu:gloo/0,2048/1", True),
        ("DEADLINE_EXCEEDED: GetKeyValue() timed out with key: cpu:gloo/0,2048,4096/0", True),
        ("INTERNAL: NCCL operation ncclAllReduce failed: remote process exited", True),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.1GiB", False),
        ("INVALID_ARGUMENT: Executable expected shape f32[8,128] for argument 0", False),
    ],
)
def test_only_collective_failures_count_as_failures_between_processes(message, collective):
    assert fatal.is_collective_failure(RuntimeError(message)) is collective


def test_the_supervisor_retries_a_failed_collective_on_fresh_clients_and_ends_on_an_own_error():
    import jax
    from helpers import micro_config

    from trainer.elastic.process_cluster import ProcessCluster
    from trainer.elastic.snapshot import HostSnapshots
    from trainer.elastic.supervisor import Supervisor
    from trainer.observe.events import EventLog

    cfg = micro_config("num_slices=3", "elastic_enabled=true", "elastic_poll_interval_seconds=0.01")
    client = FakeClient()
    membership = Scripted(3, 1, client)
    seen = []
    errors = iter(
        [
            jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer"),
            jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.1GiB"),
        ]
    )

    class FailingAttempts:
        def __call__(self, slices, parts, *, not_after=None):
            seen.append([d.generation for s in slices for d in s])
            raise next(errors)

        def forget_compiled(self):
            pass

        def compile_ahead(self, slice_sets):
            pass

        def close(self):
            pass

    emitted = []
    events = EventLog(None)
    events.emit = lambda name, **fields: emitted.append((name, fields))
    membership.events = events
    cluster = ProcessCluster(
        membership,
        events=events,
        timeout_s=cfg.elastic.elastic_timeout_seconds,
        poll_s=cfg.elastic.elastic_poll_interval_seconds,
        dead_after_s=10.0,
        fatal_wait_s=0.2,  # nobody here acknowledges
    )
    sup = Supervisor(
        cfg.elastic,
        cluster,
        attempts=FailingAttempts(),
        run_loop=lambda attempt, boundary: pytest.fail("no attempt was built"),
        events=events,
        profiler=None,
        snapshots=HostSnapshots(events),
    )
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        sup.run()
    assert seen == [[0, 0, 0], [1, 1, 1]]  # the retry ran on the fresh client's devices
    downs = [f for name, f in emitted if name == "slice_down_detected"]
    assert [d["cause"] for d in downs] == ["collective_failed"]
    assert json.loads(client.kv["trainer/fatal"])["cause"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED")
    assert [name for name, _ in emitted].count("fatal_error") == 1


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0  # every poll advances a second
        return self.t


def test_a_checkpoint_barrier_returns_once_every_member_arrived():
    from trainer.distributed.heartbeat import Barrier

    client = FakeClient()
    for p in range(3):
        client.kv[f"trainer/heartbeat/{p}"] = f"tok{p}:0"
    barrier = Barrier(client, [0, 1, 2], dead_after_s=5, clock=Clock())
    client.counters["trainer/ckpt_barrier//save_start#1"] = 2  # the two others are there
    barrier(key="save_start", timeout_ms=60_000)
    assert client.counters["trainer/ckpt_barrier//save_start#1"] == 3


def test_a_checkpoint_barrier_gives_up_on_a_member_whose_heartbeat_stopped_or_restarted():
    from trainer.distributed.heartbeat import Barrier

    client = FakeClient()
    for p in range(3):
        client.kv[f"trainer/heartbeat/{p}"] = f"tok{p}:0"
    barrier = Barrier(client, [0, 1, 2], dead_after_s=5, devices_of=lambda p: [Dev(p)], clock=Clock())
    with pytest.raises(ProcessFailureError) as e:  # nobody beats: after 5 polled seconds they are dead
        barrier(key="k1", timeout_ms=60_000)
    assert {d.process_index for d in e.value.failed_devices} == {0, 1, 2}
    client.kv["trainer/heartbeat/2"] = "other:0"  # process 2 restarted: seen at the first poll
    with pytest.raises(ProcessFailureError) as e:
        barrier(key="k2", timeout_ms=60_000)
    assert {d.process_index for d in e.value.failed_devices} == {2}


def test_the_heartbeat_beats_until_stopped():
    import time

    from trainer.distributed.heartbeat import Heartbeat

    client = FakeClient()
    client.key_value_set = lambda k, v, allow_overwrite=False: client.kv.__setitem__(k, v)
    beat = Heartbeat(client, 1, period_s=0.01)
    first = client.kv["trainer/heartbeat/1"]
    deadline = time.monotonic() + 30
    while client.kv["trainer/heartbeat/1"] == first and time.monotonic() < deadline:
        time.sleep(0.01)
    beat.stop()
    token, count = client.kv["trainer/heartbeat/1"].split(":")
    assert token == first.split(":")[0] and int(count) >= 1


def test_orbax_work_of_the_main_thread_is_abandoned_when_a_peer_is_lost_meanwhile():
    import threading

    from trainer.distributed.heartbeat import Barrier

    client = FakeClient()
    for p in range(2):
        client.kv[f"trainer/heartbeat/{p}"] = f"tok{p}:0"
    barrier = Barrier(client, [0, 1], dead_after_s=5, devices_of=lambda p: [Dev(p)], clock=Clock())
    stuck = threading.Event()
    worker = threading.Thread(target=lambda: stuck.wait(60), daemon=True)
    worker.start()
    with pytest.raises(ProcessFailureError):  # no heartbeat moves: both are declared lost
        barrier.wait(worker, "save")
    stuck.set()
    done = threading.Thread(target=lambda: None)
    done.start()
    barrier.wait(done, "save")  # a finished thread returns at once


def test_every_orbax_barrier_goes_through_the_attempts_heartbeat_barrier_until_restored():
    from orbax.checkpoint._src.multihost import multihost

    from trainer.distributed.heartbeat import Barrier, watch_orbax_barriers

    client = FakeClient()
    barrier = Barrier(client, [0, 1, 2], dead_after_s=5, scope="f1")
    original = multihost.get_barrier_sync_fn
    assert original.__module__ == multihost.__name__  # a supervisor run leaves Orbax's own in place
    try:
        watch_orbax_barriers(barrier)
        fn = multihost.get_barrier_sync_fn(processes={0, 2})
        assert isinstance(fn, Barrier) and fn.members == [0, 2] and fn.scope == "f1"
        client.counters["trainer/ckpt_barrier/f1/k#1"] = 1  # the other member arrived
        fn(key="k", timeout_ms=1000)
        client.counters["trainer/ckpt_barrier/f1/k#2"] = 1
        fn(key="k", timeout_ms=1000)  # a key used again is a new barrier
    finally:
        watch_orbax_barriers(None)
    assert multihost.get_barrier_sync_fn is original


def test_a_process_error_schedule_is_checked_before_any_compute_and_only_runs_with_several_processes():
    from helpers import micro_config

    from trainer.config import ConfigError
    from trainer.failures.plan import parse_plan

    def for_processes(text: str, count: int):
        return parse_plan(text, num_slices=1).check_processes(count).faults

    assert for_processes("step=6,process=2,error=oom", 3)[0].error == "oom"
    micro_config("fault_schedule=step=6,process=2,error=oom")  # valid config: the process count comes later
    with pytest.raises(ConfigError, match="error must be one of"):
        micro_config("fault_schedule=step=6,process=2,error=segfault")
    with pytest.raises(ConfigError, match=r"process must be in \[0, 3\)"):
        for_processes("step=6,process=3,error=oom", 3)
    with pytest.raises(ConfigError, match="lose a process by killing it"):
        for_processes("step=6,slice=0", 3)
    with pytest.raises(ConfigError, match="this run has one process"):
        for_processes("step=6,process=0,error=bug", 1)
    with pytest.raises(ConfigError, match="a run is one or the other"):
        for_processes("step=6,process=0,error=bug; step=3,slice=0", 2)
    [slow] = for_processes("step=8,process=1,slow_snapshot_s=2.5", 3)
    assert (slow.step, slow.process, slow.seconds) == (8, 1, 2.5)
    with pytest.raises(ConfigError, match="slow_snapshot_s=S"):
        for_processes("step=8,process=1,slow_snapshot_s=-1", 3)


def test_a_slow_snapshot_stretches_that_steps_host_copy_and_says_when_it_began():
    import time

    import jax.numpy as jnp

    from trainer.elastic.snapshot import HostSnapshots

    logged = []

    class Events:
        def emit(self, name, **fields):
            logged.append((str(name), fields))

    snaps = HostSnapshots(Events(), copy_delay=lambda step: 0.5 if step == 4 else 0.0)
    t0 = time.monotonic()
    snaps.take(4, {"w": jnp.ones(3)}, {})
    assert [n for n, _ in logged] == ["snapshot_started"], "the copy of step 4 is still in flight"
    snaps.wait_for_copy()
    assert time.monotonic() - t0 >= 0.5 and [n for n, _ in logged] == ["snapshot_started", "snapshot_taken"]


class Deadlock(Exception):
    pass


class SharedRounds:
    """live_devices' barrier between threads: every live process's n-th call returns the same
    {process: incarnation} once all of them made it (what the coordination service's GetAliveTasks does)."""

    def __init__(self, live: dict[int, int], timeout_s: float):
        self.live, self.timeout_s = live, timeout_s
        self.cond = threading.Condition()
        self.waiting: set[int] = set()
        self.generation = 0
        self.results: dict[int, dict[int, int]] = {}

    def call(self, process: int) -> dict[int, int]:
        with self.cond:
            generation = self.generation
            self.waiting.add(process)
            if self.waiting >= set(self.live):
                self.results[generation] = dict(self.live)
                self.generation += 1
                self.waiting = set()
                self.cond.notify_all()
            elif not self.cond.wait_for(lambda: self.generation > generation, timeout=self.timeout_s):
                raise Deadlock(f"process {process} waited in a round; only {sorted(self.waiting)} came")
            return self.results[generation]


class LockedClient(FakeClient):
    """One store shared by threads; reads by the processes in `slow_reads` take a while (an RPC that is
    slow to return), so the others' writes right after a round land before them."""

    def __init__(self, slow_reads=()):
        super().__init__()
        self.lock = threading.Lock()
        self.slow_reads = slow_reads

    def key_value_increment(self, key, n):
        if n == 0 and threading.current_thread().name in self.slow_reads:
            time.sleep(0.05)
        with self.lock:
            return super().key_value_increment(key, n)


class Simulated(Membership):
    """One process of a 2 slices x 2 processes job whose rounds go through SharedRounds."""

    def __init__(self, me: int, rounds: SharedRounds, client, *, survivor: bool):
        super().__init__(
            [Dev(i) for i in range(4)],
            2,
            process_index=me,
            client=client,
            events=None,
            fresh_devices=lambda: [Dev(i, 1) for i in range(4)],
            forget_rendezvous=lambda: None,
            cliques_of=lambda slices: {"the whole mesh"},
        )
        self.rounds, self.started = rounds, survivor
        if survivor:  # it trained with process 2's first incarnation, on the whole mesh
            self.previous = self.current = {0: 100, 1: 101, 2: 102, 3: 103}
            self.cliques_used = {"the whole mesh"}

    def round(self):
        entry = None if self.started else set(self.rounds.call(self.me))  # a first round: two calls
        self.started = True
        return self._record(self.rounds.call(self.me), entry)


def _kv_only_barrier(client, key: str, members: int, timeout_s: float) -> None:
    """What Orbax's barriers are (trainer.distributed.heartbeat.Barrier): counters, no rounds."""
    client.key_value_increment(key, 1)
    deadline = time.monotonic() + timeout_s
    while client.key_value_increment(key, 0) < members:
        if time.monotonic() > deadline:
            raise Deadlock(f"{key}: the others never came")
        time.sleep(0.001)


def _one_process(m: Simulated, heartbeat_detected, client, formed: dict, errors: list) -> None:
    """A survivor from its failing step (or a replacement from its start) to its attempt's first step."""
    rounds = m.rounds
    try:
        if m.me != 2:
            if m.me not in heartbeat_detected:
                m._record(rounds.call(m.me))  # the failing step's round raised ProcessFailureError
            m.round()  # the supervisor's round after it (ProcessCluster.slice_down_cause)
        formation = m.wait_for_slices(2, timeout_s=5.0, poll_s=0)
        _kv_only_barrier(client, f"restore/{formation.key}", 4, timeout_s=5.0)
        m._record(rounds.call(m.me))  # the first step's round
        formed[m.me] = formation
    except Exception as e:
        errors.append(f"process {m.me}: {type(e).__name__}: {e}")
        with rounds.cond:  # the others' rounds end too
            rounds.live.pop(m.me, None)
            rounds.cond.notify_all()


@pytest.mark.parametrize("heartbeat_detected", [(), (0,)], ids=["all-in-the-step", "process-0-in-a-save"])
def test_every_process_forms_on_the_same_round_whatever_path_brought_it_there(heartbeat_detected):
    """Process 2 of slice 1 died and its replacement's first round (two calls) met the survivors' failing
    step's round, the second their supervisor's round. A survivor that was inside a checkpoint save saw the
    loss through the heartbeat barrier instead, without the failing step's round. Every process must
    decide on the same round: one a round ahead went through the formation's barriers and on to a barrier
    without rounds (Orbax restoring) while another waited in a round for it (seen once in ~25 kills of the
    2x2 soak test, before formations were decided on the round each process already had)."""
    for trial in range(3):
        client = LockedClient(slow_reads={"process 2"} | {f"process {p}" for p in heartbeat_detected})
        rounds = SharedRounds({0: 100, 1: 101, 2: 202, 3: 103}, timeout_s=5.0)
        members = {p: Simulated(p, rounds, client, survivor=p != 2) for p in range(4)}
        formed, errors = {}, []

        threads = [
            threading.Thread(
                target=_one_process, args=(m, heartbeat_detected, client, formed, errors), name=f"process {m.me}"
            )
            for m in members.values()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, f"trial {trial}: {errors}"
        assert len({f.key for f in formed.values()}) == 1 and len(formed) == 4
        assert all(m.fresh_clients == (0 if m.me == 2 else 1) for m in members.values())
