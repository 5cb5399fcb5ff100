"""Context parallelism: the sequence of every activation split over the `context` mesh axis.

Causal attention gives a token work in proportion to its place in the sequence, so contiguous shards
would leave the last device the most work. The train step therefore reorders each sequence once, before
the model, in the zigzag order: cut into 2N equal chunks over N devices, device i holds chunks i and
2N-1-i, so every device holds one early and one late chunk and the same share of the attention work.
Inputs, targets, positions, segment ids and the loss mask move together; every layer but attention
works token by token, attention masks by each token's original index (`order`), and the loss is a sum
over tokens, so the step equals the unreordered one up to the order of float sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trainer.parallel.activations import ActivationSharding

AXIS = "context"
STRATEGIES = ("all_gather", "ring")


def context_shards(shard: ActivationSharding) -> int:
    """How many ways the context axis splits the sequence (1 without a mesh or a context axis)."""
    return 1 if shard.mesh is None else int(shard.mesh.shape.get(AXIS, 1))


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """int32 [length]: the original index of each token in the zigzag order over `shards` devices (the
    identity for one). `length` must be a multiple of 2 * shards."""
    if shards == 1:
        return np.arange(length, dtype=np.int32)
    if length % (2 * shards):
        raise ValueError(
            f"a sequence of {length} tokens does not cut into 2 x {shards} equal chunks for context "
            f"parallelism; make max_target_length a multiple of {2 * shards}"
        )
    chunks = np.arange(length, dtype=np.int32).reshape(2 * shards, length // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def reorder(batch: dict, order: np.ndarray) -> dict:
    """Every [B, T, ...] array of `batch` with its tokens in `order` (a static permutation)."""
    return {k: jnp.take(v, jnp.asarray(order), axis=1) for k, v in batch.items()}


def unzigzag(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
    """The whole sequence gathered from the shards in zigzag order ([c0, c2N-1, c1, c2N-2, ...] along
    `axis`) back in its original order, by slicing (no gather)."""
    x = jnp.moveaxis(x, axis, 0)
    t = x.shape[0]
    pairs = x.reshape(shards, 2, t // (2 * shards), *x.shape[1:])
    natural = jnp.concatenate([pairs[:, 0], pairs[::-1, 1]], axis=0).reshape(x.shape)
    return jnp.moveaxis(natural, 0, axis)
