"""SIGTERM in every phase (trainer/process/preemption.py): between steps the loop saves and stops; elsewhere the
handler raises at once; a native call that never returns is bounded by the watchdog, which saves what
it can and exits 42."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from trainer.errors import EXIT_PREEMPTED, exit_code_for
from trainer.process.preemption import STEPPING, Phases, Preempted, StopSignal


@pytest.fixture
def phases() -> Phases:
    return Phases()


@pytest.fixture
def installed(phases):
    before = signal.getsignal(signal.SIGTERM)
    stops = []

    def make(timeout_s: float, **kwargs) -> StopSignal:
        stop = StopSignal(timeout_s, phases=phases, **kwargs)
        stop.install()
        stops.append(stop)
        return stop

    yield make
    for stop in stops:
        stop.finished()
    signal.signal(signal.SIGTERM, before)


def test_between_steps_the_flag_is_set_and_nothing_is_raised(installed, phases):
    stop = installed(30)
    with phases.enter(STEPPING):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs at the next bytecode boundary: nothing raised here
    assert stop.requested and stop(12) and stop.received_in == STEPPING


@pytest.mark.parametrize("where", ["compile", "restore", "waiting_for_slices"])
def test_anywhere_else_it_raises_preempted_at_once_naming_the_phase(installed, phases, where):
    installed(30)
    with pytest.raises(Preempted) as raised, phases.enter(where):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # a wait: interrupted by the handler
    assert raised.value.phase == where and exit_code_for(raised.value) == EXIT_PREEMPTED
    assert phases.current() == "startup"


def test_a_call_that_never_returns_is_bounded_the_watchdog_saves_then_exits_42():
    exited, saved = threading.Event(), []
    stop = StopSignal(0.6, exit_process=lambda code: (saved.append(("exit", code)), exited.set()))
    stop.add_saver(lambda: saved.append("local tier written"))
    t0 = time.monotonic()

    stop.request("compile")  # the main thread is inside a native call: no handler runs

    assert exited.wait(10), "the watchdog must end the process"
    assert saved == ["local tier written", ("exit", EXIT_PREEMPTED)]
    assert 0.5 < time.monotonic() - t0 < 5


def test_a_process_that_exits_on_its_own_is_not_killed_and_savers_run_once():
    calls = []
    stop = StopSignal(0.4, exit_process=lambda code: calls.append(code))
    stop.add_saver(lambda: calls.append("saved"))
    stop.request()
    stop.save_now()  # the main thread's own emergency save
    stop.finished()
    time.sleep(0.6)
    assert calls == ["saved"], "saved once, and no exit: the process ended by itself"


def test_a_check_at_the_step_boundary_may_end_the_run():
    stop = StopSignal(30)

    def lost():
        raise RuntimeError("lease lost")

    stop.add_check(lost)
    with pytest.raises(RuntimeError, match="lease lost"):
        stop(3)
