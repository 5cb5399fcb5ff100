"""The Qwen3 model: the facade's shapes and dtypes, layout/remat equivalences, attention masking, GQA,
MoE routing against a dense reference, and float32 RMSNorm. Tiny shapes throughout (fast on 2 cores)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer import model as qwen3
from trainer.config.schema import ModelConfig
from trainer.model.layers import grouped_attention, rms_norm
from trainer.model.moe import MoeMlp, _dispatch_plan, expert_capacity

TINY = ModelConfig(
    base_num_decoder_layers=2,
    base_emb_dim=32,
    base_num_query_heads=4,
    base_num_kv_heads=2,
    head_dim=16,
    base_mlp_dim=64,
    vocab_size=97,
    rope_max_timescale=10_000.0,
    dtype="float32",
    weight_dtype="float32",
    scan_layers=True,
    remat_policy="none",
)
TINY_MOE = dataclasses.replace(
    TINY,
    num_experts=4,
    num_experts_per_tok=2,
    base_moe_mlp_dim=24,
    load_balance_loss_weight=0.01,
    remat_policy="full",
)
B, T = 2, 12


def _inputs(vocab: int, b: int = B, t: int = T, seed: int = 0):
    tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, vocab, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return tokens, positions, jnp.ones((b, t), jnp.int32)


def _init(cfg: ModelConfig, seed: int = 0):
    return jax.jit(partial(qwen3.init_params, cfg))(jax.random.key(seed))


@partial(jax.jit, static_argnums=1)
def _hidden(params, cfg, tokens, positions, segment_ids):
    return qwen3.forward(params, cfg, tokens, positions, segment_ids)[0]


@pytest.fixture(scope="module")
def tiny_params():
    return _init(TINY)


def _unstack_layers(params):
    """Scanned layout (leading layer dim) -> python-loop layout (layers/"0", layers/"1", ...)."""
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return {**params, "layers": {str(i): jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)}}


# --- the facade --------------------------------------------------------------------------------------


def test_forward_gives_hidden_in_activation_dtype_aux_zero_and_float32_logits():
    cfg = dataclasses.replace(TINY, dtype="bfloat16", weight_dtype="float32")
    params = _init(cfg)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tokens, positions, segments = _inputs(cfg.vocab_size)
    hidden, aux = jax.jit(partial(qwen3.forward, cfg=cfg))(
        params, inputs=tokens, positions=positions, segment_ids=segments
    )
    assert hidden.shape == (B, T, cfg.base_emb_dim) and hidden.dtype == jnp.bfloat16
    assert aux.shape == () and aux.dtype == jnp.float32 and float(aux) == 0.0
    logits = qwen3.logits_from_hidden(params, cfg, hidden[0, :5])
    assert logits.shape == (5, cfg.vocab_size) and logits.dtype == jnp.float32


def test_params_follow_weight_dtype():
    cfg = dataclasses.replace(TINY, weight_dtype="bfloat16")
    params = jax.eval_shape(partial(qwen3.init_params, cfg), jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "cfg",
    [TINY, dataclasses.replace(TINY, scan_layers=False, logits_via_embedding=False), TINY_MOE],
    ids=["scan-tied", "loop-untied", "moe"],
)
def test_abstract_params_and_logical_axes_describe_init_params_exactly(cfg):
    params = jax.eval_shape(partial(qwen3.init_params, cfg), jax.random.key(0))
    abstract = qwen3.abstract_params(cfg)
    axes = qwen3.param_logical_axes(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract)):
        assert (p.shape, p.dtype) == (a.shape, a.dtype)
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert len(names) == len(jax.tree.leaves(params))
    for p, n in zip(jax.tree.leaves(params), names):
        assert len(n) == p.ndim
    assert all(isinstance(k, str) for k in params["layers"])


def test_logical_axes_name_stacked_layers_and_experts():
    axes = qwen3.param_logical_axes(TINY_MOE)
    assert axes["embed_tokens"] == ("vocab", "embed")
    assert axes["layers"]["self_attn"]["q_proj"] == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["self_attn"]["k_proj"] == ("layers", "embed", "kv_heads", "head_dim")
    assert axes["layers"]["self_attn"]["o_proj"] == ("layers", "heads", "head_dim", "embed")
    assert axes["layers"]["mlp"]["router"] == ("layers", "embed", None)
    assert axes["layers"]["mlp"]["gate_proj"] == ("layers", "exp", "embed", "mlp")
    assert axes["layers"]["mlp"]["down_proj"] == ("layers", "exp", "mlp", "embed")
    untied = dataclasses.replace(TINY, logits_via_embedding=False, scan_layers=False)
    assert qwen3.param_logical_axes(untied)["lm_head"] == ("embed", "vocab")
    assert qwen3.param_logical_axes(untied)["layers"]["0"]["input_layernorm"] == ("norm",)


# --- numerics against an independent NumPy Qwen3 (HF semantics) ----------------------------------------


def _reference_hidden(params, cfg: ModelConfig, tokens, positions, segment_ids):
    """Straight-line float64 NumPy Qwen3 decoder, written from the HF modelling code's description."""
    eps, hd, nh, nkv = (
        cfg.normalization_layer_epsilon,
        cfg.head_dim,
        cfg.base_num_query_heads,
        cfg.base_num_kv_heads,
    )
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    def rope(x, pos):  # x [T, H, hd]
        inv = 1.0 / cfg.rope_max_timescale ** (np.arange(0, hd, 2) / hd)
        ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]
        rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    out = []
    for row, pos, seg in zip(np.asarray(tokens), np.asarray(positions, np.float64), np.asarray(segment_ids)):
        x = p["embed_tokens"][row]
        t = len(row)
        allowed = (np.arange(t)[:, None] >= np.arange(t)[None, :]) & (seg[:, None] == seg[None, :])
        for i in range(cfg.base_num_decoder_layers):
            lp = jax.tree.map(lambda a, i=i: a[i], p["layers"])
            a = lp["self_attn"]
            h = norm(x, lp["input_layernorm"])
            q = rope(norm(np.einsum("td,dnh->tnh", h, a["q_proj"]), a["q_norm"]), pos)
            k = rope(norm(np.einsum("td,dkh->tkh", h, a["k_proj"]), a["k_norm"]), pos)
            v = np.einsum("td,dkh->tkh", h, a["v_proj"])
            heads = []
            for n in range(nh):
                kv = n // (nh // nkv)
                s = np.where(allowed, q[:, n] @ k[:, kv].T / np.sqrt(hd), -np.inf)
                w = np.exp(s - s.max(-1, keepdims=True))
                heads.append((w / w.sum(-1, keepdims=True)) @ v[:, kv])
            x = x + np.einsum("tnh,nhd->td", np.stack(heads, 1), a["o_proj"])
            h = norm(x, lp["post_attention_layernorm"])
            m = lp["mlp"]
            g = h @ m["gate_proj"]
            x = x + (g / (1 + np.exp(-g)) * (h @ m["up_proj"])) @ m["down_proj"]
        out.append(norm(x, p["norm"]))
    return np.stack(out)


