"""Faults that land on one slice's devices: wrong numbers computed there, or its copy of the state changed.

These act on the device buffers of the slice's devices and nothing else, the layer where silent data
corruption arises: the programs that run there (the train step, the replay check) compute on what those
devices hold, and every detector sees only what the devices computed.

- `wrong_inputs`: the slice's devices read different token ids than the batch holds (a chip that
  computes wrong numbers: its gradients are wrong, and the cross-replica sum spreads them to every
  replica, so the replicas stay identical);
- `flip_bits`: one mantissa bit of the first element of each of the slice's parameter shards flips (a
  memory fault: that slice's copy of the parameters differs from the other replicas' from then on).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np


def on_devices(x: jax.Array, devices: Collection, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`x` with `fn` applied to its shards on `devices` (each on its own device), every other shard as is."""
    chosen = set(devices)
    if not any(s.device in chosen for s in x.addressable_shards):
        return x
    shards = [jax.device_put(fn(s.data), s.device) if s.device in chosen else s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


def _other_token(ids: jax.Array) -> jax.Array:
    return jnp.where(ids > 0, ids - 1, ids + 1).astype(ids.dtype)


def wrong_inputs(batch: dict, devices: Collection) -> dict:
    """`batch` (device arrays) as the devices in `devices` would compute on it with a fault: every token id
    they hold is off by one (still a valid id)."""
    return {k: on_devices(v, devices, _other_token) if k == "inputs" else v for k, v in batch.items()}


def _flip_first(x: jax.Array) -> jax.Array:
    """`x` with one bit of its first element flipped: the mantissa bit worth 1/8 of the leading digit."""
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or x.size == 0:
        return x
    bits = jnp.dtype(f"uint{dtype.itemsize * 8}")
    mask = np.array(1 << (jnp.finfo(dtype).nmant - 3), dtype=bits)
    first = (0,) * x.ndim
    flipped = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x[first], bits) ^ mask, dtype)
    return x.at[first].set(flipped)


def flip_bits(params, devices: Collection):
    """`params` (device arrays) with a bit of the first element of each shard flipped on `devices` only."""
    return jax.tree.map(lambda p: on_devices(p, devices, _flip_first), params)
