"""Host snapshots as a restore source when an attempt spans several processes.

Every process of a new formation calls `newest_step` and then `load` together (they run collectives on
the new mesh). They gather (snapshot step, newest checkpoint step, size of the data-iterator state,
local tier, holds its devices' blocks) from each other, so all of them see the same newest snapshot and
take the same decision (`trainer.attempt.restore.choose_source`). A process of a slice spread over several
processes holds only its own devices' blocks (`trainer.elastic.snapshot.Blocks`). Loading it:
- every process holds its blocks of it (survivors continuing after a loss): each puts its own copy on
  its devices, no transfer;
- some lack it (a replacement that just joined, or the other processes of its slice): it is sent from
  the first data-parallel row (a slice's replica) whose processes all hold it, each device receiving only
  its shard (`trainer.distributed.transfer.broadcast_from_data_row`), the data-iterator state with it;
- no row holds it whole: it is skipped (`snapshot_skipped`) and the checkpoint is used.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from trainer.distributed.transfer import broadcast_from_data_row, data_rows_of, gather_rows
from trainer.elastic.snapshot import HostSnapshots, block_of
from trainer.observe import catalogue

STEP, CHECKPOINT, BLOB, LOCAL, SERVES = range(5)  # the columns of the gathered table


class SharedSnapshots:
    """`trainer.attempt.restore.SnapshotSource` over this process's `HostSnapshots` and its peers'.

    `barrier` runs first: every process has compiled, and the collectives start together."""

    def __init__(self, snapshots: HostSnapshots, events, *, barrier: Callable[[], None] = lambda: None):
        self.snapshots = snapshots
        self.events = events
        self.barrier = barrier
        self.mesh = None
        self._table: dict[int, np.ndarray] | None = None  # process -> its gathered row
        self._best: int | None = None
        self._source_row: int | None = None  # data row to send from; None: every process holds it

    def newest_step(self, abstract_state, checkpoint_step: int | None, not_after: int | None = None) -> int | None:
        self.barrier()
        self.mesh = jax.tree.leaves(abstract_state)[0].sharding.mesh
        mine = self.snapshots.newest_step(abstract_state, checkpoint_step, not_after)
        serves = int(mine is not None and self.snapshots.can_serve(abstract_state))
        ckpt = -1 if checkpoint_step is None else checkpoint_step
        local = int(mine is not None and self.snapshots.origin() == "local")
        per_device, process_of_row = gather_rows(
            self.mesh, [-1 if mine is None else mine, ckpt, len(self._data_blob()), local, serves]
        )
        table = {p: per_device[r] for r, p in enumerate(process_of_row)}
        checkpoints = sorted({int(v[CHECKPOINT]) for v in table.values()})
        if len(checkpoints) != 1:
            raise RuntimeError(
                f"processes see different newest checkpoints {checkpoints}: "
                "the checkpoint directory must be one shared filesystem"
            )
        self._table = table
        best = max(int(v[STEP]) for v in table.values())
        self._best = None if best < 0 else best
        if self._best is None:
            return None
        holders = {p for p, v in table.items() if v[STEP] == best and v[SERVES]}
        if holders == set(table):
            self._source_row = None
            return best
        rows = [r for r, procs in enumerate(data_rows_of(self.mesh)) if procs <= holders]
        if not rows:
            self.events.emit(
                catalogue.SNAPSHOT_SKIPPED,
                step=best,
                reason=f"no slice's processes all hold step {best} (holders {sorted(holders)})",
            )
            self._best = None
            return None
        self._source_row = rows[0]
        return best

    def unusable_local_steps(self) -> list[int]:
        """This process's own (each process decides from its own local tier)."""
        return self.snapshots.unusable_local_steps()

    def origin(self) -> str:
        """ "local" when the processes sending (or every process loading) read it from the local tier."""
        procs = set(self._table) if self._source_row is None else data_rows_of(self.mesh)[self._source_row]
        return "local" if all(self._table[p][LOCAL] for p in procs) else "snapshot"

    def load(self, abstract_state) -> tuple[Any, dict]:
        if self._source_row is None:
            return self.snapshots.load(abstract_state)
        t0 = time.perf_counter()
        best, source_row = self._best, self._source_row
        senders = data_rows_of(self.mesh)[source_row]
        snap = self.snapshots.latest
        held = snap is not None and snap.step == best and jax.process_index() in senders
        size = max(int(v[BLOB]) for v in self._table.values())
        blob = np.frombuffer(self._data_blob().ljust(size), np.uint8) if held else None
        leaves = jax.tree.leaves({"state": snap.state, "data": blob}) if held else None  # abstract's order

        def provide(number: int, index: tuple):
            return None if leaves is None else block_of(leaves[number], index)

        shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
        abstract = {"state": abstract_state, "data": jax.ShapeDtypeStruct((size,), np.uint8)}
        replicated = NamedSharding(self.mesh, PartitionSpec())
        out = broadcast_from_data_row(
            self.mesh, source_row, provide, abstract, {"state": shardings, "data": replicated}
        )
        state = jax.block_until_ready(out["state"])
        data_state = json.loads(np.asarray(out["data"]).tobytes().decode().strip() or "{}")
        self.events.emit(
            catalogue.SNAPSHOT_SHARED,
            step=best,
            source_processes=sorted(senders),
            origin=self.origin(),
            bytes=int(sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)),
            seconds=round(time.perf_counter() - t0, 4),
        )
        return state, data_state

    def _data_blob(self) -> bytes:
        snap = self.snapshots.latest
        return json.dumps(snap.data_state).encode() if snap is not None else b""
