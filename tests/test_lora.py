"""LoRA: the adapter math, the frozen base, an optimizer state of adapters only, the config's refusals.

(The CLI runs: tests/test_lora_cli.py; loading the exports with peft and transformers:
tests/test_lora_interop.py.)"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import micro_config, synthetic_batch

from trainer.config.errors import ConfigError
from trainer.model import abstract_params, init_params, lora
from trainer.parallel.mesh import build_mesh
from trainer.program.optim import learning_rate_schedule, make_optimizer
from trainer.program.state import init_state, state_shardings, trainable_logical_axes
from trainer.program.step import loss_sums, make_train_step


def _cfg(*overrides):
    return micro_config("dtype=float32", "lora_rank=4", "lora_alpha=8", *overrides)


def test_merge_is_w_x_plus_scaled_b_of_a_x_on_every_targeted_projection():
    cfg = _cfg()
    base = init_params(cfg.model, jax.random.key(0))
    adapters = lora.init_adapters(cfg.model, cfg.lora, jax.random.key(1))
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)  # B nonzero
    merged = lora.merge(base, adapters, cfg.model, cfg.lora)
    assert lora.scale(cfg.lora) == 2.0
    x = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    for group, name in [("self_attn", "q_proj"), ("self_attn", "v_proj"), ("mlp", "down_proj")]:
        w = np.asarray(base["layers"][group][name][1])  # layer 1 of the stacked layers
        a = np.asarray(adapters["layers"][group][name]["lora_A"][1])
        b = np.asarray(adapters["layers"][group][name]["lora_B"][1])
        xin = x if name != "down_proj" else np.random.default_rng(1).normal(size=(3, 128)).astype(np.float32)
        flat = lambda m, k: m.reshape(k, -1)  # noqa: E731
        expected = xin @ flat(w, xin.shape[1]) + 2.0 * (xin @ flat(a, xin.shape[1])) @ flat(b, a.shape[-1])
        got = xin @ flat(np.asarray(merged["layers"][group][name][1]), xin.shape[1])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    o = np.asarray(merged["layers"]["self_attn"]["o_proj"])
    o_expected = np.asarray(base["layers"]["self_attn"]["o_proj"]) + 2.0 * np.einsum(
        "lnhr,lrd->lnhd",
        np.asarray(adapters["layers"]["self_attn"]["o_proj"]["lora_A"]),
        np.asarray(adapters["layers"]["self_attn"]["o_proj"]["lora_B"]),
    )
    np.testing.assert_allclose(o, o_expected, rtol=1e-5, atol=1e-6)
    for untouched in ("embed_tokens", "norm"):
        assert merged[untouched] is base[untouched]


def test_fresh_adapters_are_pefts_init_and_leave_the_base_function_unchanged():
    cfg = _cfg()
    base = init_params(cfg.model, jax.random.key(0))
    adapters = lora.init_adapters(cfg.model, cfg.lora, jax.random.key(1))
    q = adapters["layers"]["self_attn"]["q_proj"]
    assert float(jnp.abs(q["lora_A"]).max()) <= 1 / np.sqrt(64) and float(jnp.abs(q["lora_A"]).min()) >= 0
    assert float(jnp.abs(q["lora_A"]).max()) > 0.5 / np.sqrt(64)  # uniform over the whole bound
    o = adapters["layers"]["self_attn"]["o_proj"]["lora_A"]
    assert float(jnp.abs(o).max()) <= 1 / np.sqrt(4 * 16)  # o_proj's fan-in is heads x head_dim
    assert all(float(jnp.abs(p["lora_B"]).max()) == 0 for p in _pairs(adapters))
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(cfg, rows=2).items()}
    plain, _ = loss_sums(base, cfg.model, 0.0, batch)
    with_adapters, _ = loss_sums(lora.merge(base, adapters, cfg.model, cfg.lora), cfg.model, 0.0, batch)
    assert float(plain) == float(with_adapters)


def _pairs(adapters):
    return [leaf for leaf in jax.tree.leaves(adapters, is_leaf=lambda x: isinstance(x, dict) and "lora_A" in x)]


def test_target_modules_choose_the_adapted_projections_and_their_shapes():
    cfg = _cfg("lora_target_modules=[q_proj,down_proj]")
    shapes = jax.tree.map(lambda a: a.shape, lora.abstract_adapters(cfg.model, cfg.lora))
    assert shapes == {
        "layers": {
            "self_attn": {"q_proj": {"lora_A": (2, 64, 4), "lora_B": (2, 4, 4, 16)}},
            "mlp": {"down_proj": {"lora_A": (2, 128, 4), "lora_B": (2, 4, 64)}},
        }
    }
    assert set(lora.target_modules(_cfg("lora_target_modules=[all-linear]").lora)) == set(lora.IN_DIMS)
    unstacked = dataclasses.replace(cfg.model, scan_layers=False)
    leaves = lora.abstract_adapters(unstacked, cfg.lora)["layers"]
    assert sorted(leaves) == ["0", "1"] and leaves["1"]["self_attn"]["q_proj"]["lora_B"].shape == (4, 4, 16)
    axes = lora.adapter_logical_axes(cfg.model, cfg.lora)["layers"]["self_attn"]["q_proj"]
    assert axes == {"lora_A": ("layers", "embed", None), "lora_B": ("layers", None, "heads", "head_dim")}


def _lora_state(cfg):
    mesh = build_mesh(cfg.mesh, [jax.devices()[:1]])
    opt = make_optimizer(
        cfg.optim,
        trainable_logical_axes(cfg.model, cfg.lora),
        schedule=learning_rate_schedule(cfg.optim, steps=cfg.train.steps),
    )
    shardings, abstract = state_shardings(cfg.model, cfg.mesh.logical_axis_rules, mesh, opt, cfg.lora)
    return opt, init_state(cfg.model, opt, shardings, seed=0, lora=cfg.lora), abstract


def test_the_step_trains_the_adapters_only_and_the_optimizer_state_holds_adapters_only():
    cfg = _cfg("learning_rate=1e-2", "warmup_steps_fraction=0")
    opt, state, abstract = _lora_state(cfg)
    adapter_shapes = {a.shape for a in jax.tree.leaves(lora.abstract_adapters(cfg.model, cfg.lora))}
    model_shapes = {a.shape for a in jax.tree.leaves(abstract_params(cfg.model))}
    opt_shapes = {leaf.shape for leaf in jax.tree.leaves(abstract["opt_state"]) if leaf.shape}
    assert opt_shapes == adapter_shapes and not opt_shapes & model_shapes  # no moment of a base weight
    assert jax.tree.structure(state["params"]) == jax.tree.structure(lora.abstract_adapters(cfg.model, cfg.lora))

    base = init_params(cfg.model, jax.random.key(0))
    before = jax.tree.map(np.asarray, base)
    step = jax.jit(make_train_step(cfg.model, opt, z_loss_multiplier=0.0, micro_steps=1, lora=cfg.lora))
    batch = synthetic_batch(cfg, rows=2)
    new, metrics = step(state, batch, base)
    assert bool(metrics["finite"]) and float(metrics["grad_norm"]) > 0
    assert set(new) == {"step", "params", "opt_state"}
    assert jax.tree.structure(new["params"]) == jax.tree.structure(state["params"])
    assert any(float(jnp.abs(p["lora_B"]).max()) > 0 for p in _pairs(new["params"]))  # B moved off zero
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)  # the base is neither donated nor changed

    # The first step's loss is the base model's: fresh adapters change nothing.
    _, parts = loss_sums(base, cfg.model, 0.0, {k: jnp.asarray(v) for k, v in batch.items()})
    assert float(metrics["loss"]) == pytest.approx(float(parts["ce_sum"] / parts["tokens"]), rel=1e-6)


def test_the_adapters_gradient_is_the_projection_of_the_weights_gradient():
    """d loss / d B = scale * A^T (d loss / d W) at the merged weights: the adapters see the base's signal."""
    cfg = _cfg("lora_target_modules=[up_proj]")
    base = init_params(cfg.model, jax.random.key(0))
    adapters = lora.init_adapters(cfg.model, cfg.lora, jax.random.key(1))
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(cfg, rows=2).items()}

    def loss_of_params(p):
        return loss_sums(p, cfg.model, 0.0, batch)[0]

    d_adapters = jax.grad(lambda ad: loss_of_params(lora.merge(base, ad, cfg.model, cfg.lora)))(adapters)
    d_w = jax.grad(loss_of_params)(base)["layers"]["mlp"]["up_proj"]  # B = 0: merged == base
    a = adapters["layers"]["mlp"]["up_proj"]["lora_A"]
    expected = lora.scale(cfg.lora) * jnp.einsum("ldr,ldf->lrf", a, d_w)
    np.testing.assert_allclose(d_adapters["layers"]["mlp"]["up_proj"]["lora_B"], expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lora_dropout=0.1"], "lora_dropout=0.1 is not supported"),
        (["lora_target_modules=[q_proj,qkv]"], "'qkv': not a projection of this model"),
        (["lora_target_modules=[]"], "must be a non-empty list"),
        (["lora_alpha=0"], "lora_alpha=0.0 must be > 0"),
        (["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32"], "of an MoE model"),
        (["load_full_state_path=/x"], "load_full_state_path with lora_rank > 0"),
    ],
)
def test_the_config_refuses_what_lora_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        micro_config("lora_rank=4", *overrides)


