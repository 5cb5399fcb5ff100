"""Host-RAM snapshots of the train state and data-iterator state, taken far more often than checkpoints.

`take` makes an on-device copy of each distinct shard of the state (cheap, asynchronous: the next step
may donate the original; replicas are copied once) and copies it to host memory on a background
thread while training continues. Recovery restores the newest complete snapshot by the
restore order of `trainer.restore` (unless a committed checkpoint is newer), so a slice failure rewinds
at most `snapshot_period` steps instead of `checkpoint_period`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer.state import tree_nbytes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Snapshot:
    step: int
    state: Any  # numpy pytree
    data_state: dict
    nbytes: int


def _distinct_shards(x: jax.Array) -> list[tuple[tuple, jax.Array]]:
    """(index, on-device copy) of one addressable shard per distinct block of `x`.

    A data-parallel state is replicated across slices: copying every replica would move the state
    once per slice (and hold that much extra device memory until the host copy is done) for nothing.
    The copy is dispatched now, so the next step may donate `x` right after."""
    seen, out = set(), []
    for shard in x.addressable_shards:
        key = tuple((i.start, i.stop) for i in shard.index)
        if key not in seen:
            seen.add(key)
            out.append((shard.index, jnp.copy(shard.data)))
    return out


def _assemble(shape, dtype, shards: list[tuple[tuple, jax.Array]]) -> np.ndarray:
    host = np.empty(shape, dtype)
    covered = 0
    for index, data in shards:
        block = np.asarray(data)
        host[index] = block
        covered += block.size
    if covered != host.size:  # a block lives on another process: not this process's to snapshot alone
        raise ValueError(f"addressable shards cover {covered} of {host.size} elements")
    return host


class HostSnapshots:
    """Keeps the newest complete snapshot; at most one host copy is in flight."""

    def __init__(self, events):
        self.events = events
        self.latest: Snapshot | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def take(self, step: int, state, data_state: dict, *, block: bool = False) -> None:
        self.settle()
        t0 = time.perf_counter()
        leaves, treedef = jax.tree.flatten(state)
        on_device = [(x.shape, x.dtype, _distinct_shards(x)) for x in leaves]
        data_state = dict(data_state)

        def to_host():
            try:
                host = jax.tree.unflatten(treedef, [_assemble(*leaf) for leaf in on_device])
            except Exception as e:  # a snapshot lost with its slice is simply not used
                log.warning("snapshot of step %d failed: %s", step, e)
                return
            nbytes = tree_nbytes(host)
            with self._lock:
                self.latest = Snapshot(step, host, data_state, nbytes)
            self.events.emit(
                "snapshot_taken",
                step=step,
                bytes=nbytes,
                seconds=round(time.perf_counter() - t0, 4),
                blocking=block,
            )

        if block:
            to_host()
        else:
            self._thread = threading.Thread(target=to_host, name=f"snapshot-{step}", daemon=True)
            self._thread.start()

    def settle(self) -> None:
        """Wait for an in-flight host copy (called before a new one and before recovery)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def newest_step(self, abstract_state=None, checkpoint_step: int | None = None) -> int | None:
        """Step of the newest complete snapshot (after any in-flight copy); `trainer.restore` decides
        whether it beats the checkpoint."""
        self.settle()
        return None if self.latest is None else self.latest.step

    def load(self, abstract_state) -> tuple[Any, dict]:
        """The newest snapshot on the shardings of `abstract_state`, and its data-iterator state."""
        snap = self.latest
        t0 = time.perf_counter()
        shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
        state = jax.block_until_ready(jax.device_put(snap.state, shardings))
        self.events.emit(
            "snapshot_restored", step=snap.step, bytes=snap.nbytes, seconds=round(time.perf_counter() - t0, 4)
        )
        return state, snap.data_state
