"""Barriers that notice a dead peer, for the checkpointer's threads.

Orbax synchronises a multi-process save with coordination-service barriers (`wait_at_barrier`), from the
main thread (inside `save()`) and from its background threads. When a process dies during a save, a
recoverable job's coordination service keeps such a barrier waiting for the dead process until Orbax's
async timeout (minutes), and the survivors hang there instead of reaching the step whose collective
would fail. Membership rounds cannot be used from those threads (rounds pair up across processes, and the
main thread takes them too).

So each process publishes a heartbeat in the key-value store (a token fixed for the process's life and a
counter, every `period_s`), and `Barrier` is a counter in the store that waiters poll while they watch the
members' heartbeats: a member whose heartbeat stops for `dead_after_s`, or changes token (it restarted),
ends the wait with `ProcessFailureError`, the error a lost peer raises everywhere else.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from jax.experimental.multihost_utils import ProcessFailureError

log = logging.getLogger(__name__)

_HEARTBEAT_KEY = "trainer/heartbeat/"  # + process id: "<token>:<counter>"
_BARRIER_KEY = "trainer/ckpt_barrier/"  # + Orbax's barrier key: arrivals
_POLL_S = 0.05


class Heartbeat:
    """Publishes this process's heartbeat from a daemon thread until `stop()`."""

    def __init__(self, client, process_index: int, *, period_s: float = 0.5):
        self.client = client
        self.key = f"{_HEARTBEAT_KEY}{process_index}"
        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.period_s = period_s
        self._stop = threading.Event()
        self._beat(0)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, n: int) -> None:
        self.client.key_value_set(self.key, f"{self.token}:{n}", allow_overwrite=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.period_s):
            n += 1
            try:
                self._beat(n)
            except Exception as e:  # the service is going away (job ending): nothing left to tell
                log.debug("heartbeat stopped: %s", e)
                return

    def stop(self) -> None:
        self._stop.set()


class Barrier:
    """A barrier over `members` for Orbax (`AsyncOptions.barrier_sync_fn`): `barrier(key=..., timeout_ms=...)`.

    `devices_of(process)` names the devices a dead member held (for ProcessFailureError)."""

    def __init__(
        self,
        client,
        members: Sequence[int],
        *,
        dead_after_s: float,
        scope: str = "",
        devices_of: Callable[[int], list] = lambda p: [],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.client = client
        # Counter keys are unique per scope (the formation) and per use of an Orbax key within it, so a key
        # Orbax uses again, or that an earlier formation used, never meets old arrivals.
        self.scope = scope
        self._uses: dict[str, int] = {}
        self._lock = threading.Lock()
        self.members = sorted(members)
        self.dead_after_s = dead_after_s
        self.devices_of = devices_of
        self.clock = clock
        # The members' incarnations when the attempt started: a different token later means a restart.
        self.tokens = {p: tok for p in self.members if (tok := self._token(p))}

    def _heartbeat(self, process: int) -> str:
        try:
            return self.client.key_value_try_get(f"{_HEARTBEAT_KEY}{process}")
        except Exception:  # no heartbeat published: never started, or its job ended
            return ""

    def _token(self, process: int) -> str:
        return self._heartbeat(process).split(":", 1)[0]

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        with self._lock:
            use = self._uses[key] = self._uses.get(key, 0) + 1
        counter = f"{_BARRIER_KEY}{self.scope}/{key}#{use}"
        self.client.key_value_increment(counter, 1)
        start = self.clock()
        seen: dict[int, tuple[str, float]] = {}  # member -> (heartbeat value, when it last changed)
        while self.client.key_value_increment(counter, 0) < len(self.members):
            now = self.clock()
            self._check(now, seen)
            if now - start > timeout_ms / 1000:
                raise TimeoutError(f"barrier {key}: processes {self.members} not all there in {timeout_ms} ms")
            time.sleep(_POLL_S)

    def over(self, processes) -> Barrier:
        """The same barrier (same incarnations to watch) over `processes` (None: every member)."""
        other = copy.copy(self)  # shares the incarnations, the use counts and their lock
        if processes is not None:
            other.members = sorted(processes)
        return other

    def wait(self, thread, what: str) -> None:
        """Join `thread` (Orbax work of the main thread that takes its own barriers), watching the members'
        heartbeats meanwhile: ProcessFailureError when one is lost (the thread is left behind, blocked until
        Orbax's timeout; its checkpoint manager is abandoned with the attempt)."""
        seen: dict[int, tuple[str, float]] = {}
        while thread.is_alive():
            self._check(self.clock(), seen)
            thread.join(_POLL_S)
        log.debug("%s done", what)

    def _check(self, now: float, seen: dict) -> None:
        lost = [p for p in self.members if self._lost(p, now, seen)]
        if lost:
            raise ProcessFailureError({d for p in lost for d in self.devices_of(p)})

    def _lost(self, process: int, now: float, seen: dict) -> bool:
        value = self._heartbeat(process)
        if self.tokens.setdefault(process, value.split(":", 1)[0]) != value.split(":", 1)[0]:
            return True  # it restarted: the barrier's member is gone
        if seen.get(process, (None,))[0] != value:
            seen[process] = (value, now)
            return False
        return now - seen[process][1] > self.dead_after_s


def watch_orbax_barriers(barrier: Barrier | None) -> None:
    """Route every Orbax barrier between processes (its `sync_global_processes` calls and synchronised
    values, in any thread) through `barrier`, for the attempt it was made for; None restores Orbax's own.

    Orbax looks its barrier function up at each call (`multihost.get_barrier_sync_fn`), so replacing that
    module attribute covers the barriers no option reaches (the checkpoint manager's constructor, the
    finalize thread)."""
    from trainer.io.orbax_internals import route_orbax_barriers

    if barrier is None:
        route_orbax_barriers(None)
        return

    def get_barrier_sync_fn(*, processes=None):
        return barrier.over(processes)

    route_orbax_barriers(get_barrier_sync_fn)
