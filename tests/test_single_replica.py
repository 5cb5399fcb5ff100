"""Restores that read one replica (trainer/checkpoint/single_replica.py): when they apply. The read itself
is proven with real processes: tests/test_multiprocess.py sums what the restarted job's processes read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.checkpoint import single_replica

REPLICATED = P(None, "fsdp")


def _abstract(mesh, spec=REPLICATED, dtype=jnp.float32):
    return {"w": jax.ShapeDtypeStruct((8, 8), dtype, sharding=NamedSharding(mesh, spec))}


def _mesh(data=2, fsdp=2):
    return jax.make_mesh((data, fsdp), ("data", "fsdp"), devices=jax.devices()[: data * fsdp])


def test_row_zero_must_hold_whole_processes():
    # 3 slices of 2 processes: each process's devices in one row.
    assert single_replica.row0_holds_whole_processes(np.array([[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]]))
    # A process with a device in row 0 and one in row 1 would both read and receive: not allowed.
    assert not single_replica.row0_holds_whole_processes(np.array([[0, 0], [0, 1]]))


def test_one_process_restores_as_usual():
    abstract = _abstract(_mesh())
    assert not single_replica.applies(abstract)
    args = single_replica.restore_args(abstract)
    assert type(args["w"]) is ocp.ArrayRestoreArgs


def test_several_processes_read_one_replica_only_of_a_state_replicated_over_data(monkeypatch):
    monkeypatch.setattr(single_replica.jax, "process_count", lambda: 3)
    monkeypatch.setattr(single_replica, "row0_holds_whole_processes", lambda process_of: True)
    mesh = _mesh()
    args = single_replica.restore_args(_abstract(mesh))
    assert isinstance(args["w"], ocp.type_handlers.SingleReplicaArrayRestoreArgs)
    assert args["w"].global_shape == (8, 8) and args["w"].sharding.spec == P(None, "fsdp")
    assert not single_replica.applies(_abstract(mesh, P("data", "fsdp")))  # not a replica per row
    assert not single_replica.applies(_abstract(mesh, dtype=jnp.bool_))  # the broadcast sums
    assert not single_replica.applies(_abstract(_mesh(data=1, fsdp=4)))  # one row: nothing to share


def test_the_registry_saves_and_restores_like_orbaxs_default(tmp_path):
    mesh = _mesh(1, 2)
    state = {"w": jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("fsdp")))}
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=single_replica.type_handler_registry())
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "s", args=ocp.args.PyTreeSave(state))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restored = ckptr.restore(
            tmp_path / "s",
            args=ocp.args.PyTreeRestore(abstract, restore_args=single_replica.restore_args(abstract)),
        )
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(16.0).reshape(4, 4))
    with ocp.PyTreeCheckpointer() as plain:  # what Orbax's default handler reads of it
        np.testing.assert_array_equal(
            np.asarray(plain.restore(tmp_path / "s")["w"]), np.arange(16.0).reshape(4, 4)
        )
