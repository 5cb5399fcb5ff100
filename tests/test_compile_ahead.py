"""The background compiler: one worker, the sets within the preferred devices first, never stuck."""

import threading

import pytest

from trainer.attempt.compile_ahead import BackgroundCompiler

HANG_S = 60  # only to catch a hang


def _gate(compiler: BackgroundCompiler):
    """Occupy the worker until the returned event is set, so the next submissions queue behind it."""
    release, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(HANG_S)

    compiler.submit("busy", [0], hold)
    assert started.wait(HANG_S)
    return release


def test_queued_sets_run_in_order_until_a_preference_moves_the_survivors_sets_first():
    compiler, ran = BackgroundCompiler(), []
    release = _gate(compiler)
    futures = [
        compiler.submit(key, devices, lambda key=key: ran.append(key))
        for key, devices in [("01", [0, 1]), ("02", [0, 2]), ("12", [1, 2])]
    ]
    assert compiler.queued() == ["01", "02", "12"]
    compiler.prefer([1, 2])  # slice 0 was lost: only {1, 2} can serve the next resize
    assert compiler.queued() == ["12", "01", "02"]
    release.set()
    for f in futures:
        f.result(HANG_S)
    assert ran == ["12", "01", "02"]
    compiler.close()


def test_pending_names_a_queued_or_running_set_until_it_ran():
    compiler = BackgroundCompiler()
    release = _gate(compiler)
    assert compiler.pending("busy") is not None
    queued = compiler.submit("01", [0, 1], lambda: None)
    assert compiler.pending("01") is queued and compiler.pending("other") is None
    release.set()
    queued.result(HANG_S)
    assert compiler.pending("01") is None and compiler.pending("busy") is None
    compiler.close()


def test_a_failing_compile_fails_its_own_future_and_the_worker_goes_on():
    compiler = BackgroundCompiler()

    def broken():
        raise RuntimeError("no such layout")

    bad = compiler.submit("bad", [0], broken)
    good = compiler.submit("good", [1], lambda: None)
    with pytest.raises(RuntimeError, match="no such layout"):
        bad.result(HANG_S)
    assert good.result(HANG_S) is None
    compiler.close()


def test_close_cancels_what_is_queued_and_refuses_new_work():
    compiler, ran = BackgroundCompiler(), []
    release = _gate(compiler)
    queued = compiler.submit("01", [0, 1], lambda: ran.append("01"))
    compiler.close()
    release.set()
    assert queued.cancelled() and compiler.submit("02", [0, 2], lambda: ran.append("02")).cancelled()
    assert ran == []
