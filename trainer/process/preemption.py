"""SIGTERM in every phase: the process stops within `stop_timeout_seconds` and exits 42 (preempted).

Kubernetes (a drain, a Spot preemption, a maintenance event) and Slurm (a time limit, a preemption) send
SIGTERM, then SIGKILL after a grace period. What the trainer does with it depends on where the main
thread is when it arrives:
- between steps (the train loop): the loop finishes the step, writes the local tier (the fastest) and a
  persistent checkpoint, and returns `preempted`;
- in an evaluation: the evaluation stops at its next batch, then as between steps;
- anywhere else (compiling, restoring, waiting for slices, membership rounds, a recovery): the handler
  raises `Preempted` in the main thread at once; the supervisor writes the newest host snapshot to the
  local tier when it is newer than every saved step, and the process exits 42.
Python runs signal handlers between bytecodes, so a long native call (an XLA compile, a device wait)
defers the second and third cases. A watchdog bounds them: at half the timeout it runs the emergency
savers (the same local-tier write, from its own thread), and at the timeout it exits the process with
42 (`os._exit`, after flushing the logs). The deploy manifests set the grace period above the timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from trainer.errors import EXIT_PREEMPTED
from trainer.logevents import event_extra

log = logging.getLogger(__name__)

# The phases in which SIGTERM does not interrupt the main thread: the loop stops at the step boundary
# (a save's blocking part and an evaluation are phases of their own for the progress watchdog).
STEPPING = "steps"
SAVING = "checkpoint_save"
EVALUATING = "evaluation"
IN_LOOP = frozenset({STEPPING, SAVING, EVALUATING})
STARTUP = "startup"


class Preempted(BaseException):
    """SIGTERM arrived in a phase that is abandoned at once (not the step loop). A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way up treats it as a failure to recover from."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, phase: str):
        super().__init__(f"SIGTERM during {phase}")
        self.phase = phase


class Phases:
    """The main thread's phase (compile, restore, steps, ...): what the SIGTERM handler, the progress
    watchdog and the stop logs read. One per process, owned by its root (`trainer.process_root`) and
    handed to whatever marks a phase (the supervisor, the attempt builder, the loop)."""

    def __init__(self):
        self._stack = [STARTUP]

    def current(self) -> str:
        return self._stack[-1]

    @contextlib.contextmanager
    def enter(self, name: str):
        """The main thread is in phase `name` until the block ends (phases nest)."""
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()


class StopSignal:
    """The process's stop request: installed as the SIGTERM handler; the loop's `stop_requested`. `phases`:
    the process's phases (where a SIGTERM lands decides what it does)."""

    def __init__(
        self,
        timeout_s: float,
        *,
        phases: Phases | None = None,
        exit_process: Callable[[int], None] = os._exit,
        main_thread: Callable[[], bool] = lambda: threading.current_thread() is threading.main_thread(),
    ):
        self.timeout_s = timeout_s
        self.phases = phases or Phases()
        self._event = threading.Event()
        self._finished = threading.Event()
        self._exit = exit_process
        self._main_thread = main_thread
        self._savers: list[Callable[[], None]] = []
        self._saving = threading.Lock()
        self._saved = False
        self.received_at: float | None = None
        self.received_in: str | None = None
        self._checks: list[Callable[[], None]] = []

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def add_saver(self, fn: Callable[[], None]) -> None:
        """An emergency save, run once: by the main thread on `Preempted`, or by the watchdog."""
        self._savers.append(fn)

    def add_check(self, fn: Callable[[], None]) -> None:
        """Run at every step boundary (`__call__`); may raise to end the run (a lost lease)."""
        self._checks.append(fn)

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def __call__(self, step: int | None = None) -> bool:
        for check in self._checks:
            check()
        return self._event.is_set()

    def request(self, where: str | None = None) -> None:
        """What the handler does, callable directly (tests, and the watchdog's clock starts here)."""
        if self._event.is_set():
            return
        self.received_at = time.monotonic()
        self.received_in = where or self.phases.current()
        self._event.set()
        log.warning(
            "SIGTERM in phase %s: stopping within stop_timeout_seconds=%g, then exit %d",
            self.received_in,
            self.timeout_s,
            EXIT_PREEMPTED,
            extra=event_extra(
                "sigterm", {"phase": self.received_in, "timeout_s": self.timeout_s, "exit_code": EXIT_PREEMPTED}
            ),
        )
        threading.Thread(target=self._watchdog, name="stop-watchdog", daemon=True).start()

    def _handle(self, signum, frame) -> None:
        first = not self._event.is_set()
        self.request()
        if first and self.phases.current() not in IN_LOOP and self._main_thread():
            raise Preempted(self.received_in)

    def save_now(self) -> None:
        """Run the emergency savers once (whichever thread gets here first; the other skips)."""
        if not self._saving.acquire(blocking=False):
            return
        try:
            if self._saved:
                return
            self._saved = True
            for fn in self._savers:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - a failed emergency save must not block the exit
                    log.warning("emergency save failed: %s", e)
        finally:
            self._saving.release()

    def finished(self) -> None:
        """The process is about to exit on its own: the watchdog stands down."""
        self._finished.set()

    def _watchdog(self) -> None:
        if self._finished.wait(self.timeout_s / 2):
            return
        phase = self.phases.current()
        log.warning(
            "the stop is overdue in phase %s: saving what the process holds",
            phase,
            extra=event_extra("stop_overdue", {"phase": phase}),
        )
        saver = threading.Thread(target=self.save_now, name="stop-emergency-save", daemon=True)
        saver.start()
        if self._finished.wait(self.timeout_s / 2):
            return
        phase = self.phases.current()
        log.error(
            "stop_timeout_seconds=%g reached in phase %s: exiting %d now",
            self.timeout_s,
            phase,
            EXIT_PREEMPTED,
            extra=event_extra(
                "stop_deadline", {"phase": phase, "timeout_s": self.timeout_s, "exit_code": EXIT_PREEMPTED}
            ),
        )
        print(f"STATUS: preempted (stop_timeout_seconds={self.timeout_s:g} reached)", flush=True)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        sys.stderr.flush()
        self._exit(EXIT_PREEMPTED)
