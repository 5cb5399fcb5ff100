"""The train step: accumulation equals a bigger batch, determinism, loss masking, LR schedule."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fresh_state_on_one_device, micro_config, synthetic_batch

from trainer import model as qwen3
from trainer.aot import hlo
from trainer.parallel.activations import UNSHARDED
from trainer.program.layout import BatchLayout, batch_layout
from trainer.program.optim import learning_rate_schedule
from trainer.program.step import LOSS_CHUNK_TOKENS, make_train_step, output_params, token_losses

_STEPS: dict = {}  # (config, micro_steps) -> jitted step: tests of one config share its compiles


def _one_step(cfg, micro_steps, batch):
    opt, state = fresh_state_on_one_device(cfg)
    key = (repr(cfg), micro_steps)
    if key not in _STEPS:
        _STEPS[key] = jax.jit(
            make_train_step(cfg.model, opt, z_loss_multiplier=cfg.optim.z_loss_multiplier, micro_steps=micro_steps)
        )
    return jax.device_get(_STEPS[key](state, batch))


def test_k_micro_steps_equal_one_k_times_larger_batch():
    cfg = micro_config()
    batch = synthetic_batch(cfg, rows=8)
    big, m_big = _one_step(cfg, 1, batch)
    acc, m_acc = _one_step(cfg, 4, batch)
    assert float(m_acc["loss"]) == pytest.approx(float(m_big["loss"]), rel=1e-6)
    assert float(m_acc["grad_norm"]) == pytest.approx(float(m_big["grad_norm"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(acc["params"]), jax.tree.leaves(big["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_train_step_is_deterministic_for_a_seed():
    cfg = micro_config()
    batch = synthetic_batch(cfg, rows=4)
    a, _ = _one_step(cfg, 1, batch)
    b, _ = _one_step(cfg, 1, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_masked_tokens_do_not_contribute_to_the_loss():
    cfg = micro_config()
    batch = synthetic_batch(cfg, rows=2)
    changed = {k: v.copy() for k, v in batch.items()}
    masked = batch["loss_mask"] == 0
    changed["targets"][masked] = (changed["targets"][masked] + 7) % cfg.model.vocab_size
    _, m1 = _one_step(cfg, 1, batch)
    _, m2 = _one_step(cfg, 1, changed)
    assert float(m1["loss"]) == float(m2["loss"])


def _reference_objective(proj, cfg, hidden, targets, mask, z_loss_multiplier):
    """The objective by plain autodiff: whole-sequence logits, logsumexp, the target's logit gathered."""
    logits = qwen3.logits_from_hidden(proj, cfg, hidden)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((lse - target) * mask) + z_loss_multiplier * jnp.sum(jnp.square(lse) * mask)


@pytest.mark.parametrize("fsdp", [1, 2])  # 2: the vocabulary split over two devices (the masked-sum path)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_tokens", [LOSS_CHUNK_TOKENS, 24])  # 24: 64 tokens -> 4 chunks of 4 x 4
def test_the_loss_and_its_gradient_equal_plain_autodiff(monkeypatch, tied, chunk_tokens, fsdp):
    """The loss computes its gradient in the forward pass, chunk by chunk (custom VJP): value and
    gradients (projection, hidden states) equal autodiff of the whole-sequence loss, masked, with z-loss,
    with the whole vocabulary on the device and with it split."""
    from trainer.parallel.activations import ActivationSharding

    run = micro_config(f"logits_via_embedding={str(tied).lower()}")
    cfg = run.model
    monkeypatch.setattr("trainer.program.step.LOSS_CHUNK_TOKENS", chunk_tokens)
    shard = UNSHARDED if fsdp == 1 else ActivationSharding(_mesh(1, fsdp), run.mesh.logical_axis_rules)
    proj = output_params(qwen3.init_params(cfg, jax.random.key(1)), cfg, UNSHARDED)
    hidden = jax.random.normal(jax.random.key(2), (4, 16, cfg.base_emb_dim))
    targets = jax.random.randint(jax.random.key(3), (4, 16), 0, cfg.vocab_size)
    mask = (jax.random.uniform(jax.random.key(4), (4, 16)) > 0.3).astype(jnp.float32)

    def ours(p, h):
        objective, ce, z = token_losses(p, cfg, h, targets, mask, z_loss_multiplier=1e-2, shard=shard)
        return objective, (ce, z)

    (value, (ce, z)), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(proj, hidden)
    want, want_grads = jax.value_and_grad(_reference_objective, argnums=(0, 2))(
        proj, cfg, hidden, targets, mask, 1e-2
    )
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(ce + 1e-2 * z), float(want), rtol=1e-5)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-6)


