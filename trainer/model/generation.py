"""Autoregressive decoding with a fixed-size KV cache: prefill the prompt, then one jitted token step.

    cache = init_cache(cfg, batch, max_length)
    logits, cache = extend(params, cfg, tokens, cache)   # tokens [B, T]: the prompt (prefill) or T = 1
    ids = generate(params, cfg, prompt_ids, max_new_tokens, Sampling(...), seed=0, eos_id=None)

The cache holds every layer's rotated k and v for `max_length` positions, [L, B, S, K, hd] in the
activation dtype, plus `length`, the positions filled so far (the same for every row: prompts of one
batch have one length). `extend` writes the new tokens' k/v at `length` with `lax.dynamic_update_slice`
and attends over all S slots under a mask (slot <= query position), so shapes never change: one
compiled step serves every position, and a token costs O(S) attention work instead of re-running the
O(T^2) forward. The prompt is one `extend` call (one more compile, for its length).

Numerics are the model's own: `extend` runs the bound NNX modules (Attention.project_qkv/project_out,
grouped_attention, Block.feed_forward, rms_norm, rope_tables), so a token's logits equal those of
`forward` over the whole sequence up to float reassociation. MoE layers run dropless here
(`for_inference` raises the capacity factor to E / k), as Hugging Face inference is. These are the shared
decoder's modules (`transformer.bind`), which every family here runs; a family with a decoder of its own
would bring its own `extend`.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k, then top-p
(the smallest set of most likely tokens whose probability reaches p), then a categorical draw with
key fold_in(key(seed), i) for the i-th new token, so a seed reproduces a run exactly.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trainer.config.rope_scaling import parse_rope_scaling
from trainer.config.schema import ModelConfig
from trainer.model.layers import grouped_attention, rms_norm, rope_tables
from trainer.model.transformer import Params, bind, logits_from_hidden


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, S, K, hd] rotated keys, activation dtype
    v: jax.Array  # [L, B, S, K, hd]
    length: jax.Array  # int32 scalar: slots 0..length-1 are filled


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits (0 / 0 / 1.0 = off)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the most likely tokens up to this total probability; 1 = all

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"invalid sampling {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1")


def for_inference(cfg: ModelConfig) -> ModelConfig:
    """The same model run as at inference: MoE never drops a token (capacity factor >= E / k), no remat."""
    changes = {"remat_policy": "none"}
    if cfg.num_experts > 1:
        changes["moe_capacity_factor"] = max(cfg.moe_capacity_factor, cfg.num_experts / cfg.num_experts_per_tok)
    return dataclasses.replace(cfg, **changes)


def init_cache(cfg: ModelConfig, batch: int, max_length: int) -> KVCache:
    shape = (cfg.base_num_decoder_layers, batch, max_length, cfg.base_num_kv_heads, cfg.head_dim)
    dt = jnp.dtype(cfg.dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((), jnp.int32))  # two buffers: donated


def extend(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Run tokens [B, T] at positions length..length+T-1 against the cache: float32 logits [B, V] of the
    last token, and the cache with their k/v written. The caller keeps length + T <= the cache size."""
    model = bind(cfg, params)
    b, t = tokens.shape
    dt, start = jnp.dtype(cfg.dtype), cache.length
    positions = start + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    scaling = parse_rope_scaling(cfg.rope_scaling)
    # One table length for the prompt and every decoded token: the cache's size (read by `dynamic` only).
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_max_timescale, dt, scaling, length=cache.k.shape[2])
    slots = jnp.arange(cache.k.shape[2], dtype=jnp.int32)
    mask = (slots[None, None, :] <= positions[:, :, None])[:, None, None]  # [B, 1, 1, T, S]
    valid = jnp.ones((b, t), bool)

    def layer(block, x, k_cache, v_cache):
        q, k, v = block.self_attn.project_qkv(rms_norm(x, block.input_layernorm[...], block.eps), cos, sin)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
        attn = grouped_attention(q, k_cache, v_cache, mask, cfg.base_num_kv_heads)
        x, _ = block.feed_forward(x + block.self_attn.project_out(attn), valid)
        return x, k_cache, v_cache

    x = jnp.take(model.embed_tokens[...], tokens, axis=0).astype(dt)
    if cfg.scan_layers:
        graphdef, state = nnx.split(model.layers)

        def body(carry, xs):
            layer_state, k_cache, v_cache = xs
            y, k_cache, v_cache = layer(nnx.merge(graphdef, layer_state), carry, k_cache, v_cache)
            return y, (k_cache, v_cache)

        x, (new_k, new_v) = jax.lax.scan(body, x, (state, cache.k, cache.v))
    else:
        ks, vs = [], []
        for i, block in enumerate(model.layers):
            x, k_i, v_i = layer(block, x, cache.k[i], cache.v[i])
            ks.append(k_i)
            vs.append(v_i)
        new_k, new_v = jnp.stack(ks), jnp.stack(vs)
    hidden = rms_norm(x[:, -1], model.norm[...], cfg.normalization_layer_epsilon)
    return logits_from_hidden(params, cfg, hidden), KVCache(new_k, new_v, start + t)


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token ids [B] from float32 logits [B, V]."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        cutoff = jnp.min(jnp.where(before < sampling.top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def _next_token(params, tokens, cache, key, *, cfg: ModelConfig, sampling: Sampling):
    logits, cache = extend(params, cfg, tokens, cache)
    return sample(logits, key, sampling), cache


def generate(
    params: Params,
    cfg: ModelConfig,
    prompt_ids,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    seed: int = 0,
    eos_id: int | None = None,
) -> np.ndarray:
    """New token ids [B, n] after prompts [B, P] (or one prompt [P]); n = max_new_tokens, or fewer once
    every row has produced `eos_id` (rows that finished earlier continue past their EOS: cut them)."""
    prompt = np.asarray(prompt_ids, np.int32)
    prompt = prompt[None] if prompt.ndim == 1 else prompt
    if prompt.shape[1] < 1 or max_new_tokens < 1:
        raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1, got {prompt.shape}, {max_new_tokens}")
    cfg = for_inference(cfg)
    params = jax.device_put(params)  # once, not per step
    cache = init_cache(cfg, prompt.shape[0], prompt.shape[1] + max_new_tokens)
    key = jax.random.key(seed)
    token, cache = _next_token(
        params, jnp.asarray(prompt), cache, jax.random.fold_in(key, 0), cfg=cfg, sampling=sampling
    )
    out = [np.asarray(token)]
    for i in range(1, max_new_tokens):
        if eos_id is not None and np.any(np.stack(out, 1) == eos_id, axis=1).all():
            break
        token, cache = _next_token(
            params, token[:, None], cache, jax.random.fold_in(key, i), cfg=cfg, sampling=sampling
        )
        out.append(np.asarray(token))
    return np.stack(out, axis=1)
