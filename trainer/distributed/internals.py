"""Every JAX, XLA and Orbax internal the trainer relies on, in one place to audit on an upgrade.

Elastic multi-process training on CPU/GPU and the checkpointer's guarantees need a few things no public
API offers. Each is wrapped here, with what it assumes; nothing else in trainer/ touches a private
module (`tests/test_layering.py` checks that `_src` appears nowhere else).

JAX (checked against 0.10 and 0.12):
- `jax._src.distributed.global_state.client`: the coordination-service client (key-value store,
  GetAliveTasks), for membership rounds, barriers, the agreed stop step and fatal errors.
- `jax._src.xla_bridge.backends_are_initialized`: joining a job must precede any backend.
- `jax.experimental.multihost_utils.live_devices.devices`: the previous round's {device: incarnation},
  which `live_devices` compares against; read to learn the newest round, reset when the CPU client is
  renewed (its device objects are new), and set to the survivors' round after a formation.
- XLA's gloo key names in the coordination service (`cpu:gloo/...` rendezvous keys, the
  `cpu:global_topology` key process 0 publishes): deleted so that renewed communicators meet afresh.

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

GLOO_RENDEZVOUS_DIR = "cpu:gloo"  # gloo's rendezvous keys: cpu:gloo/<device ids>/<rank>
CPU_TOPOLOGY_KEY = "cpu:global_topology"  # published by process 0 when its CPU client is created


def coordination_client():
    """The coordination-service client of this process (None before `jax.distributed.initialize`)."""
    from jax._src import distributed

    return distributed.global_state.client


def backends_initialized() -> bool:
    """Whether JAX has created its backends (after which XLA_FLAGS and distributed settings are fixed)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def newest_round() -> dict[int, int]:
    """What `live_devices` saw last: {process index: incarnation}."""
    from jax.experimental.multihost_utils import live_devices

    return {d.process_index: int(i) for d, i in (live_devices.devices or {}).items()}


def no_round_yet() -> bool:
    from jax.experimental.multihost_utils import live_devices

    return live_devices.devices is None


def set_round(devices: dict) -> None:
    """Make `live_devices` compare its next round with `devices` ({device: incarnation}; None: none)."""
    from jax.experimental.multihost_utils import live_devices

    live_devices.devices = devices


def renew_cpu_client() -> list:
    """Drop this process's CPU client (communicators, compiled executables) and create a new one; returns
    the new devices. `live_devices`' memory of the old device objects is dropped with it."""
    import jax
    from jax.extend import backend

    jax.clear_caches()
    backend.clear_backends()
    set_round(None)
    return jax.devices()


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
