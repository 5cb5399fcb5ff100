"""RoPE frequency scalings: the `rope_scaling` types of `trainer/config/rope_scaling.py` applied to the
inverse frequencies theta^(-2i / head_dim), in float32, as Hugging Face `transformers` computes them (its
`ROPE_INIT_FUNCTIONS`), so imported checkpoints agree. One function per type; a new type adds one here."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from trainer.config.rope_scaling import Llama3RopeScaling, RopeScaling


def llama3_frequencies(inv_freq: jax.Array, s: Llama3RopeScaling) -> jax.Array:
    """Llama 3.1: long wavelengths (> original / low_freq_factor) slowed by `factor`, short ones
    (< original / high_freq_factor) kept, the band between interpolated linearly in original / wavelength."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


_FREQUENCIES = {Llama3RopeScaling: llama3_frequencies}


def scale_frequencies(inv_freq: jax.Array, scaling: RopeScaling) -> jax.Array:
    """float32 inverse frequencies [head_dim / 2] under `scaling`."""
    return _FREQUENCIES[type(scaling)](inv_freq, scaling)
