"""The decoder every family here shares (Qwen3 dense and MoE, Llama 3) as Flax NNX modules, and its
functional facade (what a family's `decoder` is: `trainer/model/family.py`).

What differs between the families is read from the config: q/k norm (`use_qk_norm`), the RoPE theta and
scaling (`rope_max_timescale`, `rope_scaling`), tied or untied output (`logits_via_embedding`), MoE
(`num_experts`), the RMSNorm epsilon.

Params are a plain nested dict of arrays; structure (scan_layers=true, "[L]" = stacked layer dim):

    embed_tokens                          [V, D]          ("vocab", "embed")
    layers/input_layernorm                [L, D]          ("layers", "norm")
    layers/self_attn/q_proj               [L, D, N, hd]   ("layers", "embed", "heads", "head_dim")
    layers/self_attn/k_proj, v_proj       [L, D, K, hd]   ("layers", "embed", "kv_heads", "head_dim")
    layers/self_attn/o_proj               [L, N, hd, D]   ("layers", "heads", "head_dim", "embed")
    layers/self_attn/q_norm, k_norm       [L, hd]         ("layers", "norm")         (use_qk_norm)
    layers/post_attention_layernorm       [L, D]
    layers/mlp/gate_proj, up_proj         [L, D, F]       ("layers", "embed", "mlp")  (dense)
    layers/mlp/down_proj                  [L, F, D]       ("layers", "mlp", "embed")
    layers/mlp/router                     [L, D, E]       ("layers", "embed", None)  (MoE)
    layers/mlp/gate_proj, up_proj         [L, E, D, Fm]   ("layers", "exp", "embed", "mlp")
    layers/mlp/down_proj                  [L, E, Fm, D]   ("layers", "exp", "mlp", "embed")
    norm                                  [D]             ("norm",)
    lm_head                               [D, V]          ("embed", "vocab")         (untied only)

With scan_layers=false the same leaves sit under layers/"0", layers/"1", ... without the L dim.

Hugging Face mapping (safetensors name -> ours; W is the torch [out, in] matrix; `hf_tensors.py`): our path
with "/" -> "." is the HF name minus "model." and ".weight", layer i being layers.{i} (or index i of the L
dim):
    model.embed_tokens.weight [V, D]            -> embed_tokens                      (as is)
    self_attn.q_proj.weight   [N*hd, D]         -> q_proj = W.T.reshape(D, N, hd)
    self_attn.k_proj/v_proj   [K*hd, D]         -> W.T.reshape(D, K, hd)
    self_attn.o_proj.weight   [D, N*hd]         -> o_proj = W.T.reshape(N, hd, D)
    self_attn.q_norm/k_norm, *_layernorm, model.norm  -> as is
    mlp.gate_proj/up_proj     [F, D]            -> W.T;   mlp.down_proj [D, F] -> W.T
    mlp.gate.weight           [E, D]            -> mlp/router = W.T
    mlp.experts.{e}.gate_proj/up_proj [Fm, D]   -> mlp/gate_proj[e] = W.T  (stacked over e)
    mlp.experts.{e}.down_proj [D, Fm]           -> mlp/down_proj[e] = W.T
    lm_head.weight            [V, D]            -> lm_head = W.T  (absent when tied)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.config.rope_scaling import parse_rope_scaling
from trainer.config.schema import ModelConfig
from trainer.model import attention
from trainer.model.layers import (
    BTD,
    Attention,
    Context,
    Mlp,
    matrix,
    norm_weight,
    rms_norm,
    rope_tables,
)
from trainer.model.moe import MoeMlp
from trainer.parallel.activations import UNSHARDED, ActivationSharding
from trainer.parallel.context import context_shards

Params = dict[str, Any]
logger = logging.getLogger(__name__)

_REMAT_POLICIES = {
    "full": None,  # save nothing but the block inputs
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep projection/MLP matmul outputs
}


class Block(nnx.Module):
    """Pre-norm decoder block: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x)); returns (x, moe aux loss)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, wdt = cfg.base_emb_dim, cfg.weight_dtype
        self.eps = cfg.normalization_layer_epsilon
        self.input_layernorm = norm_weight(rngs, d, wdt)
        self.self_attn = Attention(
            emb_dim=d,
            num_heads=cfg.base_num_query_heads,
            num_kv_heads=cfg.base_num_kv_heads,
            head_dim=cfg.head_dim,
            use_qk_norm=cfg.use_qk_norm,
            eps=self.eps,
            dtype=cfg.dtype,
            weight_dtype=wdt,
            rngs=rngs,
        )
        self.post_attention_layernorm = norm_weight(rngs, d, wdt)
        if cfg.num_experts > 1:
            self.mlp = MoeMlp(
                emb_dim=d,
                moe_mlp_dim=cfg.base_moe_mlp_dim,
                num_experts=cfg.num_experts,
                top_k=cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob,
                capacity_factor=cfg.moe_capacity_factor,
                dtype=cfg.dtype,
                weight_dtype=wdt,
                rngs=rngs,
            )
        else:
            self.mlp = Mlp(emb_dim=d, mlp_dim=cfg.base_mlp_dim, dtype=cfg.dtype, weight_dtype=wdt, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context) -> tuple[jax.Array, jax.Array]:
        x = x + self.self_attn(rms_norm(x, self.input_layernorm[...], self.eps), ctx)
        return self.feed_forward(ctx.shard(x, BTD), ctx.valid, shard=ctx.shard)

    def feed_forward(
        self, x: jax.Array, valid: jax.Array, *, shard: ActivationSharding = UNSHARDED
    ) -> tuple[jax.Array, jax.Array]:
        """The second residual half: (x + MLP(RMSNorm(x)), aux loss); the KV-cache decoder reuses it."""
        h = rms_norm(x, self.post_attention_layernorm[...], self.eps)
        if isinstance(self.mlp, MoeMlp):
            h, aux = self.mlp(h, valid, shard=shard)
        else:
            h, aux = self.mlp(h, shard=shard), jnp.zeros((), jnp.float32)
        return shard(x + h, BTD), aux


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """num_layers blocks whose params carry a leading "layers" dim (one rng split per layer)."""

    @nnx.split_rngs(splits=cfg.base_num_decoder_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(layer_rngs: nnx.Rngs) -> Block:
        return Block(cfg, layer_rngs)

    return create(rngs)


# `(fn, inputs)`: each block runs with `fn(its params, its inputs)` in place of its params, computed inside
# the block's rematerialised function (so per layer, never for all layers at once). `inputs` is per layer:
# stacked with a leading layers dim (scan_layers=true) or a dict keyed by the layer index "0", "1", ...
LayerAdapter = tuple[Callable[[Params, Any], Params], Any]


def _adapted(state, adapt: Callable[[Params, Any], Params], inputs):
    """A block's nnx State with its params replaced by `adapt(params, inputs)` (plain dicts, str keys)."""
    new = jax.tree.map(lambda x: x, state)  # a fresh State: the scanned one stays as it is
    nnx.replace_by_pure_dict(new, adapt(_stringify_keys(nnx.to_pure_dict(state)), inputs))
    return new


def _block_fn(graphdef, remat_policy: str, scanned: bool, adapt: Callable[[Params, Any], Params] | None = None):
    """(block state, x, ctx, adapter inputs) -> (x, aux), rematerialised per the policy. The same for scan
    and loop. With `adapt`, the block runs with `adapt(its params, adapter inputs)` (`LayerAdapter`)."""

    def run(state, x, ctx, inputs):
        if adapt is not None:
            state = _adapted(state, adapt, inputs)
        return nnx.merge(graphdef, state)(x, ctx)

    if remat_policy == "none":
        return run
    # Inside a scan the loop boundary already prevents CSE across the recomputation.
    return jax.checkpoint(run, policy=_REMAT_POLICIES[remat_policy], prevent_cse=not scanned)


def _attention_kernel(cfg: ModelConfig, seq_len: int, shard: ActivationSharding) -> attention.AttentionKernel:
    """The `attention` key resolved for the devices and length (runs once per trace; logs the choice).

    The devices are the mesh's where there is one: an ahead-of-time compile for a TPU topology traces on
    a CPU host and must still pick the TPU kernel."""
    backend = shard.mesh.devices.flat[0].platform if shard.mesh is not None else jax.default_backend()
    name = attention.resolve(
        cfg.attention,
        backend=backend,
        seq_len=seq_len,
        head_dim=cfg.head_dim,
        dtype=cfg.dtype,
        context=context_shards(shard),
    )
    if cfg.attention == "autoselected":
        logger.info("attention=autoselected -> %s (backend %s, sequence %d)", name, backend, seq_len)
    return attention.AttentionKernel(name, block_q=cfg.sa_block_q, block_kv=cfg.sa_block_kv)


class Transformer(nnx.Module):
    """Embedding, decoder blocks (stacked + scanned, or a python list), final RMSNorm, output head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        v, d, wdt = cfg.vocab_size, cfg.base_emb_dim, cfg.weight_dtype
        self.embed_tokens = matrix(rngs, (v, d), ("vocab", "embed"), wdt)
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.base_num_decoder_layers)])
        self.norm = norm_weight(rngs, d, wdt)
        self.lm_head = None if cfg.logits_via_embedding else matrix(rngs, (d, v), ("embed", "vocab"), wdt)

    def __call__(
        self,
        inputs: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        shard: ActivationSharding = UNSHARDED,
        layers: LayerAdapter | None = None,
    ):
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        adapt, adapter_inputs = layers if layers is not None else (None, None)
        x = shard(jnp.take(self.embed_tokens[...], inputs, axis=0).astype(dt), BTD)
        scaling = parse_rope_scaling(cfg.rope_scaling)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_max_timescale, dt, scaling)
        ctx = Context(
            cos=cos,
            sin=sin,
            segment_ids=segment_ids,
            valid=segment_ids > 0,
            shard=shard,
            attend=_attention_kernel(cfg, inputs.shape[1], shard),
        )
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)
            block = _block_fn(graphdef, cfg.remat_policy, scanned=True, adapt=adapt)

            def body(carry, xs):
                layer_state, layer_inputs = xs
                y, a = block(layer_state, carry[0], ctx, layer_inputs)
                return (y, carry[1] + a), None

            (x, aux), _ = jax.lax.scan(body, (x, jnp.zeros((), jnp.float32)), (state, adapter_inputs))
        else:
            aux = jnp.zeros((), jnp.float32)
            for i, layer in enumerate(self.layers):
                graphdef, state = nnx.split(layer)
                block = _block_fn(graphdef, cfg.remat_policy, scanned=False, adapt=adapt)
                x, a = block(state, x, ctx, None if adapter_inputs is None else adapter_inputs[str(i)])
                aux = aux + a
        hidden = rms_norm(x, self.norm[...], cfg.normalization_layer_epsilon)
        if cfg.num_experts > 1:
            aux = cfg.load_balance_loss_weight * aux / cfg.base_num_decoder_layers
        return hidden, aux


# ---------------------------------------------------------------------------------------------------
# Functional facade: plain dicts in and out; NNX split/merge happens at trace time only.


def _stringify_keys(tree):
    if isinstance(tree, dict):
        return {str(k): _stringify_keys(v) for k, v in tree.items()}
    return tree


@functools.lru_cache(maxsize=32)
def _abstract_model(cfg: ModelConfig) -> Transformer:
    """The model's structure, built once per config outside any mesh context (NNX would otherwise give
    its abstract params shardings on the context's mesh, which inside a shard_map is the manual one)."""
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(params=0)))


