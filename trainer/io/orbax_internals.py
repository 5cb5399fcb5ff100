"""Every Orbax internal the trainer relies on, in one place to audit on an upgrade.

The checkpointer's guarantees (a fenced commit, a preflight that reads a step before JAX starts, saves
that read one replica) and the heartbeat-watched barriers of a multi-process save need a few things no
public Orbax API offers. Each is wrapped here, with what it assumes; the JAX internals are wrapped in
`trainer/distributed/internals.py`, which also holds the version window both were checked in
(`CHECKED_VERSIONS`, refused outside it at start-up). This module sits in the I/O layer, below both the
checkpointer and the process barriers that use it, and imports Orbax only inside its functions.

Orbax (checked against 0.12.8):
- `orbax.checkpoint._src.multihost.multihost.get_barrier_sync_fn`, looked up at each barrier: replaced
  so that every barrier between processes watches its members' heartbeats.
- `orbax.checkpoint._src.path.atomicity.{AtomicRenameTemporaryPath, CommitFileTemporaryPath}`: the
  commit of a step (rename locally, marker on object stores), subclassed to check the save's fence.
- The on-disk layout of a PyTree item (OCDBT + zarr v2): `_METADATA` (JSON: each leaf's key path) and
  `<param name>/.zarray` (shape, dtype) in the item's OCDBT database, read with tensorstore alone.
  Orbax's own metadata API initialises JAX's backends (its handler asks for the process index), which a
  multi-process job must not do before joining: the preflight reads the layout directly instead.
- The `_array_metadata_store` of the registered `jax.Array` handler: given to the handler that reads one
  replica (trainer/checkpoint/single_replica.py), so that its saves write what the default handler's do.
"""

from __future__ import annotations

import json


def route_orbax_barriers(get_barrier_sync_fn) -> None:
    """Make Orbax take its barrier function from `get_barrier_sync_fn(*, processes=None)`; None restores
    Orbax's own. Orbax looks the function up at every barrier, so this covers the barriers no option
    reaches (the checkpoint manager's constructor, the finalize thread)."""
    from orbax.checkpoint._src.multihost import multihost

    original = getattr(multihost, "_orbax_get_barrier_sync_fn", None)
    if original is None:
        original = multihost._orbax_get_barrier_sync_fn = multihost.get_barrier_sync_fn
    multihost.get_barrier_sync_fn = original if get_barrier_sync_fn is None else get_barrier_sync_fn


def orbax_commit_classes() -> tuple[type, type]:
    """(local atomic-rename commit, object-store commit-marker) TemporaryPath classes of Orbax."""
    from orbax.checkpoint._src.path import atomicity

    return atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath


def _ocdbt_base(item_dir: str) -> dict | str:
    """tensorstore's kvstore spec of an item directory, local or gs://."""
    import os

    if item_dir.startswith("gs://"):
        bucket, _, path = item_dir[len("gs://") :].partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": path.rstrip("/") + "/"}
    return "file://" + os.path.abspath(item_dir).rstrip("/") + "/"


def orbax_stored_arrays(item_dir) -> dict[tuple[tuple[str, int], ...], tuple[tuple[int, ...], str]]:
    """{key path: (global shape, dtype name)} of every array a PyTree item stores, without JAX's backends;
    key path entries are (key, kind) with kind 1 = sequence index, 2 = dict key (Orbax's key types)."""
    import numpy as np
    import tensorstore as ts
    from etils import epath

    item_dir = str(item_dir)
    meta = json.loads((epath.Path(item_dir) / "_METADATA").read_text())
    kv = ts.KvStore.open({"driver": "ocdbt", "base": _ocdbt_base(item_dir)}).result()
    out = {}
    for entry in meta["tree_metadata"].values():
        if entry["value_metadata"].get("value_type") in ("None", "Empty"):
            continue  # an empty node (an optimizer's empty state): no array, not a leaf of the live tree
        keys = tuple((str(k["key"]), int(k["key_type"])) for k in entry["key_metadata"])
        name = ".".join(k for k, _ in keys)
        found = kv.read(f"{name}/.zarray").result()
        if found.state != "value":
            raise FileNotFoundError(f"{item_dir}: no array metadata for {name}")
        zarray = json.loads(bytes(found.value))
        dtype = zarray["dtype"]
        out[keys] = (
            tuple(int(d) for d in zarray["shape"]),
            dtype if dtype == "bfloat16" else np.dtype(dtype).name,
        )
    return out


def orbax_array_metadata_store():
    """The array-metadata store of Orbax's registered `jax.Array` handler (None if it has none)."""
    import jax
    import orbax.checkpoint as ocp

    return getattr(ocp.type_handlers.get_type_handler(jax.Array), "_array_metadata_store", None)
