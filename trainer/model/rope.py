"""RoPE inverse frequencies and the cos/sin attention factor, for no scaling and for each `rope_scaling`
type of `trainer/config/rope_scaling.py`, in float32, as Hugging Face `transformers` computes them (its
`ROPE_INIT_FUNCTIONS`), so imported checkpoints agree. One function per type; a new type adds one here.

Each function maps (theta, head_dim, the type's parameters, length) to (inv_freq [head_dim / 2] float32,
attention factor). `length` is the sequence length the forward is built for, a static int: only `dynamic`
reads it. The caller passes the static length of its position table (training and evaluation: the
batch's sequence length; cached generation: the cache's size, so the prompt and every decoded token
rotate by one table). transformers instead uses max(position_ids) + 1 of each call, grown but not shrunk
across calls; the two agree for a single forward over an unpacked sequence whose positions run 0..T-1.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from trainer.config.rope_scaling import (
    DynamicRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    RopeScaling,
    YarnRopeScaling,
)


def default_frequencies(theta: float, head_dim: int) -> jax.Array:
    """theta^(-2i / head_dim) for i < head_dim / 2, float32."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def linear_frequencies(theta: float, head_dim: int, s: LinearRopeScaling, length: int) -> tuple[jax.Array, float]:
    """Position interpolation: every frequency divided by `factor`."""
    return default_frequencies(theta, head_dim) / s.factor, 1.0


def dynamic_frequencies(
    theta: float, head_dim: int, s: DynamicRopeScaling, length: int
) -> tuple[jax.Array, float]:
    """Dynamic NTK: theta raised for sequences longer than the original context (none at or below it)."""
    length = max(length, s.original_max_position_embeddings)
    ratio = s.factor * length / s.original_max_position_embeddings - (s.factor - 1)
    return default_frequencies(theta * ratio ** (head_dim / (head_dim - 2)), head_dim), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(theta: float, head_dim: int, s: YarnRopeScaling, length: int) -> tuple[jax.Array, float]:
    """YaRN: the frequencies interpolated by `factor` where they rotate fewer than beta_slow times over
    the original context, kept above beta_fast rotations, ramped linearly between; cos/sin scaled by the
    attention factor (given, or derived from factor and the mscales)."""
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = yarn_mscale(s.factor)

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return (
            head_dim
            * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = default_frequencies(theta, head_dim)
    interpolation = extrapolation / s.factor
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def llama3_frequencies(theta: float, head_dim: int, s: Llama3RopeScaling, length: int) -> tuple[jax.Array, float]:
    """Llama 3.1: long wavelengths (> original / low_freq_factor) slowed by `factor`, short ones
    (< original / high_freq_factor) kept, the band between interpolated linearly in original / wavelength."""
    inv_freq = default_frequencies(theta, head_dim)
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled), 1.0


_FREQUENCIES = {
    LinearRopeScaling: linear_frequencies,
    DynamicRopeScaling: dynamic_frequencies,
    YarnRopeScaling: yarn_frequencies,
    Llama3RopeScaling: llama3_frequencies,
}


def rope_frequencies(
    theta: float, head_dim: int, scaling: RopeScaling | None, length: int
) -> tuple[jax.Array, float]:
    """(float32 inverse frequencies [head_dim / 2], the factor cos and sin are multiplied by) under
    `scaling` (None: plain RoPE) for a forward over `length` positions."""
    if scaling is None:
        return default_frequencies(theta, head_dim), 1.0
    return _FREQUENCIES[type(scaling)](theta, head_dim, scaling, length)