def init_params(cfg: ModelConfig, rng: jax.Array) -> Params:
    """Freshly initialised params (dtype weight_dtype). Jittable with cfg static."""
    model = Transformer(cfg, nnx.Rngs(params=rng))
    return _stringify_keys(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def abstract_params(cfg: ModelConfig) -> Params:
    """Same structure as init_params, as jax.ShapeDtypeStruct leaves (nothing allocated)."""
    return _stringify_keys(nnx.to_pure_dict(nnx.state(_abstract_model(cfg), nnx.Param)))


def param_logical_axes(cfg: ModelConfig) -> Params:
    """Same structure as init_params; each leaf a tuple of logical axis names, one per dim."""
    specs = nnx.get_partition_spec(nnx.state(_abstract_model(cfg), nnx.Param))
    return jax.tree.map(
        tuple,
        _stringify_keys(nnx.to_pure_dict(specs)),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )


def bind(cfg: ModelConfig, params: Params) -> Transformer:
    """An NNX Transformer whose Params are the given arrays (trace-time only under jit)."""
    graphdef, state = nnx.split(_abstract_model(cfg))
    state = jax.tree.map(lambda x: x, state)  # a fresh State: the cached model's is shared
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def forward(
    params: Params,
    cfg: ModelConfig,
    inputs: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    shard: ActivationSharding = UNSHARDED,
    layers: LayerAdapter | None = None,
) -> tuple[jax.Array, jax.Array]:
    """int32 [B, T] inputs/positions/segment_ids -> (hidden [B, T, D] after the final norm in cfg.dtype,
    float32 aux loss: load_balance_loss_weight * mean over layers of the MoE balance loss; 0 if dense).

    Attention is causal and restricted to tokens with the same segment id (0 = padding). `shard` pins the
    activations to a mesh (the train step passes the attempt's; the default leaves them unconstrained).
    Where its mesh has a context axis over several devices, the tokens come in the zigzag order over it
    (trainer/parallel/context.py: the train step reorders the batch) and `hidden` is in that order.
    `layers` (`LayerAdapter`): each block runs with its params transformed, one layer at a time (LoRA's
    merge: `trainer.model.lora.layer_adapter`)."""
    return bind(cfg, params)(inputs, positions, segment_ids, shard=shard, layers=layers)


def logits_from_hidden(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., V] of (a chunk of) hidden states: tied to the embedding or via lm_head."""
    dt = jnp.dtype(cfg.dtype)
    if cfg.logits_via_embedding:
        table = params["embed_tokens"].astype(dt)
        return jnp.einsum("...d,vd->...v", hidden.astype(dt), table, preferred_element_type=jnp.float32)
    head = params["lm_head"].astype(dt)
    return jnp.einsum("...d,dv->...v", hidden.astype(dt), head, preferred_element_type=jnp.float32)


def output_rows(params: Params, cfg: ModelConfig, ids: jax.Array) -> jax.Array:
    """The output projection's rows for vocabulary ids [...] -> [..., D] in the compute dtype, so that
    `logits_from_hidden(params, cfg, h)[..., i]` is `h . output_rows(params, cfg, i)`: one logit per token
    (the target's) without the [..., V] logits. Ids out of range are clipped (masked tokens may carry any)."""
    dt = jnp.dtype(cfg.dtype)
    if cfg.logits_via_embedding:
        return jnp.take(params["embed_tokens"], ids, axis=0, mode="clip").astype(dt)
    return jnp.moveaxis(jnp.take(params["lm_head"], ids, axis=1, mode="clip"), 0, -1).astype(dt)


def logits_pullback(
    params: Params, cfg: ModelConfig, hidden: jax.Array, d_logits: jax.Array
) -> tuple[Params, jax.Array]:
    """(d params, d hidden) of `logits_from_hidden` given float32 d logits [B, c, V]: its vector-Jacobian
    product, the projection's gradient in the projection's dtype, the hidden states' in theirs.

    Written out, not autodiffed, for the order of the tied table's gradient: contracting the tokens as
    hidden^T [D, tokens] x d_logits [tokens, V] reads both operands in the order the matmul wants,
    where d_logits^T x hidden, the transpose of the forward einsum, has the compiler transpose the
    [tokens, V] array or run a strided matmul (XLA:CPU, one core, 512 tokens x 16k vocab x 256: 73 ms
    against 45 ms with the transpose after). The [D, V] result, the size of the projection, is
    transposed instead, behind an optimization barrier so the compiler does not fold it back."""
    dt = jnp.dtype(cfg.dtype)
    h, g = hidden.astype(dt), d_logits.astype(dt)
    f32 = jnp.float32
    if cfg.logits_via_embedding:
        table = params["embed_tokens"].astype(dt)
        d_table = jax.lax.optimization_barrier(jnp.einsum("btd,btv->dv", h, g, preferred_element_type=f32)).T
        d_hidden = jnp.einsum("btv,vd->btd", g, table, preferred_element_type=f32)
        return {"embed_tokens": d_table.astype(params["embed_tokens"].dtype)}, d_hidden.astype(hidden.dtype)
    head = params["lm_head"].astype(dt)
    d_head = jnp.einsum("btd,btv->dv", h, g, preferred_element_type=f32)
    d_hidden = jnp.einsum("btv,dv->btd", g, head, preferred_element_type=f32)
    return {"lm_head": d_head.astype(params["lm_head"].dtype)}, d_hidden.astype(hidden.dtype)
