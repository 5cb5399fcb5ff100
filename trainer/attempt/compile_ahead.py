"""Compile slice sets' steps in the background, the sets the run can resize onto next first.

One worker thread compiles the queued slice sets one at a time. After a slice is lost, a queued set that
contains it cannot serve the next resize until the slice returns, so it waits behind the sets of the
surviving slices (`prefer`). The worker is a `ThreadPoolExecutor`'s: at interpreter exit the compile in
progress finishes and no queued one starts (a thread killed inside the compiler aborts the process).
The compiler's own threads do the work, so the worker's CPU priority would not move it; on a host whose
cores also run the steps (CPU devices) a compile in progress slows them.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable, Iterable


class BackgroundCompiler:
    """A priority queue of compiles served by one worker thread.

    `submit(key, devices, fn)` queues `fn()` (a compile that stores its own result) for the slice set
    `key` spanning the device ids `devices`; the returned future is done when it ran. Among the queued
    ones, the next is the first whose devices all lie within the preferred set (`prefer`), else the
    first queued.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._queue: list[tuple[Hashable, frozenset, Callable[[], None], concurrent.futures.Future]] = []
        self._running: dict[Hashable, concurrent.futures.Future] = {}
        self._preferred: frozenset | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    def submit(self, key: Hashable, devices: Iterable[int], fn: Callable[[], None]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.cancel()
                return future
            self._queue.append((key, frozenset(devices), fn, future))
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-ahead")
            self._pool.submit(self._run_next)  # one turn per queued set: it runs the best queued then
        return future

    def pending(self, key: Hashable) -> concurrent.futures.Future | None:
        """The future of `key` if it is queued or compiling, else None."""
        with self._lock:
            if key in self._running:
                return self._running[key]
            return next((f for k, _, _, f in self._queue if k == key), None)

    def prefer(self, devices: Iterable[int]) -> None:
        """Compile the queued sets within `devices` (the slices the run now trains on) first."""
        with self._lock:
            self._preferred = frozenset(devices)

    def queued(self) -> list[Hashable]:
        """The queued keys in the order they would run (for tests and logs)."""
        with self._lock:
            return [k for k, *_ in self._ordered()]

    def close(self) -> None:
        """No queued compile starts; one in progress finishes on its worker."""
        with self._lock:
            self._closed = True
            for *_, future in self._queue:
                future.cancel()
            self._queue.clear()
            pool = self._pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _ordered(self) -> list:
        if self._preferred is None:
            return list(self._queue)
        within = [q for q in self._queue if q[1] <= self._preferred]
        return within + [q for q in self._queue if not q[1] <= self._preferred]

    def _run_next(self) -> None:
        with self._lock:
            if not self._queue:  # closed: the queue was cancelled
                return
            item = self._ordered()[0]
            self._queue.remove(item)
            key, _, fn, future = item
            self._running[key] = future
        try:
            fn()
        except BaseException as e:  # the compile reports its own failures; the worker goes on
            future.set_exception(e)
        else:
            future.set_result(None)
        finally:
            with self._lock:
                self._running.pop(key, None)
