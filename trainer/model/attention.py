"""Attention implementations behind the `attention` key: one math, four kernels.

Every implementation computes the same causal, packing-aware GQA softmax attention: query t attends key s
only when s <= t and both carry the same segment id (0 = padding, which attends only to padding). Inputs
are q [B,T,N,hd] and k/v [B,S,K,hd] exactly as `Attention.project_qkv` returns them (QK-norm and RoPE
already applied), so the path through the model is the same whichever kernel runs:

- `dot_product`: einsum over full float32 scores (`layers.grouped_attention`); memory ~ T^2.
- `flash`: blockwise online softmax in plain JAX (any backend). A custom VJP recomputes each block in the
  backward pass, so neither pass holds more than one [block_q, block_kv] score tile per head; residuals
  are q, k, v, the output and one float32 log-sum-exp per query: memory ~ T.
- `cudnn_flash`: cuDNN fused attention through `jax.nn.dot_product_attention` (GPU only). Packing's
  segment ids go in as a boolean [B,1,T,S] mask (1 byte per score, not 4 floats' worth of activations).
- `splash`: the Pallas TPU splash-attention kernel shipped with JAX (TPU; Pallas interpret mode elsewhere,
  for tests). Under a mesh it runs per shard through `shard_map` (batch and heads are independent).
- `autoselected`: the best of these for the backend (`resolve`), logged once per compile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from trainer.parallel.activations import UNSHARDED, ActivationSharding

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("autoselected", "dot_product", "flash", "cudnn_flash", "splash")

# Default tiles (queries x keys per score tile; the sa_block_q / sa_block_kv keys), tuned on CPU with
# benchmarks/attention_memory.py: large enough that a 1k sequence is two tiles (little loop overhead
# against dot_product), small enough that one tile's scores stay ~1 MB per head.
FLASH_BLOCK_Q = 512
FLASH_BLOCK_KV = 512
# On backends without a fused kernel, autoselected keeps dot_product up to this length (its T^2 scores
# are small there and XLA fuses it best) and switches to flash above it.
CPU_FLASH_MIN_LENGTH = 2048

_MASKED = float(np.finfo(np.float32).min)

# The implementations that run with the sequence split over the context axis (context_attention.py).
CONTEXT_PARALLEL = ("dot_product", "flash")


def resolve(name: str, *, backend: str, seq_len: int, head_dim: int, dtype, context: int = 1) -> str:
    """The concrete implementation `name` means on `backend` for these shapes (`autoselected` picks).

    TPU: splash when the sequence tiles into 128-lane blocks, else flash. GPU: cudnn_flash for
    16-bit activations and head_dim <= 128 (cuDNN's fused kernel), else flash. Other backends:
    dot_product for short sequences, flash from CPU_FLASH_MIN_LENGTH on. With the sequence split over
    `context` devices only CONTEXT_PARALLEL kernels run: flash where the backend's pick is another."""
    if name != "autoselected":
        return name
    picked = _autoselect(backend, seq_len, head_dim, dtype)
    return picked if context == 1 or picked in CONTEXT_PARALLEL else "flash"


def _autoselect(backend: str, seq_len: int, head_dim: int, dtype) -> str:
    if backend == "tpu":
        return "splash" if seq_len % 128 == 0 else "flash"
    if backend in ("gpu", "cuda", "rocm"):
        half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn_flash" if half and head_dim <= 128 and backend != "rocm" else "flash"
    return "flash" if seq_len >= CPU_FLASH_MIN_LENGTH else "dot_product"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """A resolved attention implementation; static (no leaves) so it rides in the model's Context.

    Called as kernel(q [B,T,N,hd], k/v [B,S,K,hd], segment_ids [B,T], shard) -> [B,T,N,hd]."""

    name: str = "dot_product"
    block_q: int = FLASH_BLOCK_Q
    block_kv: int = FLASH_BLOCK_KV
    interpret: bool = False  # splash only: Pallas interpret mode (runs on CPU)

    def __post_init__(self):
        if self.name not in IMPLEMENTATIONS[1:]:
            raise ValueError(
                f"attention={self.name!r} is not an implementation; use one of {', '.join(IMPLEMENTATIONS)}"
            )

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        segment_ids: jax.Array,
        shard: ActivationSharding = UNSHARDED,
    ) -> jax.Array:
        if self.name == "dot_product":
            return grouped_attention(q, k, v, segment_mask(segment_ids), k.shape[2])
        if self.name == "flash":
            return flash_attention(q, k, v, segment_ids, block_q=self.block_q, block_kv=self.block_kv)
        if self.name == "cudnn_flash":
            return cudnn_attention(q, k, v, segment_ids)
        return splash_attention(
            q,
            k,
            v,
            segment_ids,
            shard=shard,
            block_q=self.block_q,
            block_kv=self.block_kv,
            interpret=self.interpret,
        )


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, 1, 1, T, S] bool: causal by index and only within the same segment (packed documents apart).

    The diagonal is always allowed (a token shares its own segment), so no row is fully masked."""
    t = segment_ids.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same)[:, None, None]


def position_mask(
    segment_ids: jax.Array, kv_segment_ids: jax.Array, q_positions: jax.Array, kv_positions: jax.Array
) -> jax.Array:
    """[B, 1, 1, T, S] bool: query t sees key s when kv_positions[s] <= q_positions[t] (int [T] and [S],
    the tokens' places in the sequence) and their segment ids ([B,T] and [B,S]) are equal: the mask
    `segment_mask` gives, for a shard of the queries against keys in any order."""
    causal = q_positions[:, None] >= kv_positions[None, :]
    same = segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return (causal[None] & same)[:, None, None]


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, num_kv_heads: int) -> jax.Array:
    """Softmax attention, q [B,T,N,hd], k/v [B,S,K,hd] -> [B,T,N,hd]; q head n uses kv head n // (N/K).

    Query heads are viewed as [K, G] so k/v are never repeated; scores and softmax are float32."""
    b, t, n, hd = q.shape
    qg = q.reshape(b, t, num_kv_heads, n // num_kv_heads, hd)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * (hd**-0.5), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, hd)


# ---------------------------------------------------------------------------------------------------
# flash: blockwise online softmax with a recomputing custom VJP.


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    block_q: int = FLASH_BLOCK_Q,
    block_kv: int = FLASH_BLOCK_KV,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
) -> jax.Array:
    """Causal, segment-masked GQA attention, q [B,T,N,hd], k/v [B,S,K,hd] -> [B,T,N,hd], in O(T) memory.

    By default keys are the queries' own sequence (S = T, `kv_segment_ids` = `segment_ids`) and
    causality is by index. Context parallelism passes a shard's queries against the whole sequence's
    keys: `kv_segment_ids` [B,S], and the tokens' places in the sequence as `q_positions` [T] and
    `kv_positions` [S] (int, the same for every row, each ascending: the causal block skipping relies
    on it); query t then sees key s when kv_positions[s] <= q_positions[t] and their segments match.

    Blocks are clipped to the lengths; a length that is not a multiple of its block is padded (padded
    keys are invisible to every query, padded queries see nothing) and the padding cut off again."""
    b, t, n, hd = q.shape
    s, kvh = k.shape[1], k.shape[2]
    kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    q_positions = jnp.arange(t, dtype=jnp.int32) if q_positions is None else q_positions.astype(jnp.int32)
    kv_positions = jnp.arange(s, dtype=jnp.int32) if kv_positions is None else kv_positions.astype(jnp.int32)
    bq, bk = min(block_q, t), min(block_kv, s)
    tq, tk = _round_up(t, bq), _round_up(s, bk)
    seg_q, seg_k = segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    if tq != t:
        q = jnp.pad(q, [(0, 0), (0, tq - t), (0, 0), (0, 0)])
        seg_q = jnp.pad(seg_q, [(0, 0), (0, tq - t)], constant_values=-1)
        q_positions = jnp.pad(q_positions, (0, tq - t), mode="edge")
    if tk != s:
        k, v = (jnp.pad(x, [(0, 0), (0, tk - s), (0, 0), (0, 0)]) for x in (k, v))
        seg_k = jnp.pad(seg_k, [(0, 0), (0, tk - s)], constant_values=-2)
        kv_positions = jnp.pad(kv_positions, (0, tk - s), mode="edge")
    # Head-major once ([B,K,G,T,hd] and [B,K,S,hd]) so each tile is a plain batched matmul.
    qh = q.reshape(b, tq, kvh, n // kvh, hd).transpose(0, 2, 3, 1, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = _flash(qh, kh, vh, (seg_q, seg_k, q_positions, kv_positions), bq, bk, hd**-0.5)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tq, n, hd)[:, :t]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile_mask(seg_q, seg_k, pos_q, pos_k):
    """[B,1,1,bq,bk] bool for a tile: segments [B,bq] / [B,bk], positions [bq] / [bk]."""
    allowed = (pos_q[:, None] >= pos_k[None, :])[None] & (seg_q[:, :, None] == seg_k[:, None, :])
    return allowed[:, None, None]


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _scores(qi, kj, mask, scale):
    s = jnp.einsum("bkgqh,bksh->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask, s, _MASKED)


def _block_tile(masks, i, j, bq, bk):
    """The mask of query block i against key block j."""
    seg_q, seg_k, pos_q, pos_k = masks
    return _tile_mask(
        _slice(seg_q, i * bq, bq, 1),
        _slice(seg_k, j * bk, bk, 1),
        _slice(pos_q, i * bq, bq, 0),
        _slice(pos_k, j * bk, bk, 0),
    )


def _flash_forward(q, k, v, masks, bq, bk, scale):
    """Output [B,K,G,T,hd] and log-sum-exp [B,K,G,T] (float32), one query block at a time."""
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    _, _, pos_q, pos_k = masks
    # Causal: query block i visits the key blocks that start at or before its last position (positions
    # ascend, so those are a prefix); later ones are fully masked, never visited.
    visible = jnp.sum(pos_k.reshape(nk, bk)[:, 0][None, :] <= pos_q.reshape(nq, bq).max(axis=1)[:, None], axis=1)

    def query_block(i):
        qi = _slice(q, i * bq, bq, 3)

        def key_block(j, carry):
            m, l, acc = carry
            kj, vj = _slice(k, j * bk, bk, 2), _slice(v, j * bk, bk, 2)
            mask = _block_tile(masks, i, j, bq, bk)
            s = _scores(qi, kj, mask, scale)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv

        shape = qi.shape[:-1]
        init = (jnp.full(shape, _MASKED), jnp.zeros(shape), jnp.zeros(qi.shape, jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, visible[i], key_block, init)
        l = jnp.where(l == 0, 1.0, l)  # a query that sees no key (padding rows): output 0
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    out, lse = jax.lax.map(query_block, jnp.arange(nq))  # [nq, B,K,G,bq,(hd)]
    b, kvh, g = q.shape[:3]
    out = jnp.moveaxis(out, 0, 3).reshape(b, kvh, g, nq * bq, q.shape[-1])
    return out, jnp.moveaxis(lse, 0, 3).reshape(b, kvh, g, nq * bq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, masks, bq, bk, scale):
    return _flash_forward(q, k, v, masks, bq, bk, scale)[0]


def _flash_fwd(q, k, v, masks, bq, bk, scale):
    out, lse = _flash_forward(q, k, v, masks, bq, bk, scale)
    return out, (q, k, v, masks, out, lse)


def _flash_bwd(bq, bk, scale, res, dout):
    """FlashAttention-2 backward: per key block, loop over the query blocks that see it, recomputing
    the tile's probabilities from the saved log-sum-exp; dk/dv accumulate per key block, dq in place."""
    q, k, v, masks, out, lse = res
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    _, _, pos_q, pos_k = masks
    # Causal: the query blocks that end before key block j starts see none of its keys (a prefix).
    unseen = jnp.sum(pos_q.reshape(nq, bq).max(axis=1)[None, :] < pos_k.reshape(nk, bk)[:, 0][:, None], axis=1)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,K,G,T]

    def key_block(dq, j):
        kj, vj = _slice(k, j * bk, bk, 2), _slice(v, j * bk, bk, 2)

        def query_block(i, carry):
            dq, dk, dv = carry
            qi, doi = _slice(q, i * bq, bq, 3), _slice(dout, i * bq, bq, 3)
            mask = _block_tile(masks, i, j, bq, bk)
            s = _scores(qi, kj, mask, scale)
            p = jnp.where(mask, jnp.exp(s - _slice(lse, i * bq, bq, 3)[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqh,bksh->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - _slice(delta, i * bq, bq, 3)[..., None]) * scale
            dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(qi.dtype), qi, preferred_element_type=jnp.float32)
            dqi = jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i * bq, bq, 3) + dqi, i * bq, axis=3)
            return dq, dk, dv

        zeros = jnp.zeros(kj.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(unseen[j], nq, query_block, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(nk))
    b, kvh, _, hd = k.shape
    dk = jnp.moveaxis(dk, 0, 2).reshape(b, kvh, nk * bk, hd)
    dv = jnp.moveaxis(dv, 0, 2).reshape(b, kvh, nk * bk, hd)
    masks_ct = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), masks)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), masks_ct


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------------
# cudnn_flash and splash: wrappers around the kernels JAX ships.


def cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, implementation: str = "cudnn"
) -> jax.Array:
    """cuDNN fused attention (GPU). `implementation="xla"` runs the same call through XLA (tests on CPU)."""
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f"attention=cudnn_flash needs a CUDA GPU, but JAX's backend is {jax.default_backend()!r}; "
            "use attention=flash (any backend) or attention=autoselected"
        )
    same_segment = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B,1,T,S]
    return jax.nn.dot_product_attention(
        q, k, v, mask=same_segment, is_causal=True, scale=q.shape[-1] ** -0.5, implementation=implementation
    )


def splash_kernel(
    seq_len: int,
    num_heads: int,
    *,
    block_q: int = FLASH_BLOCK_Q,
    block_kv: int = FLASH_BLOCK_KV,
    interpret: bool = False,
):
    """The splash kernel for one sequence: causal mask over `num_heads` query heads, tiles clipped to the
    sequence. Built from static shapes only, so it traces with abstract inputs (ahead-of-time compiles)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if seq_len % 128:
        raise ValueError(
            f"attention=splash needs max_target_length to be a multiple of 128 (TPU lanes), got {seq_len}; "
            "round it up, or use attention=flash"
        )
    bq, bk = min(block_q, seq_len), min(block_kv, seq_len)
    if bq % 128 or bk % 128 or seq_len % bq or seq_len % bk:
        raise ValueError(
            f"attention=splash needs sa_block_q={block_q} and sa_block_kv={block_kv} (clipped to the sequence) "
            f"to be multiples of 128 that divide max_target_length={seq_len}; e.g. sa_block_q=sa_block_kv=512"
        )
    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len))] * num_heads)
    return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    shard: ActivationSharding = UNSHARDED,
    block_q: int = FLASH_BLOCK_Q,
    block_kv: int = FLASH_BLOCK_KV,
    interpret: bool = False,
) -> jax.Array:
    """Splash attention on q [B,T,N,hd], k/v [B,T,K,hd]; the kernel takes one sequence head-major, so it
    is vmapped over the batch and, under a mesh, shard_mapped over the batch and head shards.

    The platform is the mesh's (an ahead-of-time compile for a TPU topology traces on a CPU host), else
    JAX's default backend."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    platform = shard.mesh.devices.flat[0].platform if shard.mesh is not None else jax.default_backend()
    if platform != "tpu" and not interpret:
        raise ValueError(
            f"attention=splash is a TPU kernel, but the devices are {platform!r}; "
            "use attention=flash (any backend) or attention=autoselected"
        )
    seg = segment_ids.astype(jnp.int32)

    def per_shard(q, k, v, seg):
        kernel = splash_kernel(q.shape[1], q.shape[2], block_q=block_q, block_kv=block_kv, interpret=interpret)
        qh = (q * q.shape[-1] ** -0.5).astype(q.dtype).transpose(0, 2, 1, 3)  # the kernel does not scale
        kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

        def one(qb, kb, vb, sb):
            return kernel(qb, kb, vb, segment_ids=sk.SegmentIds(q=sb, kv=sb))

        return jax.vmap(one)(qh, kh, vh, seg).transpose(0, 2, 1, 3)

    if shard.mesh is None:
        return per_shard(q, k, v, seg)
    from jax.sharding import PartitionSpec as P

    q_names = ("activation_batch", None, "activation_heads", None)
    kv_names = ("activation_batch", None, "activation_kv_heads", None)
    q_spec, kv_spec = shard.spec(q_names, q.shape), shard.spec(kv_names, k.shape)
    if q_spec[2] != kv_spec[2]:
        kv_spec = P(kv_spec[0], None, None, None)  # kv heads do not split like q heads: keep them whole
        q_spec = P(q_spec[0], None, None, None)
    seg_spec = P(q_spec[0], None)
    specs = (q_spec, kv_spec, kv_spec, seg_spec)
    return jax.shard_map(per_shard, mesh=shard.context_mesh(), in_specs=specs, out_specs=q_spec, check_vma=False)(
        q, k, v, seg
    )
