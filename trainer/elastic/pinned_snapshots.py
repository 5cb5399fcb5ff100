"""Snapshots kept in the devices' hosts' pinned memory, for one controller (Pathways or one local process).

Under Pathways the controller drives every slice from one process: converting the train state to numpy
there would pull every replica's state through the head pod (90-380 GiB per replica at 8B-32B). Instead
a snapshot is an asynchronous `device_put` of the state, in its own sharding, to memory kind
`pinned_host`: each device's shard lands in its own host's memory and nothing passes through the
controller. The snapshot is split along the replica (data) axis, so a slice loss costs only the
replicas it held; the restore puts the surviving replicas onto the new mesh (more or fewer slices).
Orbax's Pathways `Snapshotter` does exactly this (pathwaysutils' `split_by_mesh_axis` /
`concatenate_by_mesh_axis`); this class adds the data-iterator state, the events, the local tier and, on
local virtual slices, the loss of the failed slice's host memory (`lose`).

The local tier (node-local disk) is written from the pinned copy by this process, which then is the
host the copy lives on: one local process, where the controller is the only host.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter

from trainer.elastic.snapshot import HostSnapshots, Snapshot, block_key
from trainer.observe import catalogue

log = logging.getLogger(__name__)

PINNED = "pinned_host"  # Snapshot.state of a snapshot held by the snapshotter, not by this process


class _ReplicaSnapshotter(Snapshotter):
    """Orbax's snapshotter, with access to the replicas of its newest snapshot (a tuple of replica trees
    and step, kept by Orbax in `_latest_snapshot`)."""

    def replicas(self) -> list:
        with self._lock:
            latest = getattr(self, "_latest_snapshot", None)
        return [] if latest is None else list(latest[0])

    def drop(self, dead: set) -> int:
        """Delete the pinned buffers of every replica with a shard on a `dead` device, as a lost slice's
        host memory is lost with it; returns how many replicas were dropped."""
        dropped = 0
        for tree in self.replicas():
            leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
            if any(d in dead for x in leaves for d in x.sharding.device_set):
                for x in leaves:
                    if not x.is_deleted():
                        x.delete()
                dropped += 1
        return dropped

    def alive(self) -> int:
        return sum(
            1
            for tree in self.replicas()
            if not any(x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
        )


def replica_nbytes(state) -> int:
    """Bytes of one replica of `state` (each array once, whatever its replication)."""
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "shape")))


def host_copy(tree) -> Any:
    """A numpy copy of one replica tree (for the local tier: this process is the host it lives on)."""

    def leaf(x):
        if not isinstance(x, jax.Array):
            return x
        out = np.empty(x.shape, x.dtype)
        seen = set()
        for shard in x.addressable_shards:
            key = block_key(shard.index, x.shape)
            if key not in seen:
                seen.add(key)
                out[tuple(slice(a, b) for a, b in key)] = np.asarray(shard.data)
        return out

    return jax.tree.map(leaf, tree)


class PinnedSnapshots(HostSnapshots):
    """`HostSnapshots` whose in-memory copy stays on the devices' hosts (`pinned_host`), never in this
    process's numpy. A step read back from the local tier is numpy (it came from disk) and restores as
    `HostSnapshots` does. Events say where each copy went: `memory=pinned_host` and `host_bytes=0`, the
    bytes this process converted to numpy for the snapshot or its restore."""

    def __init__(self, events, store=None):
        super().__init__(events, store)
        self._snapshotter = _ReplicaSnapshotter()

    def take(self, step: int, state, data_state: dict, *, block: bool = False, persist: bool = False) -> None:
        self.wait_for_copy()
        persist = persist and self.store is not None
        t0 = time.perf_counter()
        self.events.emit(catalogue.SNAPSHOT_STARTED, step=step, persist=persist)
        if persist:
            self.events.emit(catalogue.LOCAL_CHECKPOINT_SAVE_START, step=step)
        self._snapshotter.save(step, state)  # device_put to pinned_host, dispatched: the next step may donate
        nbytes = replica_nbytes(state)
        data_state = dict(data_state)

        def settle():
            self._snapshotter.join()
            got = self._snapshotter.latest
            if got is None or got.step != step:  # the copy failed (its slice was lost): not used
                log.warning("snapshot of step %d failed; keeping step %s", step, got and got.step)
                return
            replicas = self._snapshotter.alive()
            self._publish(
                Snapshot(step, PINNED, data_state, nbytes),
                t0,
                block,
                memory=PINNED,
                host_bytes=0,
                replicas=replicas,
            )
            if persist:
                self._write_local(step, data_state, started=t0)

        self._complete(step, settle, block=block, persist=persist, started=t0)

    def _write_local(self, step: int, data_state: dict, started: float | None = None) -> bool:
        replicas = [t for t in self._snapshotter.replicas() if not _deleted(t)]
        if not replicas:
            return False
        return self._write_local_copy(step, host_copy(replicas[0]), data_state, started=started)

    def _unpersistable(self, snap: Snapshot) -> str | None:
        if snap.state is not PINNED:
            return super()._unpersistable(snap)
        return None if self._snapshotter.alive() else "every replica of it was lost"

    def _persist(self, snap: Snapshot) -> bool:
        if snap.state is not PINNED:
            return super()._persist(snap)
        return self._write_local(snap.step, snap.data_state)

    def lose(self, devices: Iterable) -> None:
        """The hosts of `devices` lost their memory (a failed slice): their replicas are gone. On Pathways
        the runtime loses them itself; local virtual slices call this to behave the same."""
        dead = set(devices)
        self.wait_for_copy()
        dropped = self._snapshotter.drop(dead)
        if dropped:
            log.info("snapshot replicas lost with their slice: %d (%d left)", dropped, self._snapshotter.alive())
        snap = self.latest
        if snap is not None and snap.state is PINNED and not self._snapshotter.alive():
            self.latest = None  # every replica was on a lost slice: the snapshot is gone

    def can_serve(self, abstract_state) -> bool:
        snap = self.latest
        if snap is None or snap.state is not PINNED:
            return super().can_serve(abstract_state)
        return self._snapshotter.alive() > 0

    def load(self, abstract_state) -> tuple[Any, dict]:
        snap = self.latest
        if snap.state is not PINNED:
            return super().load(abstract_state)
        t0 = time.perf_counter()
        used = self._snapshotter.alive()
        # Restored onto the new mesh from the surviving replicas; the restored state becomes the snapshot
        # (pinned on the new mesh's hosts), so a second loss before the next snapshot still finds it.
        state = self._snapshotter.load(abstract_state)
        self._restored(snap, t0, memory=PINNED, replicas=used, host_bytes=0)
        return state, snap.data_state


def _deleted(tree) -> bool:
    return any(x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