def test_lora_keys_are_not_checked_with_lora_off():
    micro_config("lora_rank=0", "lora_dropout=0.1", "lora_target_modules=[qkv]")


def _committed(root, files: dict[str, bytes]):
    from trainer.checkpoint import commit

    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / commit.COMMIT_MARKER).write_text(str(root))  # differs per directory: left out of the hash
    return str(root)


def test_the_base_is_named_by_its_content_and_another_content_is_refused(tmp_path):
    from trainer.checkpoint import base_identity

    files = {"state/a": b"weights", "state/d/b": b"more"}
    one = base_identity.base_record(_committed(tmp_path / "one", files), 0)
    moved = base_identity.base_record(_committed(tmp_path / "moved", files), 0)
    other = base_identity.base_record(_committed(tmp_path / "other", {**files, "state/d/b": b"MORE"}), 0)
    assert one["sha256"] == moved["sha256"] != other["sha256"]
    assert base_identity.difference(one, moved) is None  # the same content elsewhere: the adapters fit it
    assert "trained over base load_parameters_path=" in base_identity.difference(one, other)
    seed0, seed1 = base_identity.base_record("", 0), base_identity.base_record("", 1)
    assert seed0 == {"init_weights_seed": 0} and base_identity.difference(seed0, seed0) is None
    assert "init_weights_seed=0" in base_identity.difference(seed0, seed1)
    assert "init_weights_seed=0" in base_identity.difference(seed0, one)
    assert base_identity.difference(None, one) is None  # not a LoRA step: the structure check's business


