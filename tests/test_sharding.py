"""The same global batch gives the same loss and gradients on every mesh layout."""

import jax
import numpy as np
import pytest
from helpers import micro_config, replace, synthetic_batch
from jax.sharding import NamedSharding, PartitionSpec

from trainer import model as qwen3
from trainer.config import ConfigError
from trainer.parallel.activations import ActivationSharding
from trainer.parallel.mesh import build_mesh, group_into_slices, resolve_ici
from trainer.parallel.rules import logical_to_spec, tree_shardings
from trainer.program.step import loss_sums

LAYOUTS = {  # name: (devices, ici data, fsdp, tensor)
    "1 device": (1, 1, 1, 1),
    "data=2": (2, 2, 1, 1),
    "fsdp=4": (4, 1, 4, 1),
    "fsdp=2 x tensor=2": (4, 1, 2, 2),
}


def _loss_and_grads(cfg, devices):
    mesh = build_mesh(cfg.mesh, [devices])
    rules = cfg.mesh.logical_axis_rules
    params = qwen3.init_params(cfg.model, jax.random.key(0))
    shardings = tree_shardings(qwen3.param_logical_axes(cfg.model), qwen3.abstract_params(cfg.model), mesh, rules)
    params = jax.device_put(params, shardings)
    batch_sh = NamedSharding(mesh, logical_to_spec(("activation_batch", None), (8, 16), mesh, rules))
    batch = {k: jax.device_put(v, batch_sh) for k, v in synthetic_batch(cfg, rows=8).items()}

    def objective(p, b):
        total, parts = loss_sums(p, cfg.model, 0.0, b, shard=ActivationSharding(mesh, rules))
        return total / parts["tokens"]

    loss, grads = jax.jit(jax.value_and_grad(objective))(params, batch)
    return float(loss), jax.device_get(grads), params, batch


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_same_batch_same_loss_and_gradients_on_every_mesh(layout):
    n, data, fsdp, tensor = LAYOUTS[layout]
    base = micro_config()
    ref_loss, ref_grads, _, _ = _loss_and_grads(base, jax.devices()[:1])
    cfg = replace(
        base, "mesh", ici_data_parallelism=data, ici_fsdp_parallelism=fsdp, ici_tensor_parallelism=tensor
    )
    loss, grads, params, batch = _loss_and_grads(cfg, jax.devices()[:n])
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    # The layout is real: the batch is split over data/fsdp, some parameter over fsdp/tensor.

    def split(x):
        return not x.sharding.is_fully_replicated

    assert split(batch["inputs"]) == (data * fsdp > 1)
    assert any(split(x) for x in jax.tree.leaves(params)) == (fsdp * tensor > 1)


def test_logical_rules_skip_axes_that_do_not_divide_the_dim():
    cfg = micro_config("ici_fsdp_parallelism=1", "ici_tensor_parallelism=4")
    mesh = build_mesh(cfg.mesh, [jax.devices()[:4]])
    rules = cfg.mesh.logical_axis_rules
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh, rules) == PartitionSpec(
        None, None, None
    )
    assert logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh, rules) == PartitionSpec(
        None, "tensor", None
    )


def test_inside_a_region_manual_over_data_the_specs_leave_the_data_axis_to_the_shard_map():
    """Per replica (a shard_map manual over `data`), a batch of 2 rows on data=2 x fsdp=2 is split by fsdp
    alone: the data axis is never picked, so the fsdp split still has to divide the replica's rows."""
    cfg = micro_config("num_slices=2")
    mesh = build_mesh(cfg.mesh, group_into_slices(jax.devices()[:4], 2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 1, "expert": 1}
    whole = ActivationSharding(mesh, cfg.mesh.logical_axis_rules)
    inner = whole.within(("data",))
    assert whole.spec(("activation_batch", None), (4, 16)) == PartitionSpec(("data", "fsdp"), None)
    assert inner.spec(("activation_batch", None), (2, 16)) == PartitionSpec("fsdp", None)
    assert inner.shards(("activation_batch",), 2) == 2 and whole.shards(("activation_batch",), 4) == 4
    assert inner.local(PartitionSpec(("data", "fsdp"), None)) == PartitionSpec("fsdp", None)
    assert inner.local(PartitionSpec("data")) == PartitionSpec(None)


def test_unknown_logical_axis_names_the_missing_rule():
    cfg = micro_config()
    mesh = build_mesh(cfg.mesh, [jax.devices()[:1]])
    with pytest.raises(KeyError, match="'bogus' has no entry in logical_axis_rules"):
        logical_to_spec(("bogus",), (4,), mesh, cfg.mesh.logical_axis_rules)


def test_virtual_slices_are_equal_contiguous_groups_and_form_the_outer_data_axis():
    slices = group_into_slices(jax.devices()[:8], 2)
    assert [len(s) for s in slices] == [4, 4]
    cfg = micro_config("num_slices=2", "ici_fsdp_parallelism=2", "ici_data_parallelism=2")
    mesh = build_mesh(cfg.mesh, slices)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "context": 1, "tensor": 1, "expert": 1}
    first_rows = {d.id for d in mesh.devices[:2].flat}
    assert first_rows == {d.id for d in slices[0]}


def test_mesh_that_does_not_match_the_devices_is_a_config_error():
    cfg = micro_config("ici_fsdp_parallelism=3")
    with pytest.raises(ConfigError, match="multiplies to 3, but each slice has 4 devices"):
        resolve_ici(cfg.mesh, 4)
    with pytest.raises(ConfigError, match="num_slices=3 does not divide the 8 devices"):
        group_into_slices(jax.devices()[:8], 3)
