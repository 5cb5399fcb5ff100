"""The local checkpoint tier on disk: host snapshots written to node-local storage, one directory per step.

A local step is the host copy a snapshot already made (`trainer.elastic.snapshot`), written as raw
bytes by the snapshot's background thread: no serialisation framework, no compression, no
coordination between processes. It survives the process (a kill, an out-of-memory kill, a pod restart
on the same node), not the node. Layout of `<local_checkpoint_directory>/<run name>/` (with several
processes, `process_<i>/` below it: each process writes only what its own devices hold)::

    40/                  a committed step
      state.bin          every leaf of the train state, raw, back to back
      manifest.json      step, leaves (path, dtype, shape, offset), data-iterator state, the run's
                         config
    45.partial-1234/     a write in progress, or left by a killed one: removed on start

A step is committed by renaming its finished `.partial-<pid>` directory, and only once the step's row
is in metrics.jsonl (`recorded`), so a reader never sees half of one and every step restored from has
its record. Only the newest `keep` committed steps stay: the disk use is `keep` copies of the state.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer.checkpoint import base_identity
from trainer.observe import catalogue

log = logging.getLogger(__name__)

MANIFEST, PAYLOAD = "manifest.json", "state.bin"
FORMAT = 1


class LocalStepUnusable(Exception):
    """A committed local step that cannot serve this attempt (unreadable, or another state's shape)."""


def committed_steps(root: Path) -> list[int]:
    """Committed local steps under `root`, oldest first (a missing directory has none)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and (Path(root) / n / MANIFEST).is_file())


def read_manifest(root: Path, step: int) -> dict | None:
    """The manifest of committed local step `step` (None if it cannot be read)."""
    try:
        return json.loads((Path(root) / str(step) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _path_names(tree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class LocalStore:
    """Writes, lists, reads and prunes the local steps of one process (see the module doc).

    `write` runs on the snapshot's background thread; everything else on the main thread."""

    def __init__(
        self, root, *, keep: int, events, config: dict | None = None, recorded=None, lora_base: dict | None = None
    ):
        """`config`: the run's flat config, recorded in every manifest. `recorded`: the run's
        `RecordedSteps`; a step commits only once its metrics row is written (None: at once). `lora_base`:
        a LoRA run's base identity (`trainer.checkpoint.base_identity`), recorded in every manifest."""
        self.root = Path(root)
        self.keep = keep
        self.events = events
        self.config = config or {}
        self.lora_base = lora_base
        self.recorded = recorded
        self._writing = threading.Lock()  # the snapshot thread and a stop's emergency save never overlap

    def cleanup_partial(self) -> list[str]:
        """Remove the writes a killed process left behind; they never count."""
        removed = []
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                if ".partial-" in p.name:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
        if removed:
            self.events.emit(catalogue.LOCAL_CHECKPOINT_PARTIAL_REMOVED, directories=removed)
        return removed

    def steps(self) -> list[int]:
        return committed_steps(self.root)

    def newest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def has_row(self, step: int) -> bool:
        """Whether step `step` may commit now: its metrics row is written (always, with no `recorded`)."""
        return self.recorded is None or self.recorded.has(step)

    def discard_after(self, step: int) -> list[int]:
        """Remove the local steps after `step` (states a rollback to `step` found unverified)."""
        with self._writing:
            dropped = [s for s in self.steps() if s > step]
            for s in dropped:
                shutil.rmtree(self.root / str(s), ignore_errors=True)
        return dropped

    def write(self, step: int, state, data_state: dict, *, started: float | None = None) -> None:
        """Write one host snapshot (numpy pytree) as committed step `step`, then prune old steps."""
        with self._writing:
            self._write(step, state, data_state, started=started)

    def _write(self, step: int, state, data_state: dict, *, started: float | None) -> None:
        t0 = time.perf_counter() if started is None else started
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self.root / f"{step}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        leaves = []
        offset = 0
        with open(partial / PAYLOAD, "wb") as f:
            for name, leaf in zip(_path_names(state), jax.tree.leaves(state)):
                arr = np.asarray(leaf, order="C")  # keeps 0-d leaves 0-d (ascontiguousarray would not)
                arr.reshape(-1).view(np.uint8).tofile(f)  # raw bytes; tofile avoids a copy
                leaves.append({"path": name, "dtype": arr.dtype.name, "shape": list(arr.shape), "offset": offset})
                offset += arr.nbytes
        manifest = {
            "format": FORMAT,
            "step": step,
            "bytes": offset,
            "leaves": leaves,
            "data_state": data_state,
            "config": self.config,
            "time": time.time(),
        }
        if self.lora_base is not None:
            manifest[base_identity.RECORD_KEY] = self.lora_base
        (partial / MANIFEST).write_text(json.dumps(manifest))
        if self.recorded is not None and not self.recorded.wait(step):
            # A step that is restored from must have its record: without it, it is never written.
            shutil.rmtree(partial, ignore_errors=True)
            self.events.emit(
                catalogue.LOCAL_CHECKPOINT_SAVE_FAILED, step=step, error="its metrics row was never written"
            )
            return
        final = self.root / str(step)
        if final.exists():  # the same step trained again (after a restore from an older one)
            shutil.rmtree(final)
        os.rename(partial, final)  # the commit
        removed = self._prune()
        self.events.emit(
            catalogue.LOCAL_CHECKPOINT_SAVE_COMMITTED,
            step=step,
            bytes=offset,
            seconds=round(time.perf_counter() - t0, 4),
            removed=removed,
        )

    def _prune(self) -> list[int]:
        old = self.steps()[: -self.keep]
        for s in old:
            shutil.rmtree(self.root / str(s), ignore_errors=True)
        return old

    def read(self, step: int, abstract_state) -> tuple[Any, dict]:
        """(numpy pytree shaped like `abstract_state`, data-iterator state) of committed step `step`;
        raises LocalStepUnusable when it cannot be read or holds another state's leaves."""
        directory = self.root / str(step)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
            payload = np.fromfile(directory / PAYLOAD, dtype=np.uint8)
        except (OSError, ValueError) as e:
            raise LocalStepUnusable(f"local step {step} is unreadable: {e}") from None
        if payload.size != manifest.get("bytes"):
            raise LocalStepUnusable(
                f"local step {step}: {PAYLOAD} holds {payload.size} bytes, its manifest {manifest.get('bytes')}"
            )
        abstract_leaves, treedef = jax.tree.flatten(abstract_state)
        names = _path_names(abstract_state)
        if [e["path"] for e in manifest["leaves"]] != names:
            raise LocalStepUnusable(f"local step {step} holds another train state (its leaves differ)")
        out = []
        for entry, a in zip(manifest["leaves"], abstract_leaves):
            dtype = jnp.dtype(entry["dtype"])
            if tuple(entry["shape"]) != tuple(a.shape) or dtype != a.dtype:
                raise LocalStepUnusable(
                    f"local step {step}: {entry['path']} is {entry['dtype']}{entry['shape']}, "
                    f"the attempt expects {a.dtype}{list(a.shape)}"
                )
            n = int(np.prod(entry["shape"], dtype=np.int64)) * dtype.itemsize
            out.append(payload[entry["offset"] : entry["offset"] + n].view(dtype).reshape(entry["shape"]))
        return jax.tree.unflatten(treedef, out), manifest["data_state"]
