"""A SIGTERM to any subset of processes, at any moment, stops all of them after the same step.

Simulated without processes: a shared key-value store like the coordination service's, and hosts that
advance with the skew the train loop allows (a host reaches the boundary of step t only after every host
passed the boundary of step t - 2: step t - 1's collective needs all of them, and the loop waits for
step t - 1 before the boundary of step t).
"""

from __future__ import annotations

import random

import pytest

from trainer.distributed.stop import KEY, CoordinatedStop


class _KeyValueStore:
    def __init__(self):
        self.data = {}

    def key_value_set(self, key, value):
        if key in self.data:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.data[key] = value

    def key_value_try_get(self, key):
        if key not in self.data:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.data[key]


def _simulate(seed: int, processes: int = 4) -> tuple[dict[int, int], int]:
    rng = random.Random(seed)
    store = _KeyValueStore()
    flags = [False] * processes
    stops = [CoordinatedStop(lambda p=p: flags[p], store) for p in range(processes)]
    done = [0] * processes  # last boundary each host passed
    stopped: dict[int, int] = {}
    signalled = rng.sample(range(processes), rng.randint(1, processes))  # SIGTERM to a random subset
    signal_at = {p: rng.randint(3, 12) for p in signalled}  # ... at skewed moments
    first_signal = None
    while len(stopped) < processes:
        ready = [
            p
            for p in range(processes)
            if p not in stopped and all(done[q] >= done[p] + 1 - 2 for q in range(processes) if q != p)
        ]
        assert ready, f"deadlock: done={done} stopped={stopped}"
        p = rng.choice(ready)
        step = done[p] + 1
        if signal_at.get(p) is not None and step >= signal_at[p]:
            flags[p] = True
            first_signal = step if first_signal is None else min(first_signal, step)
        done[p] = step
        if stops[p](step):
            stopped[p] = step
        assert step < 100, "never stopped"
    return stopped, first_signal


@pytest.mark.parametrize("seed", range(200))
def test_every_process_stops_after_the_same_step(seed):
    stopped, first_signal = _simulate(seed)
    assert len(set(stopped.values())) == 1, stopped
    assert min(stopped.values()) >= first_signal


def test_the_first_proposal_wins_and_later_ones_read_it():
    store = _KeyValueStore()
    a, b = CoordinatedStop(lambda: True, store), CoordinatedStop(lambda: True, store)
    assert not a(5) and store.data[KEY] == "7"
    assert not b(6) and store.data[KEY] == "7"  # b's own proposal (8) lost: it stops where a does
    assert a(7) and b(7)


def test_without_a_request_nothing_stops_and_nothing_is_written():
    store = _KeyValueStore()
    stop = CoordinatedStop(lambda: False, store)
    assert not any(stop(s) for s in range(1, 50)) and store.data == {}


def test_a_process_stopped_outside_the_step_loop_stops_the_others_and_waiting_ones_see_it():
    store = _KeyValueStore()
    stopped_in_a_compile, training, waiting = (CoordinatedStop(lambda: False, store) for _ in range(3))
    assert not waiting.agreed() and not training(4)

    stopped_in_a_compile.propose_after(4)  # SIGTERM while it compiled: it leaves, and says so

    assert waiting.agreed(), "a process waiting for slices stops too (Membership.wait_for_slices asks)"
    assert not training(5) and training(6), "a training process stops at the agreed step"


def test_a_membership_wait_raises_preempted_once_the_job_agreed_to_stop():
    from trainer.elastic.membership import Membership
    from trainer.process.preemption import Preempted

    membership = Membership.__new__(Membership)  # only the stop check runs: it comes before any round
    membership.current, membership.me = None, 0
    membership.slice_of = lambda process: 0
    membership.clock = lambda: 0.0
    with pytest.raises(Preempted, match="waiting_for_slices"):
        membership.wait_for_slices(1, timeout_s=10, poll_s=0.1, should_stop=lambda: True)