def test_the_step_computes_each_chunks_logits_once():
    """Three vocabulary-wide matmuls per step (logits, their pull-back to the hidden states and to the
    projection), none computed again in the backward pass, and no [tokens, V] array kept for it."""
    cfg = micro_config("vocab_size=384")
    texts: list[str] = []
    _replicated_step(cfg, 1, synthetic_batch(cfg, rows=8), texts, data=1, fsdp=1)
    vocab = cfg.model.vocab_size
    dots = [line for line in texts[0].splitlines() if "dot_general" in line and f"{vocab}x" in line]
    assert len(dots) == 3, dots


def test_learning_rate_warms_up_then_decays_to_the_final_fraction():
    cfg = micro_config(
        "learning_rate=1e-3", "warmup_steps_fraction=0.1", "steps=100", "cosine_learning_rate_final_fraction=0.1"
    )
    lr = learning_rate_schedule(cfg.optim, steps=cfg.train.steps)
    assert float(lr(0)) == 0.0
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(100)) == pytest.approx(1e-4)
    assert float(lr(55)) < float(lr(20))


def test_norm_scales_are_not_weight_decayed():
    from trainer.program.optim import weight_decay_mask

    mask = weight_decay_mask({"w": ("embed", "mlp"), "scale": ("layers", "norm")})
    assert mask == {"w": True, "scale": False}


def test_keep_global_uses_more_micro_steps_on_fewer_slices_and_scale_shrinks_batch_and_lr():
    cfg = micro_config("num_slices=3", "per_device_batch_size=2")

    def plan(policy="keep_global", **slices):
        return batch_layout(
            per_device_batch_size=cfg.data.per_device_batch_size,
            accumulation_steps=cfg.optim.gradient_accumulation_steps,
            num_slices=cfg.mesh.num_slices,
            policy=policy,
            **slices,
        )

    full = plan(devices_per_slice=1, active_slices=3, batch_shards=3)
    kept = plan(devices_per_slice=1, active_slices=2, batch_shards=2)
    assert full == BatchLayout(6, 1, 1.0) and kept.global_batch_size == 6 and kept.lr_scale == 1.0
    scaled = plan("scale", devices_per_slice=1, active_slices=2, batch_shards=2)
    assert scaled.global_batch_size == 4 and scaled.lr_scale == pytest.approx(2 / 3)
    odd = plan(devices_per_slice=4, active_slices=1, batch_shards=4)
    assert odd.global_batch_size == 24 and odd.rows_per_micro % 4 == 0


def _mesh(data: int, fsdp: int):
    from jax.sharding import Mesh

    return Mesh(
        np.array(jax.devices()[: data * fsdp]).reshape(data, fsdp, 1, 1), ("data", "fsdp", "tensor", "expert")
    )


