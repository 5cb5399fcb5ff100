"""Host-RAM snapshots of the train state and data-iterator state, taken far more often than checkpoints.

`take` copies each distinct shard of the state into its host's pinned memory (an asynchronous
`device_put`: the next step may donate the original, the device holds no second copy of the state, and
replicas are copied once), or makes an on-device copy where the backend has no pinned host memory, then
turns it into this process's numpy on a background thread while training continues. The numpy copy is
what survives a change of formation, which renews the process's JAX client and with it every buffer.
A process keeps only what its own devices hold: the whole state when its slice is one process, else its
blocks of each array (`Blocks`). Recovery restores the newest
complete snapshot by the restore order of `trainer.attempt.restore` (unless a committed checkpoint is newer),
so a slice failure rewinds at most `snapshot_period` steps instead of `checkpoint_period`.

With the local checkpoint tier on (`trainer.checkpoint.local_store`), every `local_checkpoint_period`
steps the same background thread also writes the host copy to node-local disk, and a new process
starts with the newest local step as its snapshot: one mechanism, one restore path, whether the copy
survived in RAM (a slice failure) or on disk (the process was lost).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer.attempt.restore import LOCAL, choose_source
from trainer.observe import catalogue

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Snapshot:
    step: int
    state: Any  # numpy pytree
    data_state: dict
    nbytes: int
    origin: str = "snapshot"  # "local": read back from the local checkpoint tier


PINNED_HOST = "pinned_host"


def _has_pinned_host(device) -> bool:
    try:
        return any(m.kind == PINNED_HOST for m in device.addressable_memories())
    except Exception:  # a backend without memory spaces
        return False


def _copy_out(data: jax.Array) -> jax.Array:
    """A copy of one shard that the next step's donation cannot touch: in pinned host memory where the
    device has it (no device memory spent), else on the device."""
    if _has_pinned_host(next(iter(data.devices()))):
        return jax.device_put(data, data.sharding.with_memory_kind(PINNED_HOST))
    return jnp.copy(data)


def _distinct_shards(x: jax.Array) -> list[tuple[tuple, jax.Array]]:
    """(index, copy) of one addressable shard per distinct block of `x`.

    A data-parallel state is replicated across slices: copying every replica would move the state
    once per slice for nothing. The copy is dispatched now, so the next step may donate `x` right after."""
    seen, out = set(), []
    for shard in x.addressable_shards:
        key = block_key(shard.index, x.shape)
        if key not in seen:
            seen.add(key)
            out.append((shard.index, _copy_out(shard.data)))
    return out


def block_key(index: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices, maybe open-ended) as ((start, stop), ...) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


@dataclasses.dataclass
class Blocks:
    """The blocks of one array that this process holds, when its devices hold only part of it (a slice
    spread over several processes): one copy per distinct block, keyed by `block_key`."""

    shape: tuple
    dtype: np.dtype
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks.values())

    def block(self, index: tuple) -> np.ndarray | None:
        """The region `index` names, if one held block contains it (else None)."""
        want = block_key(index, self.shape)
        if want in self.blocks:
            return self.blocks[want]
        for key, data in self.blocks.items():
            if all(a <= c and d <= b for (a, b), (c, d) in zip(key, want)):
                return data[tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(key, want))]
        return None


def block_of(leaf, index: tuple) -> np.ndarray | None:
    """The region `index` of a snapshot leaf (a whole numpy array, or this process's `Blocks`)."""
    return leaf.block(index) if isinstance(leaf, Blocks) else leaf[index]


def held_nbytes(host) -> int:
    """Bytes a snapshot occupies in this process's RAM."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(host)))


def _assemble(shape, dtype, shards: list[tuple[tuple, jax.Array]]):
    """The host copy of one leaf: a numpy array when this process's blocks cover it, else `Blocks`."""
    if len(shards) == 1 and tuple(shards[0][1].shape) == tuple(shape):
        return np.asarray(shards[0][1])  # one block holds it all (the copy is ours): no second copy
    blocks = {block_key(index, shape): np.asarray(data) for index, data in shards}
    if sum(b.size for b in blocks.values()) != math.prod(shape):
        return Blocks(tuple(shape), np.dtype(dtype), blocks)  # the rest lives on other processes
    host = np.empty(shape, dtype)
    for key, block in blocks.items():
        host[tuple(slice(a, b) for a, b in key)] = block
    return host


class HostSnapshots:
    """Keeps the newest complete snapshot; at most one host copy is in flight.

    `store` (a `LocalStore`, or None): where `take(..., persist=True)` also writes the copy, and where
    `newest_step` finds a newer one than RAM holds (a restarted process)."""

    def __init__(self, events, store=None, copy_delay: Callable[[int], float] = lambda step: 0.0):
        """`copy_delay(step)`: extra seconds the host copy of that step takes (an injected slow copy)."""
        self.events = events
        self.store = store
        self.copy_delay = copy_delay
        self.latest: Snapshot | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def take(self, step: int, state, data_state: dict, *, block: bool = False, persist: bool = False) -> None:
        """Copy `state` (maybe still being computed) to host memory; with `persist`, also write it to the
        local tier. The loop is blocked only while the on-device copies are dispatched."""
        self.wait_for_copy()
        persist = persist and self.store is not None
        t0 = time.perf_counter()
        self.events.emit(catalogue.SNAPSHOT_STARTED, step=step, persist=persist)
        leaves, treedef = jax.tree.flatten(state)
        on_device = [(x.shape, x.dtype, _distinct_shards(x)) for x in leaves]
        data_state = dict(data_state)

        def to_host():
            if delay := self.copy_delay(step):
                time.sleep(delay)
            try:
                host = jax.tree.unflatten(treedef, [_assemble(*leaf) for leaf in on_device])
            except Exception as e:  # a snapshot lost with its slice is simply not used
                log.warning("snapshot of step %d failed: %s", step, e)
                return
            nbytes = held_nbytes(host)
            self._publish(Snapshot(step, host, data_state, nbytes), t0, block, memory="numpy", host_bytes=nbytes)
            if persist and any(isinstance(leaf, Blocks) for leaf in jax.tree.leaves(host)):
                log.warning("local checkpoint of step %d skipped: this process holds part of the state", step)
            elif persist:
                self._write_local_copy(step, host, data_state, started=t0)

        if persist:
            self.events.emit(catalogue.LOCAL_CHECKPOINT_SAVE_START, step=step)
        self._complete(step, to_host, block=block, persist=persist, started=t0)

    def _complete(self, step: int, finish: Callable[[], None], *, block: bool, persist: bool, started: float):
        """Run `finish` (the copy's completion) now when `block`, else on the snapshot thread."""
        if block:
            finish()
        else:
            self._thread = threading.Thread(target=finish, name=f"snapshot-{step}", daemon=True)
            self._thread.start()
        if persist:
            self.events.emit(
                catalogue.LOCAL_CHECKPOINT_SAVE_BLOCKED,
                step=step,
                seconds=round(time.perf_counter() - started, 4),
            )

    def _publish(self, snap: Snapshot, started: float, block: bool, **where) -> None:
        """`snap` is complete: it becomes the newest, and `snapshot_taken` says where it went."""
        with self._lock:
            self.latest = snap
        self.events.emit(
            catalogue.SNAPSHOT_TAKEN,
            step=snap.step,
            bytes=snap.nbytes,
            seconds=round(time.perf_counter() - started, 4),
            blocking=block,
            **where,
        )

    def _restored(self, snap: Snapshot, started: float, **where) -> None:
        self.events.emit(
            catalogue.SNAPSHOT_RESTORED,
            step=snap.step,
            bytes=snap.nbytes,
            seconds=round(time.perf_counter() - started, 4),
            origin=snap.origin,
            **where,
        )

    def _write_local_copy(self, step: int, host, data_state: dict, *, started: float | None = None) -> bool:
        """Write a host copy to the local tier; a full or failing local disk costs the tier, not the run."""
        try:
            self.store.write(step, host, data_state, started=started)
        except OSError as e:
            log.warning("local checkpoint of step %d failed: %s", step, e)
            self.events.emit(catalogue.LOCAL_CHECKPOINT_SAVE_FAILED, step=step, error=str(e))
            return False
        return True

    def persist_latest(self) -> int | None:
        """Write the newest complete snapshot to the local tier when it is newer than every local step
        (a stop outside a step boundary: the fastest save of the newest state this process holds);
        returns the step written, or None. Waits for nothing: not for a copy still in flight, nor for the
        snapshot's metrics row. A local step must have its row (a resumed run's metrics.jsonl has no gap),
        and the row of the step dispatched last is written only once the next one is dispatched: when the
        loop is stuck (a hang) it never comes, so that snapshot is not written. A newer snapshot left
        unwritten is reported (`local_checkpoint_save_failed`, with the reason and the local step kept)."""
        snap = self.latest
        if self.store is None or snap is None or snap.origin == "local":
            return None
        newest = self.store.newest_step()
        if newest is not None and newest >= snap.step:
            return None
        why = self._unpersistable(snap)
        if why is None and not self.store.has_row(snap.step):
            why = "its metrics row is not written (the loop stopped before writing it) and a local step needs it"
        if why is not None:
            kept = "no local step" if newest is None else f"local step {newest}"
            log.warning(
                "host snapshot of step %d not written to the local tier: %s; it keeps %s", snap.step, why, kept
            )
            self.events.emit(
                catalogue.LOCAL_CHECKPOINT_SAVE_FAILED, step=snap.step, error=f"{why}; the local tier keeps {kept}"
            )
            return None
        self.events.emit(catalogue.LOCAL_CHECKPOINT_SAVE_START, step=snap.step)
        return snap.step if self._persist(snap) else None

    def _unpersistable(self, snap: Snapshot) -> str | None:
        """Why `snap` cannot go to the local tier, or None."""
        if any(isinstance(leaf, Blocks) for leaf in jax.tree.leaves(snap.state)):
            return "this process holds part of the state and the local tier needs all of it"
        return None

    def _persist(self, snap: Snapshot) -> bool:
        return self._write_local_copy(snap.step, snap.state, snap.data_state)

    def lose(self, devices: Iterable) -> None:
        """The hosts of `devices` lost their memory (a failed slice). This process's copy is in its own
        RAM, which a slice's loss leaves alone (`PinnedSnapshots` keeps copies on the devices' hosts)."""

    def attempt_started(self) -> None:
        """An attempt's loop starts: local steps commit as its metrics rows are written."""
        if self.store is not None and self.store.recorded is not None:
            self.store.recorded.begin()

    def attempt_ended(self) -> None:
        """The attempt's loop ended: a local write still waiting for a row that will not come gives up."""
        if self.store is not None and self.store.recorded is not None:
            self.store.recorded.end()

    def wait_for_copy(self) -> None:
        """Wait for an in-flight host copy (called before a new one and before recovery)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def newest_step(
        self, abstract_state=None, checkpoint_step: int | None = None, not_after: int | None = None
    ) -> int | None:
        """Step of the newest complete snapshot (after any in-flight copy), in RAM or, when newer than
        RAM and `checkpoint_step`, in the local tier; `trainer.attempt.restore` decides whether it beats the
        checkpoint. `not_after`: snapshots and local steps of later steps are dropped first."""
        self.wait_for_copy()
        if not_after is not None:
            self.discard_after(not_after)
        if self.store is not None and abstract_state is not None:
            self._adopt_local(abstract_state, checkpoint_step)
        return None if self.latest is None else self.latest.step

    def discard_after(self, step: int) -> None:
        """Forget the snapshot and local steps of steps after `step` (unverified states a rollback leaves)."""
        if self.latest is not None and self.latest.step > step:
            log.warning("snapshot of step %d dropped: newer than step %d, verified clean", self.latest.step, step)
            self.latest = None
        if self.store is not None:
            for dropped in self.store.discard_after(step):
                log.warning("local checkpoint of step %d dropped: newer than the state verified clean", dropped)

    def unusable_local_steps(self) -> list[int]:
        """With no snapshot adopted, every local step left on disk was read and skipped by `_adopt_local`
        (it stops only at a usable step, at RAM's step, or below the checkpoint's)."""
        if self.latest is not None or self.store is None:
            return []
        return self.store.steps()

    def origin(self) -> str:
        """Where the newest snapshot came from: "snapshot" (this process's RAM) or "local" (disk)."""
        return "snapshot" if self.latest is None else self.latest.origin

    def _adopt_local(self, abstract_state, checkpoint_step: int | None) -> None:
        """Make the newest usable local step the snapshot, if it is newer than what RAM and the
        persistent tier hold; an unusable one is skipped with an event saying why."""
        from trainer.checkpoint.local_store import LocalStepUnusable

        self.store.cleanup_partial()
        in_ram = None if self.latest is None else self.latest.step
        for step in reversed(self.store.steps()):
            # Newest first: once the restore order prefers RAM or the checkpoint to a local step, it
            # prefers them to every older one too.
            if choose_source(snapshot_step=in_ram, local_step=step, checkpoint_step=checkpoint_step) != LOCAL:
                return
            t0 = time.perf_counter()
            try:
                host, data_state = self.store.read(step, abstract_state)
            except LocalStepUnusable as e:
                log.warning("%s; trying an older one", e)
                self.events.emit(catalogue.LOCAL_CHECKPOINT_SKIPPED, step=step, reason=str(e))
                continue
            nbytes = held_nbytes(host)
            self.latest = Snapshot(step, host, data_state, nbytes, origin="local")
            self.events.emit(
                catalogue.LOCAL_CHECKPOINT_READ,
                step=step,
                bytes=nbytes,
                seconds=round(time.perf_counter() - t0, 4),
            )
            return

    def can_serve(self, abstract_state) -> bool:
        """Whether the newest snapshot holds every block this process's devices need on the shardings of
        `abstract_state` (always, unless a slice spreads over several processes and its layout moved)."""
        snap = self.latest
        if snap is None:
            return False
        leaves, abstract = jax.tree.leaves(snap.state), jax.tree.leaves(abstract_state)
        if len(leaves) != len(abstract):
            return False
        for leaf, a in zip(leaves, abstract):
            if tuple(leaf.shape) != tuple(a.shape):
                return False
            if isinstance(leaf, Blocks):
                index_map = a.sharding.addressable_devices_indices_map(a.shape)
                if any(leaf.block(index) is None for index in index_map.values()):
                    return False
        return True

    def load(self, abstract_state) -> tuple[Any, dict]:
        """The newest snapshot on the shardings of `abstract_state`, and its data-iterator state."""
        snap = self.latest
        t0 = time.perf_counter()
        leaves, treedef = jax.tree.flatten(snap.state)
        arrays = [
            jax.make_array_from_callback(a.shape, a.sharding, lambda index, leaf=leaf: block_of(leaf, index))
            for leaf, a in zip(leaves, jax.tree.leaves(abstract_state))
        ]
        state = jax.block_until_ready(jax.tree.unflatten(treedef, arrays))
        self._restored(snap, t0)
        return state, snap.data_state