def test_forward_matches_an_independent_numpy_qwen3_with_packed_segments(tiny_params):
    tokens, positions, _ = _inputs(TINY.vocab_size)
    segments = jnp.array([[1] * 5 + [2] * 7, [1] * 12], jnp.int32)
    positions = jnp.array([list(range(5)) + list(range(7)), list(range(12))], jnp.int32)
    hidden = _hidden(tiny_params, TINY, tokens, positions, segments)
    expected = _reference_hidden(tiny_params, TINY, tokens, positions, segments)
    np.testing.assert_allclose(np.asarray(hidden), expected, rtol=2e-4, atol=2e-4)


# --- equivalences --------------------------------------------------------------------------------------


def test_scan_and_python_loop_layouts_give_the_same_logits(tiny_params):
    loop_cfg = dataclasses.replace(TINY, scan_layers=False)
    tokens, positions, segments = _inputs(TINY.vocab_size)
    scanned = qwen3.logits_from_hidden(tiny_params, TINY, _hidden(tiny_params, TINY, tokens, positions, segments))
    loop_params = _unstack_layers(tiny_params)
    assert jax.tree.structure(loop_params) == jax.tree.structure(qwen3.abstract_params(loop_cfg))
    looped = qwen3.logits_from_hidden(
        loop_params, loop_cfg, _hidden(loop_params, loop_cfg, tokens, positions, segments)
    )
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(looped), rtol=1e-5, atol=1e-5)