def _replicated_step(cfg, micro_steps, batch, compiled_text: list | None = None, *, data: int = 2, fsdp: int = 2):
    """One step on a data=2 x fsdp=2 mesh: gradients per replica in a shard_map over the data axis. The
    lowered and compiled programs' texts are appended to `compiled_text` when given."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.parallel.activations import ActivationSharding

    mesh = _mesh(data, fsdp)
    opt, state = fresh_state_on_one_device(cfg)
    rows = P(("data", "fsdp"))
    step = make_train_step(
        cfg.model,
        opt,
        z_loss_multiplier=cfg.optim.z_loss_multiplier,
        micro_steps=micro_steps,
        batch_spec=rows,
        shard=ActivationSharding(mesh, cfg.mesh.logical_axis_rules),
        data_reduce_dtype="float32",
    )
    placed = jax.device_put(batch, NamedSharding(mesh, rows))
    lowered = jax.jit(step).lower(jax.device_put(state, NamedSharding(mesh, P())), placed)
    compiled = lowered.compile()
    if compiled_text is not None:
        compiled_text += [lowered.as_text(), compiled.as_text()]
    return jax.device_get(compiled(jax.device_put(state, NamedSharding(mesh, P())), placed))


@pytest.mark.parametrize("micro_steps", [1, 2])
def test_gradients_summed_across_the_data_axis_equal_the_one_device_step(micro_steps):
    """Each replica's gradients and loss sums, combined across the data axis once per step, give the step
    one device takes on the whole batch."""
    cfg = micro_config("z_loss_multiplier=1e-4")
    batch = synthetic_batch(cfg, rows=8)
    one, m_one = _one_step(cfg, micro_steps, batch)
    texts: list[str] = []
    four, m_four = _replicated_step(cfg, micro_steps, batch, texts)
    lowered, compiled = texts
    # The replicas are a region manual over `data`, and all that crosses the data axis (device groups
    # {0,2} and {1,3} of the 2 x 2 mesh) is the all-reduce of the sums.
    assert 'manual_axes={"data"}' in lowered
    across = [line for line in compiled.splitlines() if hlo.replica_groups(line) == [[0, 2], [1, 3]]]
    assert across and all(re.search(r"\ball-reduce(-start)?\(", line) for line in across), across
    for key in ("loss", "z_loss", "grad_norm", "tokens"):
        assert float(m_four[key]) == pytest.approx(float(m_one[key]), rel=1e-5), key
    for a, b in zip(jax.tree.leaves(four["params"]), jax.tree.leaves(one["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_moe_balance_loss_is_the_mean_over_data_parallel_replicas():
    """Like micro-steps, each replica balances its own tokens: the aux loss is the replicas' mean."""
    cfg = micro_config(
        "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "load_balance_loss_weight=0.01"
    )
    batch = synthetic_batch(cfg, rows=8)
    halves = [_one_step(cfg, 1, {k: v[i : i + 4] for k, v in batch.items()})[1]["aux_loss"] for i in (0, 4)]
    _, m_four = _replicated_step(cfg, 1, batch)
    assert float(m_four["aux_loss"]) == pytest.approx(float(np.mean(halves)), rel=1e-5)


def test_the_loss_splits_the_vocabulary_over_the_axes_it_divides_and_the_rows_over_the_rest():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from trainer.parallel.activations import ActivationSharding
    from trainer.program.step import _logits_layout, _rows_per_device

    rules = micro_config().mesh.logical_axis_rules
    axes = ("data", "fsdp", "tensor", "expert")

    def layout(data, fsdp, tensor, vocab, manual=()):
        mesh = Mesh(np.array(jax.devices()[: data * fsdp * tensor]).reshape(data, fsdp, tensor, 1), axes)
        shard = ActivationSharding(mesh, rules).within(manual) if manual else ActivationSharding(mesh, rules)
        return _logits_layout(shard, 8, vocab), _rows_per_device(shard, 8, vocab)

    # fsdp: every device computes all rows' logits for a quarter of the vocabulary: as many logits as
    # two whole-vocabulary rows, which is what row-sharded logits held.
    assert layout(1, 4, 1, 256) == ((P(None, None, None), P(None, None, "fsdp")), 2.0)
    assert layout(2, 2, 2, 256) == ((P("data", None, None), P("data", None, ("tensor", "fsdp"))), 1.0)
    # Inside the per-replica region the data axis is manual: only fsdp is left to split.
    assert layout(2, 2, 1, 256, manual=("data",))[0] == (P(None, None, None), P(None, None, "fsdp"))
    # A vocabulary fsdp does not divide stays whole on each device, its rows split as before.
    assert layout(1, 4, 1, 250) == ((P("fsdp", None, None), P("fsdp", None, None)), 2.0)


def test_the_output_projection_never_crosses_devices():
    """Vocabulary-parallel loss over fsdp: no collective carries an array with a dimension of the
    vocabulary (whole or split), neither the tied embedding nor its gradient nor [tokens, V] logits."""
    cfg = micro_config("vocab_size=384")  # 384 and 96 are no other dimension of the micro model
    texts: list[str] = []
    _replicated_step(cfg, 1, synthetic_batch(cfg, rows=8), texts, data=1, fsdp=4)
    vocab = cfg.model.vocab_size
    moved = [c.shape for c in hlo.collectives(texts[1], devices_per_slice=4, num_slices=1)]
    assert moved, "the step has collectives"
    sizes = {vocab, vocab // 4}
    assert not [s for s in moved if sizes & {int(d) for d in re.findall(r"\d+", s)}], moved
