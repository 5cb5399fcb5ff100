"""Attention over a sequence split on the `context` mesh axis (trainer/parallel/context.py).

Each device holds its queries, keys and values for its two zigzag chunks of the sequence; the tokens'
original indices mask causality, so the result is the attention of the unsplit sequence. Two strategies
(the `context_parallel_strategy` key) bring the other shards' keys and values to a device's queries:

- `all_gather`: gather the whole sequence's keys, values and segment ids once per layer (its gradient is
  the matching reduce-scatter), put them back in sequence order and run the `attention` kernel (flash or
  dot_product) on the local queries against them: per-device memory ~ the sequence's keys and values.
- `ring`: N steps; at each a device attends its queries to the key/value shard it holds (online softmax,
  one [T/N, T/N] score tile per head, recomputed in the backward pass), while that shard moves on to the
  next device around the context axis (`ppermute`), so the exchange overlaps the compute and no device
  ever holds more than two shards of keys and values.

Both run in a `shard_map` manual over the context axis and the mesh axes the batch rows are split over
(those `activation_batch` takes under the rules, less any already manual), so each device gathers and
passes around the keys and values of its own rows only; the heads are left to the compiler inside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trainer.model import attention
from trainer.parallel.activations import ActivationSharding, axes_of
from trainer.parallel.context import AXIS, context_shards, unzigzag, zigzag_order


def context_attention(
    kernel: attention.AttentionKernel,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    shard: ActivationSharding,
) -> jax.Array:
    """`kernel`'s attention for q [B,T,N,hd], k/v [B,T,K,hd], segment_ids [B,T] whose tokens are in the
    zigzag order over `shard`'s context axis, split along it -> [B,T,N,hd] in the same order."""
    if kernel.name not in attention.CONTEXT_PARALLEL:
        raise ValueError(
            f"attention={kernel.name} does not run under context parallelism yet; use attention=flash or "
            "attention=dot_product with ici_context_parallelism > 1"
        )
    shards, length = context_shards(shard), q.shape[1]
    positions = jnp.asarray(zigzag_order(length, shards))
    if shard.context_strategy == "ring":
        body = _ring(shards)
    elif shard.context_strategy == "all_gather":
        body = _all_gather(kernel, shards)
    else:
        raise ValueError(f"context_parallel_strategy={shard.context_strategy!r}: use all_gather or ring")
    rows = batch_axes(shard, q.shape[0])
    seq = P(rows, AXIS)
    return jax.shard_map(
        body,
        mesh=shard.context_mesh(),
        in_specs=(seq, seq, seq, seq, P(AXIS)),
        out_specs=seq,
        axis_names={AXIS, *axes_of(rows)},
        check_vma=False,
    )(q, k, v, segment_ids.astype(jnp.int32), positions)


def batch_axes(shard: ActivationSharding, rows: int):
    """The spec entry of a [B, ...] activation's rows inside the context shard_map: the axes `shard`'s rules
    split `activation_batch` over for `rows` rows (never the context axis; manual axes left out)."""
    return shard.spec(("activation_batch",), (rows,), skip=(AXIS,))[0]


def _all_gather(kernel: attention.AttentionKernel, shards: int):
    def local(q, k, v, seg, pos):
        def whole(x):
            return unzigzag(jax.lax.all_gather(x, AXIS, axis=1, tiled=True), shards)

        k, v, kv_seg = whole(k), whole(v), whole(seg)
        kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
        if kernel.name == "flash":
            return attention.flash_attention(
                q,
                k,
                v,
                seg,
                block_q=kernel.block_q,
                block_kv=kernel.block_kv,
                kv_segment_ids=kv_seg,
                q_positions=pos,
                kv_positions=kv_pos,
            )
        mask = attention.position_mask(seg, kv_seg, pos, kv_pos)
        return attention.grouped_attention(q, k, v, mask, k.shape[2])

    return local


def _tile(q, k, v, seg_q, seg_k, pos_q, pos_k, m, l, acc):
    """One online-softmax step: the running (max, sum, unnormalised output) of queries q [B,T,K,G,hd]
    updated with keys/values k, v [B,S,K,hd] under the segment/position mask."""
    mask = attention.position_mask(seg_q, seg_k, pos_q, pos_k)  # [B,1,1,T,S]
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    s = jnp.where(mask, s, attention._MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv


def _ring(shards: int):
    tile = jax.checkpoint(_tile)  # the backward pass recomputes each tile from its inputs
    forward = [(i, (i + 1) % shards) for i in range(shards)]

    def local(q, k, v, seg, pos):
        b, t, n, hd = q.shape
        kvh = k.shape[2]
        qg = q.reshape(b, t, kvh, n // kvh, hd)
        shape = (b, kvh, n // kvh, t)
        stats = (jnp.full(shape, attention._MASKED), jnp.zeros(shape), jnp.zeros((*shape, hd), jnp.float32))

        def step(carry, _):
            stats, held = carry
            stats = tile(qg, held[0], held[1], seg, held[2], pos, held[3], *stats)
            return (stats, [jax.lax.ppermute(x, AXIS, forward) for x in held]), None

        held = [k, v, seg, pos]
        (stats, held), _ = jax.lax.scan(step, (stats, held), None, length=shards - 1)
        _, l, acc = tile(qg, held[0], held[1], seg, held[2], pos, held[3], *stats)
        out = acc / l[..., None]  # every query sees at least itself (its own shard, the first step)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hd).astype(q.dtype)

    return local
