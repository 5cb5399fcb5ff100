"""Host snapshots as a restore source when an attempt spans several processes.

Every process of a new formation calls `newest_step` and then `load` together (they run collectives on
the new mesh). They gather (snapshot step, newest checkpoint step, size of the data-iterator state)
from each other, so all of them see the same newest snapshot and take the same decision
(`trainer.restore.choose_source`). Loading it:
- every process holds it (survivors continuing after a loss): each puts its own copy on its devices;
- some lack it (a replacement that just joined): it is sent from the first holder in mesh order
  (`trainer.distributed.transfer.broadcast_from_row`), the data-iterator state (JSON bytes) with it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from trainer.distributed.transfer import broadcast_from_row, gather_rows
from trainer.elastic.snapshot import HostSnapshots
from trainer.state import tree_nbytes


class SharedSnapshots:
    """`trainer.restore.SnapshotSource` over this process's `HostSnapshots` and its peers'.

    `barrier` runs first: every process has compiled, and the collectives start together."""

    def __init__(self, snapshots: HostSnapshots, events, *, barrier: Callable[[], None] = lambda: None):
        self.snapshots = snapshots
        self.events = events
        self.barrier = barrier
        self.mesh = None
        self._table: np.ndarray | None = None
        self._process_of_row: list[int] = []

    def newest_step(self, abstract_state, checkpoint_step: int | None) -> int | None:
        self.barrier()
        self.mesh = jax.tree.leaves(abstract_state)[0].sharding.mesh
        mine = self.snapshots.newest_step(abstract_state, checkpoint_step)
        blob = self._data_blob()
        ckpt = -1 if checkpoint_step is None else checkpoint_step
        local = int(mine is not None and self.snapshots.origin() == "local")
        table, self._process_of_row = gather_rows(
            self.mesh, [-1 if mine is None else mine, ckpt, len(blob), local]
        )
        if len(set(table[:, 1])) != 1:
            raise RuntimeError(
                f"processes see different newest checkpoints {sorted(set(table[:, 1]))}: "
                "the checkpoint directory must be one shared filesystem"
            )
        self._table = table
        best = int(table[:, 0].max())
        return None if best < 0 else best

    def origin(self) -> str:
        """ "local" when the newest snapshot's first holder in mesh order read it from its local tier."""
        table = self._table
        best = int(table[:, 0].max())
        return "local" if table[int(np.argmax(table[:, 0] == best)), 3] else "snapshot"

    def load(self, abstract_state) -> tuple[Any, dict]:
        table, best = self._table, int(self._table[:, 0].max())
        if (table[:, 0] == best).all():
            return self.snapshots.load(abstract_state)
        t0 = time.perf_counter()
        snap = self.snapshots.latest
        source_row = int(np.argmax(table[:, 0] == best))
        size = int(table[:, 2].max())
        payload = None
        if snap is not None and snap.step == best:
            payload = {"state": snap.state, "data": np.frombuffer(self._data_blob().ljust(size), np.uint8)}
        shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
        abstract = {"state": abstract_state, "data": jax.ShapeDtypeStruct((size,), np.uint8)}
        replicated = NamedSharding(self.mesh, PartitionSpec())
        out = broadcast_from_row(
            self.mesh, source_row, payload, abstract, {"state": shardings, "data": replicated}
        )
        state = jax.block_until_ready(out["state"])
        data_state = json.loads(np.asarray(out["data"]).tobytes().decode().strip() or "{}")
        self.events.emit(
            "snapshot_shared",
            step=best,
            source_process=self._process_of_row[source_row],
            origin=self.origin(),
            bytes=tree_nbytes(state),
            seconds=round(time.perf_counter() - t0, 4),
        )
        return state, data_state

    def _data_blob(self) -> bytes:
        snap = self.snapshots.latest
        return json.dumps(snap.data_state).encode() if snap is not None else b""