class _NoEvents:
    def emit(self, name, **fields):
        pass


def test_a_local_tier_step_records_its_base_and_a_resume_over_another_is_refused(tmp_path):
    from trainer import preflight
    from trainer.checkpoint import compat
    from trainer.checkpoint.local_store import LocalStore

    cfg = _cfg()
    state = {"step": np.int32(3), "params": lora.init_adapters(cfg.model, cfg.lora, jax.random.key(0))}
    store = LocalStore(tmp_path, keep=1, events=_NoEvents(), config={}, lora_base={"init_weights_seed": 0})
    store.write(3, jax.tree.map(np.asarray, state), {"cursor": 3})
    saved = preflight.local_step(tmp_path, 3, None)
    assert saved.lora_base == {"init_weights_seed": 0}
    assert preflight.base_mismatch(cfg, saved) is None
    other = _cfg("init_weights_seed=5")
    with pytest.raises(compat.CheckpointMismatch, match="init_weights_seed=0.*init_weights_seed=5"):
        preflight.check_saved_step(other, dataclasses.replace(saved, state=None))


def test_the_eval_step_and_the_replica_checksums_take_the_adapters_over_the_base():
    from trainer.program.step import make_eval_step, make_replica_checksums

    cfg = _cfg("lora_target_modules=[v_proj]")
    base = init_params(cfg.model, jax.random.key(0))
    adapters = jax.tree.map(lambda a: a + 0.05, lora.init_adapters(cfg.model, cfg.lora, jax.random.key(1)))
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(cfg, rows=2).items()}
    sums = make_eval_step(cfg.model, lora=cfg.lora)(adapters, batch, base)
    _, parts = loss_sums(lora.merge(base, adapters, cfg.model, cfg.lora), cfg.model, 0.0, batch)
    _, plain = loss_sums(base, cfg.model, 0.0, batch)
    assert float(sums["ce_sum"]) == pytest.approx(float(parts["ce_sum"]), rel=1e-6)
    assert float(sums["ce_sum"]) != pytest.approx(float(plain["ce_sum"]), rel=1e-6)  # the adapters count
    rows = make_replica_checksums(cfg.model, z_loss_multiplier=0.0, micro_steps=1, lora=cfg.lora)(
        adapters, batch, base
    )
    assert rows.shape == (1, 3 + 2)  # ce, z, tokens, then one sum per adapter leaf (v_proj's A and B)