def test_remat_policies_give_the_same_gradients(tiny_params):
    tokens, positions, segments = _inputs(TINY.vocab_size)

    def grads(policy):
        cfg = dataclasses.replace(TINY, remat_policy=policy)

        def loss(p):
            hidden, aux = qwen3.forward(p, cfg, tokens, positions, segments)
            logits = qwen3.logits_from_hidden(p, cfg, hidden)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]) + aux

        return jax.jit(jax.grad(loss))(tiny_params)

    reference = grads("none")
    for policy in ("full", "minimal"):
        for a, b in zip(jax.tree.leaves(grads(policy)), jax.tree.leaves(reference)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


# --- attention masking ---------------------------------------------------------------------------------


def test_second_packed_document_equals_the_same_document_alone(tiny_params):
    tokens, _, _ = _inputs(TINY.vocab_size, b=1)
    packed_positions = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0]], jnp.int32)
    packed_segments = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0]], jnp.int32)
    packed = _hidden(tiny_params, TINY, tokens, packed_positions, packed_segments)
    alone_tokens = jnp.concatenate([tokens[:, 5:11], jnp.zeros((1, 6), jnp.int32)], axis=1)
    alone_positions = jnp.array([[0, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0]], jnp.int32)
    alone_segments = jnp.array([[1] * 6 + [0] * 6], jnp.int32)
    alone = _hidden(tiny_params, TINY, alone_tokens, alone_positions, alone_segments)
    np.testing.assert_allclose(np.asarray(packed[0, 5:11]), np.asarray(alone[0, :6]), rtol=1e-5, atol=1e-5)


def test_changing_a_future_token_leaves_earlier_outputs_unchanged(tiny_params):
    tokens, positions, segments = _inputs(TINY.vocab_size)
    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % TINY.vocab_size)
    before = np.asarray(_hidden(tiny_params, TINY, tokens, positions, segments))
    after = np.asarray(_hidden(tiny_params, TINY, changed, positions, segments))
    np.testing.assert_array_equal(before[:, :7], after[:, :7])
    assert np.abs(before[:, 7:] - after[:, 7:]).max() > 1e-3


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_matches_per_head_attention_with_repeated_kv(kv_heads):
    heads, hd = 4, 8
    kq, kk, kvv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (B, T, heads, hd))
    k = jax.random.normal(kk, (B, T, kv_heads, hd))
    v = jax.random.normal(kvv, (B, T, kv_heads, hd))
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None, None]
    out = jax.jit(grouped_attention, static_argnums=4)(q, k, v, mask, kv_heads)
    rep = heads // kv_heads
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    k_full, v_full = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)  # head n uses kv head n // rep
    scores = np.einsum("btnh,bsnh->bnts", q, k_full) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bnts,bsnh->btnh", weights / weights.sum(-1, keepdims=True), v_full)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_model_with_a_single_kv_head_runs_and_has_one_kv_head_of_params():
    cfg = dataclasses.replace(TINY, base_num_kv_heads=1)
    params = _init(cfg)
    assert params["layers"]["self_attn"]["k_proj"].shape == (2, 32, 1, 16)
    hidden = _hidden(params, cfg, *_inputs(cfg.vocab_size))
    assert bool(jnp.all(jnp.isfinite(hidden)))


# --- MoE -----------------------------------------------------------------------------------------------


