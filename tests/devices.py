"""The platforms a test can run on: CPU always, a CUDA GPU where JAX has one. Tests that hold on every
platform take `PLATFORMS` as a parameter (the GPU case skips without a GPU, CI's case); tests of what
exists only on a GPU (the cuDNN kernel, XLA's GPU determinism) carry `requires_gpu`."""

from __future__ import annotations

import functools

import jax
import pytest


@functools.cache
def gpus() -> tuple:
    try:
        return tuple(jax.devices("gpu"))
    except RuntimeError:
        return ()


def devices(platform: str, n: int) -> list:
    return list(gpus()[:n]) if platform == "gpu" else jax.devices("cpu")[:n]


requires_gpu = pytest.mark.skipif(not gpus(), reason="needs a CUDA GPU")
PLATFORMS = ["cpu", pytest.param("gpu", marks=requires_gpu)]