@pytest.mark.parametrize("scan", ["true", "false"])
def test_the_per_layer_merge_computes_what_the_whole_merge_computes_and_its_gradient(scan):
    """The step's per-layer merge (`layer_adapter`, inside each block) gives the loss and the adapters'
    gradient of the model run with `merge(base, adapters)`, stacked or unstacked layers alike."""
    cfg = _cfg(f"scan_layers={scan}")
    base = init_params(cfg.model, jax.random.key(0))
    adapters = jax.tree.map(lambda a: a + 0.05, lora.init_adapters(cfg.model, cfg.lora, jax.random.key(1)))
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(cfg, rows=2).items()}

    def per_layer(ad):
        return loss_sums(base, cfg.model, 0.0, batch, layers=lora.layer_adapter(ad, cfg.lora))[0]

    def whole(ad):
        return loss_sums(lora.merge(base, ad, cfg.model, cfg.lora), cfg.model, 0.0, batch)[0]

    (got, d_got), (want, d_want) = jax.value_and_grad(per_layer)(adapters), jax.value_and_grad(whole)(adapters)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for g, w in zip(jax.tree.leaves(d_got), jax.tree.leaves(d_want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_the_lora_step_holds_one_layers_merged_weights_at_a_time():
    """Compiled (CPU), the LoRA train step's temporaries stay under half the targeted weights' bytes: the
    merged weights and their gradients exist per layer inside the rematerialised blocks, never stacked for
    every layer at once (which alone would be twice those bytes: the merged weights and their gradient)."""
    from trainer.program.optim import learning_rate_schedule, make_optimizer
    from trainer.program.state import abstract_train_state

    cfg = _cfg("base_num_decoder_layers=8", "base_emb_dim=128", "base_mlp_dim=512", "remat_policy=full")
    schedule = learning_rate_schedule(cfg.optim, steps=10)
    opt = make_optimizer(cfg.optim, trainable_logical_axes(cfg.model, cfg.lora), schedule=schedule)
    base = abstract_params(cfg.model)
    targeted = sum(
        math.prod(w.shape) * w.dtype.itemsize
        for path, w in jax.tree_util.tree_leaves_with_path(base["layers"])
        if path[-1].key in lora.target_modules(cfg.lora)
    )
    batch = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), synthetic_batch(cfg, rows=1))
    step = make_train_step(cfg.model, opt, z_loss_multiplier=0.0, micro_steps=1, lora=cfg.lora)
    state = abstract_train_state(cfg.model, opt, cfg.lora)
    compiled = jax.jit(step).lower(state, batch, base).compile()
    assert targeted > 0 and compiled.memory_analysis().temp_size_in_bytes < targeted / 2
