"""Dense building blocks of the decoder every family shares: named parameters, RMSNorm, RoPE, attention,
SwiGLU.

Layers take sizes and dtypes, never the model config. Every parameter is an `nnx.Param` created through
`nnx.with_partitioning`, so it carries one logical axis name per dim; `parallel/` maps the names to mesh
axes. Activations are pinned by an explicit `ActivationSharding` (`shard`, default `UNSHARDED`: the
identity).

Numerics follow Hugging Face `transformers` (Qwen3, Llama) so that imported checkpoints agree:
- RMSNorm normalises in float32, casts back to the activation dtype, then multiplies by the weight
  (`Qwen3RMSNorm` order).
- RoPE uses the rotate-half layout with inv_freq = theta^(-arange(0, hd, 2) / hd) (rescaled by a
  `rope_scaling` type where the config names one, cos/sin multiplied by its attention factor: YaRN's),
  tables computed in float32 and cast to the activation dtype.
- Attention scores and softmax are float32; probabilities are cast back before the value matmul
  (`attention.py` holds the implementations the `attention` key selects between).
Init (HF `initializer_range=0.02`): matrices and the embedding ~ normal(0, 0.02); norm weights = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.config.rope_scaling import RopeScaling
from trainer.model.attention import AttentionKernel
from trainer.model.attention import grouped_attention as grouped_attention  # dot_product; the KV-cache decoder
from trainer.model.context_attention import context_attention
from trainer.model.rope import rope_frequencies
from trainer.parallel.activations import UNSHARDED, ActivationSharding
from trainer.parallel.context import context_shards

BTD = ("activation_batch", "activation_length", "activation_embed")
_NORMAL = jax.nn.initializers.normal(stddev=0.02)
_ONES = jax.nn.initializers.ones


def param(rngs: nnx.Rngs, init, shape: Sequence[int], names: Sequence[str | None], dtype) -> nnx.Param:
    """A parameter tagged with logical axis names (never sharded eagerly: placement is the caller's)."""
    named_init = nnx.with_partitioning(init, tuple(names), eager_sharding=False)
    return nnx.Param(named_init(rngs.params(), tuple(shape), jnp.dtype(dtype)))


def matrix(rngs, shape, names, dtype) -> nnx.Param:
    return param(rngs, _NORMAL, shape, names, dtype)


def norm_weight(rngs, size: int, dtype) -> nnx.Param:
    return param(rngs, _ONES, (size,), ("norm",), dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * weight: statistics in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)


class Context(NamedTuple):
    """Per-forward tensors every block needs, computed once outside the layer loop."""

    cos: jax.Array  # [B, T, head_dim], activation dtype
    sin: jax.Array  # [B, T, head_dim]
    segment_ids: jax.Array  # [B, T] int: packed document of each token (0 = padding)
    valid: jax.Array  # [B, T] bool: not padding (segment id > 0)
    shard: ActivationSharding = UNSHARDED  # pins activations to the mesh (static: no arrays)
    attend: AttentionKernel = AttentionKernel()  # the `attention` implementation (static)


def rope_tables(
    positions: jax.Array,
    head_dim: int,
    theta: float,
    dtype,
    scaling: RopeScaling | None = None,
    length: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """cos/sin of RoPE angles [B, T, head_dim], both halves repeated (HF rotate-half layout); `scaling`
    (the parsed `rope_scaling` key, None for none) sets the frequencies and multiplies cos and sin by its
    attention factor (YaRN's; 1 otherwise) (`trainer/model/rope.py`). `length` is the static sequence
    length `dynamic` scaling reads: the position table's T unless given (cached generation gives the
    cache's size)."""
    length = positions.shape[-1] if length is None else length
    inv_freq, attention_factor = rope_frequencies(theta, head_dim, scaling, length)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, hd] rotated: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Attention(nnx.Module):
    """GQA self-attention, with per-head q/k RMSNorm before RoPE when `use_qk_norm` (Qwen3; Llama has none)."""

    def __init__(
        self,
        *,
        emb_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        use_qk_norm: bool,
        eps: float,
        dtype,
        weight_dtype,
        rngs: nnx.Rngs,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.eps, self.dtype = eps, jnp.dtype(dtype)
        self.q_proj = matrix(rngs, (emb_dim, num_heads, head_dim), ("embed", "heads", "head_dim"), weight_dtype)
        self.k_proj = matrix(
            rngs, (emb_dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), weight_dtype
        )
        self.v_proj = matrix(
            rngs, (emb_dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), weight_dtype
        )
        self.o_proj = matrix(rngs, (num_heads, head_dim, emb_dim), ("heads", "head_dim", "embed"), weight_dtype)
        self.q_norm = norm_weight(rngs, head_dim, weight_dtype) if use_qk_norm else None
        self.k_norm = norm_weight(rngs, head_dim, weight_dtype) if use_qk_norm else None

    def __call__(self, x: jax.Array, ctx: Context) -> jax.Array:
        q, k, v = self.project_qkv(x, ctx.cos, ctx.sin, shard=ctx.shard)
        if context_shards(ctx.shard) > 1:  # the sequence is split, in zigzag order (parallel/context.py)
            return self.project_out(context_attention(ctx.attend, q, k, v, ctx.segment_ids, ctx.shard), ctx.shard)
        return self.project_out(ctx.attend(q, k, v, ctx.segment_ids, ctx.shard), ctx.shard)

    def project_qkv(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, shard: ActivationSharding = UNSHARDED
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B,T,D] -> q [B,T,N,hd], k and v [B,T,K,hd]: projected, q/k normed and rotated (the KV cache
        stores k and v exactly as returned here)."""
        dt, b, t = self.dtype, x.shape[0], x.shape[1]
        q = token_matmul(x, _flat_in(self.q_proj[...], dt), shard).reshape(b, t, self.num_heads, self.head_dim)
        k = token_matmul(x, _flat_in(self.k_proj[...], dt), shard).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = token_matmul(x, _flat_in(self.v_proj[...], dt), shard).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm[...], self.eps)
            k = rms_norm(k, self.k_norm[...], self.eps)
        q = shard(apply_rope(q, cos, sin), ("activation_batch", "activation_length", "activation_heads", None))
        kv_names = ("activation_batch", "activation_length", "activation_kv_heads", None)
        return q, shard(apply_rope(k, cos, sin), kv_names), shard(v, kv_names)

    def project_out(self, out: jax.Array, shard: ActivationSharding = UNSHARDED) -> jax.Array:
        """Attention output [B,T,N,hd] -> [B,T,D] through o_proj."""
        b, t = out.shape[0], out.shape[1]
        o = self.o_proj[...].astype(self.dtype)
        return token_matmul(out.reshape(b, t, -1), o.reshape(-1, o.shape[-1]), shard)


def token_matmul(x: jax.Array, w: jax.Array, shard: ActivationSharding = UNSHARDED) -> jax.Array:
    """x [B,T,I] @ w [I,O] -> [B,T,O], as one 2-D matmul over the B*T rows (XLA CPU then needs no
    transposes for the gradients), or, where the context axis splits T, batched over [B,T]: merging a
    split T into the rows would make the compiler gather the whole sequence."""
    if context_shards(shard) > 1:
        return jnp.einsum("bti,io->bto", x, w)
    b, t = x.shape[0], x.shape[1]
    return (x.reshape(b * t, x.shape[2]) @ w).reshape(b, t, w.shape[1])


def _flat_in(kernel: jax.Array, dtype) -> jax.Array:
    """[D, heads, hd] -> [D, heads * hd] in the matmul dtype."""
    return kernel.astype(dtype).reshape(kernel.shape[0], -1)


class Mlp(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, *, emb_dim: int, mlp_dim: int, dtype, weight_dtype, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(dtype)
        self.gate_proj = matrix(rngs, (emb_dim, mlp_dim), ("embed", "mlp"), weight_dtype)
        self.up_proj = matrix(rngs, (emb_dim, mlp_dim), ("embed", "mlp"), weight_dtype)
        self.down_proj = matrix(rngs, (mlp_dim, emb_dim), ("mlp", "embed"), weight_dtype)

    def __call__(self, x: jax.Array, *, shard: ActivationSharding = UNSHARDED) -> jax.Array:
        dt = self.dtype
        gate = token_matmul(x, self.gate_proj[...].astype(dt), shard)
        up = token_matmul(x, self.up_proj[...].astype(dt), shard)
        hidden = shard(jax.nn.silu(gate) * up, ("activation_batch", "activation_length", "activation_mlp"))
        return token_matmul(hidden, self.down_proj[...].astype(dt), shard)
