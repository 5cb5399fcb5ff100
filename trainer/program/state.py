"""The train state {"step", "params", "opt_state"}: its shardings on a mesh, its abstract form, a fresh one,
and one around given parameters. Its size in bytes is `trainer.io.nbytes.tree_nbytes`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.config.schema import ModelConfig
from trainer.model import abstract_params, init_params, param_logical_axes
from trainer.parallel.rules import tree_shardings


def abstract_train_state(model: ModelConfig, optimizer) -> dict:
    """The train state {"step", "params", "opt_state"} as shapes and dtypes, on no mesh (no device touched:
    the preflight compares it with a saved step before a multi-process job has joined)."""
    params = abstract_params(model)
    return {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": params,
        "opt_state": jax.eval_shape(optimizer.init, params),
    }


def state_shardings(model: ModelConfig, rules: Sequence, mesh: Mesh, optimizer) -> tuple[Any, Any]:
    """(shardings, abstract state) of the train state on this mesh, from the logical axis rules."""
    abstract = abstract_train_state(model, optimizer)
    param_sh = tree_shardings(param_logical_axes(model), abstract["params"], mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, abstract["opt_state"], param_sh, transform_non_params=lambda _: replicated
    )
    shardings = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return shardings, abstract


def init_state(model: ModelConfig, optimizer, shardings, *, seed: int) -> dict:
    """Fresh parameters and optimizer state, created already sharded (never whole on one device)."""

    def init(rng):
        params = init_params(model, rng)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def state_around(params, optimizer, shardings) -> dict:
    """A step-0 train state around loaded `params`: a new optimizer state, sharded like the rest."""
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    return {"step": step, "params": params, "opt_state": opt_state}
