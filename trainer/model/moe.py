"""Mixture-of-experts SwiGLU layer (Qwen3-MoE) with capacity-based, sort-and-gather dispatch.

Routing (HF `Qwen3MoeSparseMoeBlock`): router logits = x @ W_router (no bias), softmax over experts in
float32, top-k, optionally renormalise the k weights to sum to 1 (`norm_topk_prob`), cast them to the
activation dtype; the output is the weighted sum of the k chosen SwiGLU experts.

Dispatch. Each batch row is one routing group of T tokens. Every expert gets a fixed buffer of
C = min(T, ceil(capacity_factor * T * k / E)) token slots, so all shapes are static:
1. The T*k assignments are laid out slot-major (all first choices, then all second choices, ...), so
   when an expert overflows, a token's top-1 choice wins over another token's lower choices; padding
   tokens (segment id 0) are routed to a virtual expert E and never take a slot.
2. A stable argsort by expert gives each assignment its rank inside its expert; rank < C keeps it,
   the rest are dropped (they contribute zero; the residual connection carries the token).
3. Gather: slot (e, c) reads its token's row of x -> [B, E, C, D]. The experts run as three batched
   matmuls over [B, E, C, *] (weights [E, D, F] / [E, F, D], logical axis "exp").
4. Combine: each kept assignment gathers its expert's output row, scales it by its router weight, and
   the k rows of a token are summed.
All index work is integer sort/scatter of size T*k per row; the gathers' gradients are scatter-adds.
Memory per layer: the dispatch buffer B*E*C*D and hidden B*E*C*F, i.e. about capacity_factor * k
times a dense layer's activations, never B*T*E*D. FLOPs: 6*D*F_moe*E*C per row (the same factor).
With capacity_factor >= E / k, C = T and nothing is ever dropped (the dropless reference).

Load balancing (HF `load_balancing_loss_func`, per layer): E * sum_e f_e * p_e where f_e is the
fraction of (non-padding) tokens that chose expert e among their top-k (so sum_e f_e = k) and p_e the
mean router probability of e. It equals k for perfectly uniform routing. The model averages it over
layers (HF instead averages f and p over the layers first) and scales it by the loss weight.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from trainer.model.layers import matrix
from trainer.parallel.activations import UNSHARDED, ActivationSharding
from trainer.parallel.context import context_shards, zigzag_order


def expert_capacity(tokens_per_group: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per routing group (at most the group size: a token picks an expert once)."""
    wanted = math.ceil(capacity_factor * tokens_per_group * top_k / num_experts)
    return max(1, min(tokens_per_group, wanted))


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 router logits [..., E] -> (probs [..., E], top-k weights [..., k], expert ids [..., k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts


def _dispatch_plan(
    experts: jax.Array, valid: jax.Array, num_experts: int, capacity: int, order: jax.Array | None = None
):
    """One routing group. experts [T, k] int, valid [T] bool, order [T] int: each token's index in the
    sequence (an expert's slots go to its assignments by choice rank, then by this index, so a reordered
    sequence drops the same tokens; `arange(T)` unless the tokens come reordered) ->
    (slot [k*T] int: buffer slot of each slot-major assignment, E*C if dropped;
     slot_token [E*C] int: the token each buffer slot reads, T (a zero row) if empty;
     counts [E]: assignments per expert before dropping)."""
    t, k = experts.shape
    expert = jnp.where(valid[None, :], experts.T, num_experts).reshape(-1).astype(jnp.int32)
    order = jnp.arange(t, dtype=jnp.int32) if order is None else order
    choice = jnp.arange(t * k, dtype=jnp.int32) // t
    sort_key = (expert * k + choice) * t + jnp.tile(order.astype(jnp.int32), k)
    order = jnp.argsort(sort_key)  # the keys are distinct
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(t * k, dtype=jnp.int32) - starts[expert[order]]
    rank = jnp.zeros(t * k, jnp.int32).at[order].set(rank_sorted)
    keep = (expert < num_experts) & (rank < capacity)
    slot = jnp.where(keep, expert * capacity + rank, num_experts * capacity)
    token = jnp.arange(t * k, dtype=jnp.int32) % t
    slot_token = jnp.full(num_experts * capacity, t, jnp.int32).at[slot].set(token, mode="drop")
    return slot, slot_token, counts[:num_experts]


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [N, D] rows at index; an out-of-range index (N: an empty or dropped slot) reads zeros."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


class MoeMlp(nnx.Module):
    """Top-k routed SwiGLU experts; returns (output, load-balance loss of this layer)."""

    def __init__(
        self,
        *,
        emb_dim: int,
        moe_mlp_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        capacity_factor: float,
        dtype,
        weight_dtype,
        rngs: nnx.Rngs,
    ):
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.capacity_factor, self.dtype = capacity_factor, jnp.dtype(dtype)
        e, d, f = num_experts, emb_dim, moe_mlp_dim
        self.router = matrix(rngs, (d, e), ("embed", None), weight_dtype)
        self.gate_proj = matrix(rngs, (e, d, f), ("exp", "embed", "mlp"), weight_dtype)
        self.up_proj = matrix(rngs, (e, d, f), ("exp", "embed", "mlp"), weight_dtype)
        self.down_proj = matrix(rngs, (e, f, d), ("exp", "mlp", "embed"), weight_dtype)

    def __call__(
        self, x: jax.Array, valid: jax.Array, *, shard: ActivationSharding = UNSHARDED
    ) -> tuple[jax.Array, jax.Array]:
        dt, e, k = self.dtype, self.num_experts, self.top_k
        b, t, d = x.shape
        logits = jnp.einsum("btd,de->bte", x, self.router[...].astype(dt), preferred_element_type=jnp.float32)
        probs, weights, experts = route(logits, k, self.norm_topk_prob)
        capacity = expert_capacity(t, e, k, self.capacity_factor)
        order = jnp.asarray(zigzag_order(t, context_shards(shard)))  # the tokens' places in the sequence
        slot, slot_token, counts = jax.vmap(_dispatch_plan, in_axes=(0, 0, None, None, None))(
            experts, valid, e, capacity, order
        )

        dispatched = jax.vmap(_gather_rows)(x, slot_token).reshape(b, e, capacity, d)
        dispatched = shard(dispatched, ("activation_batch", "activation_exp", None, "activation_embed"))
        gate = jnp.einsum("becd,edf->becf", dispatched, self.gate_proj[...].astype(dt))
        up = jnp.einsum("becd,edf->becf", dispatched, self.up_proj[...].astype(dt))
        hidden = shard(jax.nn.silu(gate) * up, ("activation_batch", "activation_exp", None, "activation_mlp"))
        expert_out = jnp.einsum("becf,efd->becd", hidden, self.down_proj[...].astype(dt))

        per_assignment = jax.vmap(_gather_rows)(expert_out.reshape(b, e * capacity, d), slot)  # [B, k*T, D]
        slot_major_weights = jnp.swapaxes(weights, 1, 2).reshape(b, k * t, 1).astype(dt)
        out = (per_assignment * slot_major_weights).reshape(b, k, t, d).sum(axis=1)
        return out, load_balance_loss(probs, counts, valid)


def load_balance_loss(probs: jax.Array, counts: jax.Array, valid: jax.Array) -> jax.Array:
    """E * sum_e (tokens choosing e / tokens) * mean prob of e, over non-padding tokens (float32)."""
    num_experts = probs.shape[-1]
    n = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    fraction = jnp.sum(counts, axis=0).astype(jnp.float32) / n
    mean_prob = jnp.sum(probs * valid[..., None], axis=(0, 1)) / n
    return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)