def test_moe_forward_and_backward_run_with_a_finite_positive_aux_loss():
    params = _init(TINY_MOE)
    tokens, positions, segments = _inputs(TINY_MOE.vocab_size)

    def loss(p):
        hidden, aux = qwen3.forward(p, TINY_MOE, tokens, positions, segments)
        return jnp.mean(qwen3.logits_from_hidden(p, TINY_MOE, hidden) ** 2) + aux, aux

    (_, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert np.isfinite(float(aux)) and float(aux) > 0
    # balance loss is ~top_k for near-uniform routing, averaged over layers, times the weight
    assert float(aux) == pytest.approx(TINY_MOE.load_balance_loss_weight * TINY_MOE.num_experts_per_tok, rel=0.5)
    router_grad = grads["layers"]["mlp"]["router"]
    assert bool(jnp.all(jnp.isfinite(router_grad))) and float(jnp.abs(router_grad).max()) > 0
    assert float(jnp.abs(grads["layers"]["mlp"]["gate_proj"]).max()) > 0


def _dense_moe_reference(moe: MoeMlp, x, norm_topk_prob: bool):
    """Every expert on every token, combined with the top-k router weights (test-only, O(E) compute)."""
    router, wg, wu, wd = (
        np.asarray(p[...], np.float64) for p in (moe.router, moe.gate_proj, moe.up_proj, moe.down_proj)
    )
    x = np.asarray(x, np.float64)
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    gate, up = np.einsum("btd,edf->btef", x, wg), np.einsum("btd,edf->btef", x, wu)
    every = np.einsum("btef,efd->bted", gate / (1 + np.exp(-gate)) * up, wd)
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            top = np.argsort(-probs[b, t])[: moe.top_k]
            w = probs[b, t, top] / (probs[b, t, top].sum() if norm_topk_prob else 1.0)
            out[b, t] = np.einsum("k,kd->d", w, every[b, t, top])
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_dispatch_matches_dense_top_k_reference_when_nothing_drops(norm_topk_prob):
    experts, top_k = 4, 2
    moe = MoeMlp(
        emb_dim=16,
        moe_mlp_dim=8,
        num_experts=experts,
        top_k=top_k,
        norm_topk_prob=norm_topk_prob,
        capacity_factor=experts / top_k,
        dtype="float32",
        weight_dtype="float32",
        rngs=nnx.Rngs(5),
    )
    moe.router[...] = moe.router[...] * 50  # sharp routing, so the top-k choice is unambiguous
    x = jax.random.normal(jax.random.key(6), (2, 6, 16))
    out, _ = nnx.jit(lambda m, x: m(x, jnp.ones((2, 6), bool)))(moe, x)
    np.testing.assert_allclose(np.asarray(out), _dense_moe_reference(moe, x, norm_topk_prob), rtol=1e-4, atol=1e-6)


def test_expert_overflow_drops_lower_choices_and_later_tokens_first_and_padding_takes_no_slot():
    # 4 tokens, top-2 over 2 experts, capacity 2. Token 3 is padding.
    experts = jnp.array([[0, 1], [0, 1], [1, 0], [0, 1]], jnp.int32)
    valid = jnp.array([True, True, True, False])
    slot, slot_token, counts = _dispatch_plan(experts, valid, 2, 2)
    dropped = 2 * 2
    # slot-major order: (t0,e0) (t1,e0) (t2,e1) (t3 pad) | (t0,e1) (t1,e1) (t2,e0) (t3 pad)
    assert slot.tolist() == [0, 1, 2, dropped, 3, dropped, dropped, dropped]
    assert slot_token.tolist() == [0, 1, 2, 0]  # expert 0: tokens 0, 1; expert 1: tokens 2, 0
    assert counts.tolist() == [3, 3]  # routed assignments before dropping, padding excluded
    assert expert_capacity(tokens_per_group=4, num_experts=2, top_k=2, capacity_factor=0.5) == 2
    assert expert_capacity(tokens_per_group=4, num_experts=2, top_k=2, capacity_factor=10.0) == 4


# --- RMSNorm -------------------------------------------------------------------------------------------


def test_rms_norm_of_bfloat16_activations_is_computed_in_float32():
    x = (jax.random.normal(jax.random.key(7), (4, 256)) * 30 + 5).astype(jnp.bfloat16)
    weight = jnp.linspace(0.5, 1.5, 256, dtype=jnp.float32)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == jnp.bfloat16
    x32 = np.asarray(x, np.float32)
    normed = (x32 / np.sqrt(np.mean(x32**2, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
    expected = normed * np.asarray(weight).astype(jnp.bfloat16)  # HF order: cast back, then scale
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    bf16_stats = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * weight.astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(bf16_stats, np.float32), np.asarray(out, np.float32))
