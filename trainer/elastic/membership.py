"""Which processes are alive, as every live process agrees, and the mesh device order of each formation.

Agreement comes from `jax.experimental.multihost_utils.live_devices`, a barrier over every live
process (the coordination service's GetAliveTasks): one *round* returns the same {process:
incarnation} map to every process that took part. Rounds happen at the end of every train step (the
step runs inside `live_devices`, so a peer that died during it makes every survivor raise
`ProcessFailureError` at the same step) and in `wait_for_slices`. A replacement process's first rounds
meet the survivors' step-end round, so all of them see it at the same step and scale up together.

A *formation* (the set of processes an attempt runs on) is settled only by a *stable* round: one whose
result equals the previous round's. Whatever each process was doing when membership changed (a step,
waiting, starting up), they all settle on the same round: each applies the rule from the newest round
it already took (`wait_for_slices`), so paths with different numbers of rounds do not put one process a
round ahead of another.

Every formation has one mesh order per set of slices (`mesh_order`), the same on every process and in
every formation, so any number of rejoins work and a replayed step runs on the same order. What a
formation after a failure needs instead is fresh collective communicators on every member
(`trainer.distributed.communicators`): `_form` takes two barriers around deleting the old rendezvous,
then each member that already ran collectives over one of the new mesh's device groups creates a new
CPU client.

Barriers here are rounds: a member records its arrival in the key-value store and takes rounds until
every member has arrived. A round waits for every live process, so a slow member (still compiling) is
waited for without a deadline, a member that died is seen at once (ProcessFailureError, a slice-down
event), and a process that failed for another reason and recorded it (`trainer.distributed.fatal`) is
seen at the next round (PeerFailed: every process stops with its cause).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence

import jax
from jax.experimental.multihost_utils import ProcessFailureError, live_devices

from trainer.distributed import fatal, internals
from trainer.distributed.heartbeat import Barrier
from trainer.observe import catalogue
from trainer.process.preemption import Preempted

log = logging.getLogger(__name__)

_BARRIER_KEY = "trainer/barrier/"  # + name: how many members arrived
_BARRIER_POLL_S = 0.05


def mesh_order(slices: Sequence[int]) -> list[int]:
    """The mesh order of a set of slices: ascending, slice 0 last (it holds process 0, which never fails
    without ending the job; a failed peer at the last ring position is the case where a survivor's
    receive waits longest)."""
    return [s for s in sorted(slices) if s != 0] + ([0] if 0 in slices else [])


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
        fresh_devices: Callable[[], Sequence[jax.Device]] | None = None,
        forget_rendezvous: Callable[[], None] | None = None,
        cliques_of: Callable[[list[list[jax.Device]]], set] | None = None,
    ):
        self._set_devices(devices)
        self.fresh_devices = fresh_devices  # drops the collectives' state; None where it survives failures
        self.forget_rendezvous = forget_rendezvous
        # Device groups (`trainer.distributed.communicators.mesh_cliques` of each slice's devices in mesh
        # order) this process's client ran collectives over; None: unknown, every formation reuses them.
        self.cliques_of = cliques_of
        self.cliques_used: set = set()
        self.fresh_clients = 0  # how many times this process re-created its devices
        self.per_slice = processes_per_slice
        self.me = process_index
        self.client = client
        self.events = events
        self.clock = clock
        self.current: dict[int, int] | None = None  # the newest round: process -> incarnation
        self.previous: dict[int, int] | None = None  # the round before it
        self._formed: dict[str, int] = {}  # signature -> formations so far

    def _set_devices(self, devices: Sequence[jax.Device]) -> None:
        self.devices = sorted(devices, key=lambda d: d.id)
        self.by_process: dict[int, list] = {}
        for d in self.devices:
            self.by_process.setdefault(d.process_index, []).append(d)

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

    @staticmethod
    def _newest_round() -> dict[int, int]:
        """What jax's live_devices saw last: {process: incarnation}."""
        return internals.newest_round()

    def _record(self, new: dict[int, int], entry: set[int] | None = None) -> dict[int, int]:
        if entry is not None:  # this process's first rounds: entry and exit of one live_devices call
            self.current = new if entry == set(new) else None
        self.previous = self.current
        self.current = new
        return new

    def round(self) -> dict[int, int]:
        """One barrier round with every live process; returns {process: incarnation}."""
        first = internals.no_round_yet()
        entry = None
        try:
            with live_devices(self.devices) as alive:
                entry = {d.process_index for d in alive}
        except ProcessFailureError:
            pass  # a process died or restarted since the last round: that is what rounds are for
        return self._record(self._newest_round(), entry if first else None)

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
                self._record(self._newest_round())
                lost = {d.process_index for d in e.failed_devices} & active
                if lost or out is None:
                    raise
                log.warning(
                    "process(es) %s outside this attempt failed; continuing",
                    sorted({d.process_index for d in e.failed_devices}),
                )
                return out
            self._record(self._newest_round())
            return out

        return guarded

    def arrived(self, active_slices: Sequence[int]) -> list[int]:
        """Complete slices in the newest round that the attempt does not use (the same on every process)."""
        if self.current is None:
            return []
        return [s for s in self.complete_slices(self.current) if s not in set(active_slices)]

    # ---- waiting and forming ------------------------------------------------------------------

    def wait_for_slices(
        self, min_slices: int, *, timeout_s: float, poll_s: float, should_stop: Callable[[], bool] = lambda: False
    ) -> Formation:
        """Rounds until a stable one has >= min_slices complete slices including this process's; then
        the formation (mesh order from process 0). A process whose own slice is incomplete while the
        others train keeps taking part in their rounds (it is paced by their steps) until it is whole.

        The rule is applied first to the newest round this process already took (the failed step's, the
        supervisor's after it, or the two calls of a first round), then after every new one. So every
        process applies it after every round from the one where it left its attempt, and all decide on the
        same round however many rounds their own path took: a replacement whose first round met the
        survivors' failing step decides after its second call, which is the survivors' supervisor round.
        A process deciding a round after another would enter the formation's barriers a round behind,
        read their counters at other moments, and could wait in a round that the others, gone ahead to a
        barrier without rounds, never take.

        `should_stop()` is asked before every round: true (a stop the job agreed on) raises Preempted."""
        deadline = self.clock() + timeout_s
        mine = self.slice_of(self.me)
        take_round = self.current is None
        while True:
            if should_stop():
                raise Preempted("waiting_for_slices")
            if take_round:
                self.round()
                fatal.check(self.client, self.me)
            take_round = True
            live = self.current
            complete = self.complete_slices(live)
            enough = self.stable and len(complete) >= min_slices
            if enough:
                sig = signature({p: live[p] for p in self.processes(complete)})
                if mine in complete:
                    try:
                        return self._form(sig, complete, timeout_s=timeout_s)
                    except ProcessFailureError as e:  # a member died while forming: round again
                        log.warning("formation interrupted: %s", e)
                continue  # waiting for this slice to be whole: no sleep, the others' steps pace the rounds
            if not self.stable:
                continue  # confirm at once: every other process is about to do the same round
            if self.clock() >= deadline:
                raise TimeoutError(
                    f"{len(complete)} complete slice(s) {complete} < {min_slices} after "
                    f"{timeout_s} s; live processes {sorted(live)}"
                )
            time.sleep(poll_s)

    def _form(self, sig: str, slices: list[int], *, timeout_s: float) -> Formation:
        number = self._formed.get(sig, 0)
        self._formed[sig] = number + 1
        formation = Formation(tuple(mesh_order(slices)), sig, number)
        if self.fresh_devices is not None:
            members = self.processes(slices)
            self._meet(f"form/{formation.key}/enter", members, timeout_s=timeout_s)
            if self.me == min(members):  # nobody runs a collective until every member left the next barrier
                self.forget_rendezvous()
            self._meet(f"form/{formation.key}/clean", members, timeout_s=timeout_s)
            devices = self.slice_devices()
            cliques = self.cliques_of([devices[s] for s in formation.slices]) if self.cliques_of else {"all"}
            if self.cliques_used & cliques:
                self.cliques_used = set()
                self._set_devices(self.fresh_devices())
                self.fresh_clients += 1
                # The next round compares with the newest one, on the new device objects (a first round
                # would take two barrier calls where the other members take one).
                internals.set_round(
                    {
                        d: self.current[d.process_index]
                        for d in self.devices
                        if d.process_index in (self.current or {})
                    }
                )
            self.cliques_used |= cliques  # the attempt on this formation runs collectives over them
        log.info("formation %s: slices %s in mesh order %s", formation.key, slices, list(formation.slices))
        if self.events is not None:
            self.events.emit(
                catalogue.FORMATION,
                key=formation.key,
                mesh_order=list(formation.slices),
                incarnations={p: i for p, i in sorted((self.current or {}).items())},
                fresh_clients=self.fresh_clients,
            )
        return formation

    def fail(self, error: BaseException, *, wait_s: float) -> None:
        """This process failed for a reason that is not a lost peer: record the cause for every process,
        then take rounds (which the others' failing collectives and waits meet) until every other live
        process has seen it or left, at most `wait_s`."""
        fatal.publish(self.client, self.me, error)
        deadline = self.clock() + wait_s
        while self.clock() < deadline:
            others = set(self.round()) - {self.me}
            if others <= fatal.acknowledged(self.client):
                return
            time.sleep(_BARRIER_POLL_S)
        log.warning("processes still running %s s after this one failed", wait_s)

    def barrier(self, name: str, formation: Formation, active_slices: Sequence[int], *, timeout_s: float) -> None:
        """Wait for every process of the formation. Used before an attempt's first collective, so that one
        process compiling longer than the others waits here and not inside a collective, whose timeout is
        short (collective_timeout_seconds)."""
        self._meet(f"{name}/{formation.key}", self.processes(active_slices), timeout_s=timeout_s)

    def _meet(self, name: str, members: Sequence[int], *, timeout_s: float) -> None:
        """A barrier of rounds (see the module docstring): returns once every member arrived; raises
        ProcessFailureError when a member dies or restarts meanwhile, PeerFailed when a process recorded a
        fatal error, TimeoutError after `timeout_s` without a round (a round itself waits for every live
        process without a deadline)."""
        key = _BARRIER_KEY + name
        self.client.key_value_increment(key, 1)
        expected = {p: (self.current or {}).get(p) for p in members}
        deadline = self.clock() + timeout_s
        while True:
            live = self.round()
            fatal.check(self.client, self.me)
            lost = [p for p in members if p not in live or (expected[p] is not None and live[p] != expected[p])]
            if lost:
                raise ProcessFailureError({d for p in lost for d in self.by_process.get(p, [])})
            if self.client.key_value_increment(key, 0) >= len(members):
                return
            if self.clock() >= deadline:
                raise TimeoutError(f"barrier {name}: members {list(members)} did not all arrive in {timeout_s} s")
            time.sleep(_BARRIER_POLL_S)

    def checkpoint_barrier(
        self, active_slices: Sequence[int], formation: Formation | None, *, dead_after_s: float
    ) -> Barrier:
        """Orbax's barrier for an attempt on `active_slices`: ends with ProcessFailureError when one of its
        processes stops its heartbeat or restarts (trainer.distributed.heartbeat)."""
        return Barrier(
            self.client,
            self.processes(active_slices),
            dead_after_s=dead_after_s,
            scope="" if formation is None else formation.key,
            devices_of=lambda p: self.by_process.get(p, []),
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
