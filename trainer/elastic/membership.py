"""Which processes are alive, as every live process agrees, and the mesh device order of each formation.

Agreement comes from `jax.experimental.multihost_utils.live_devices`, a barrier over every live
process (the coordination service's GetAliveTasks): one *round* returns the same {process:
incarnation} map to every process that took part. Rounds happen at the end of every train step (the
step runs inside `live_devices`, so a peer that died during it makes every survivor raise
`ProcessFailureError` at the same step) and in `wait_for_slices`. A replacement process's first rounds
meet the survivors' step-end round, so all of them see it at the same step and scale up together.

A *formation* (the set of processes an attempt runs on) is settled only by a *stable* round: one whose
result equals the previous round's. Whatever each process was doing when membership changed (a step,
waiting, starting up), they all settle on the same round.

Fresh device orders: the CPU (gloo) collectives cache a communicator per ordered device list, and keep
its rendezvous keys in the coordination service; both go stale when a process restarts. So every new
formation (a new set of incarnations) gets a mesh order never used before on that device set.
Process 0 (always alive: it hosts the service) picks it and publishes it in the service's key-value
store; the others read it. With k processes per device set there are k! orders, so at most k! - 1
rejoins per set of processes (5 for 3 processes); after that the job must be restarted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence

import jax
from jax.experimental.multihost_utils import ProcessFailureError, live_devices

from trainer.elastic.errors import ElasticGiveUp

log = logging.getLogger(__name__)

_ORDER_KEY = "trainer/mesh_order/"  # + signature: one order per set of incarnations
_ORDER_WAIT_MS = 120_000


def signature(incarnations: dict[int, int]) -> str:
    """A short id of a set of process incarnations (the same on every process)."""
    text = ",".join(f"{p}:{i}" for p, i in sorted(incarnations.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Formation:
    """The slices an attempt runs on, in mesh order, and what identifies it across processes."""

    slices: tuple[int, ...]  # active slices, in mesh order
    sig: str  # signature of the active processes' incarnations
    number: int  # how many formations with this signature came before (same everywhere)

    @property
    def key(self) -> str:
        return f"{self.sig}_{self.number}"


class Membership:
    """Live processes grouped into slices (`processes_per_slice` consecutive process ids form one)."""

    def __init__(
        self,
        devices: Sequence[jax.Device],
        processes_per_slice: int,
        *,
        process_index: int,
        client,
        events,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.devices = sorted(devices, key=lambda d: d.id)
        self.by_process: dict[int, list] = {}
        for d in self.devices:
            self.by_process.setdefault(d.process_index, []).append(d)
        self.per_slice = processes_per_slice
        self.me = process_index
        self.client = client
        self.events = events
        self.clock = clock
        self.current: dict[int, int] | None = None  # the newest round: process -> incarnation
        self.previous: dict[int, int] | None = None  # the round before it
        self._formed: dict[str, int] = {}  # signature -> formations so far
        self._orders_used: dict[frozenset, list[tuple]] = {}  # process 0 only
        self._published: dict[str, list | None] = {}  # process 0 only: signature -> order

    # ---- slices --------------------------------------------------------------------------------

    @property
    def num_slices(self) -> int:
        return len(self.by_process) // self.per_slice

    def slice_of(self, process: int) -> int:
        return process // self.per_slice

    def processes(self, slices) -> list[int]:
        return [p for s in slices for p in range(s * self.per_slice, (s + 1) * self.per_slice)]

    def slice_devices(self) -> list[list]:
        """Devices of each slice, by slice index (the supervisor's slice_to_devices)."""
        return [[d for p in self.processes([s]) for d in self.by_process[p]] for s in range(self.num_slices)]

    def complete_slices(self, live: dict[int, int]) -> list[int]:
        return [s for s in range(self.num_slices) if all(p in live for p in self.processes([s]))]

    # ---- rounds --------------------------------------------------------------------------------

    def _record(self, entry: set[int] | None = None) -> dict[int, int]:
        new: dict[int, int] = {}
        for d, incarnation in (live_devices.devices or {}).items():
            new[d.process_index] = int(incarnation)
        if entry is not None:  # this process's first rounds: entry and exit of one live_devices call
            self.current = new if entry == set(new) else None
        self.previous = self.current
        self.current = new
        return new

    def round(self) -> dict[int, int]:
        """One barrier round with every live process; returns {process: incarnation}."""
        first = live_devices.devices is None
        entry = None
        try:
            with live_devices(self.devices) as alive:
                entry = {d.process_index for d in alive}
        except ProcessFailureError:
            pass  # a process died or restarted since the last round: that is what rounds are for
        return self._record(entry if first else None)

    @property
    def stable(self) -> bool:
        return self.current is not None and self.current == self.previous

    def guard(self, step_fn: Callable, active_slices: Sequence[int]) -> Callable:
        """`step_fn` run inside live_devices and blocked on: a peer lost during the step raises
        ProcessFailureError on every survivor at this step; the round at its end also shows arrivals."""
        active = set(self.processes(active_slices))

        def guarded(*args, **kwargs):
            out = None
            try:
                with live_devices(self.devices):
                    out = jax.block_until_ready(step_fn(*args, **kwargs))
            except ProcessFailureError as e:
                self._record()
                lost = {d.process_index for d in e.failed_devices} & active
                if lost or out is None:
                    raise
                log.warning(
                    "process(es) %s outside this attempt failed; continuing",
                    sorted({d.process_index for d in e.failed_devices}),
                )
                return out
            self._record()
            return out

        return guarded

    def arrived(self, active_slices: Sequence[int]) -> list[int]:
        """Complete slices in the newest round that the attempt does not use (the same on every process)."""
        if self.current is None:
            return []
        return [s for s in self.complete_slices(self.current) if s not in set(active_slices)]

    # ---- waiting and forming ------------------------------------------------------------------

    def wait_for_slices(self, min_slices: int, *, timeout_s: float, poll_s: float) -> Formation:
        """Rounds until a stable one has >= min_slices complete slices including this process's; then
        the formation (mesh order from process 0). A process whose own slice is incomplete while the
        others train keeps taking part in their rounds (it is paced by their steps) until it is whole."""
        deadline = self.clock() + timeout_s
        mine = self.slice_of(self.me)
        while True:
            live = self.round()
            complete = self.complete_slices(live)
            enough = self.stable and len(complete) >= min_slices
            if enough:
                sig = signature({p: live[p] for p in self.processes(complete)})
                if self.me == 0:
                    self._publish_order(sig, complete)  # also when process 0 itself waits
                if mine in complete:
                    return self._form(sig, complete)
                continue  # waiting for this slice to be whole: no sleep, the others' steps pace the rounds
            if not self.stable:
                continue  # confirm at once: every other process is about to do the same round
            if self.clock() >= deadline:
                raise TimeoutError(
                    f"{len(complete)} complete slice(s) {complete} < {min_slices} after "
                    f"{timeout_s} s; live processes {sorted(live)}"
                )
            time.sleep(poll_s)

    def _form(self, sig: str, slices: list[int]) -> Formation:
        number = self._formed.get(sig, 0)
        self._formed[sig] = number + 1
        order = json.loads(self.client.blocking_key_value_get(_ORDER_KEY + sig, _ORDER_WAIT_MS))
        if order is None:
            raise ElasticGiveUp(
                f"no unused mesh device order is left for slices {slices}: each rejoin needs one "
                f"(stale gloo communicators); restart the job to reset"
            )
        formation = Formation(tuple(order), sig, number)
        log.info("formation %s: slices %s in mesh order %s", formation.key, slices, list(order))
        if self.events is not None:
            self.events.emit(
                "formation",
                key=formation.key,
                mesh_order=list(order),
                incarnations={p: i for p, i in sorted((self.current or {}).items())},
            )
        return formation

    def _publish_order(self, sig: str, slices: list[int]) -> None:
        if sig not in self._published:
            order = self._choose_order(slices)
            self._published[sig] = order
            self.client.key_value_set(_ORDER_KEY + sig, json.dumps(order))

    def _choose_order(self, slices: list[int]) -> list[int] | None:
        """Process 0: an order never used before on this set of slices (None when all are used).
        Slice 0 (holding process 0, which is never a failure victim) goes last when possible: a victim
        at the last ring position is the case where a survivor's receive can hang until the timeout."""
        used = self._orders_used.setdefault(frozenset(slices), [])
        others = [s for s in sorted(slices) if s != 0]
        candidates = ((*p, 0) for p in itertools.permutations(others)) if 0 in slices else iter(())
        for order in itertools.chain(candidates, itertools.permutations(sorted(slices))):
            if order not in used:
                used.append(order)
                return list(order)
        return None

    def barrier(self, name: str, formation: Formation, active_slices: Sequence[int], *, timeout_s: float) -> None:
        """Wait for every process of the formation at a named coordination-service barrier. Used before an
        attempt's first collective, so that one process compiling longer than the others waits here and
        not inside a collective, whose timeout is short (collective_timeout_seconds)."""
        self.client.wait_at_barrier(
            f"trainer/{name}/{formation.key}", int(timeout_s * 1000), process_ids=self.processes(active_slices)
        )

    def checkpoint_options(self, active_slices: Sequence[int], formation: Formation | None):
        """Orbax multi-process options for an attempt on `active_slices`: barriers only over its processes,
        the lowest of them the primary host, and barrier names unique to the formation."""
        import orbax.checkpoint as ocp

        procs = set(self.processes(active_slices))
        return ocp.options.MultiprocessingOptions(
            primary_host=min(procs),
            active_processes=procs,
            barrier_sync_key_prefix=None if formation is None else f"formation_{formation.key}",
        )
