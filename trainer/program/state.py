"""The train state {"step", "params", "opt_state"}: its shardings on a mesh, its abstract form, a fresh one,
and one around given parameters. Its size in bytes is `trainer.io.nbytes.tree_nbytes`.

`params` are what trains: the model's params, or with LoRA on (`lora` given, lora_rank > 0) the adapters
only (`trainer.model.lora`). The frozen base of a LoRA run lives outside the state (`base_shardings`,
`init_base`): every save, snapshot and restore of the state carries the adapters and their optimizer state
and nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.config.schema import LoraConfig, ModelConfig
from trainer.model import abstract_params, init_params, param_logical_axes
from trainer.model import lora as lora_math
from trainer.parallel.rules import tree_shardings

# The adapters' init stream: fold_in(key(init_weights_seed), ADAPTER_STREAM); the base's is the key itself.
ADAPTER_STREAM = 1


def trainable_logical_axes(model: ModelConfig, lora: LoraConfig | None = None) -> dict:
    """The logical axis names of what trains: the params, or the adapters with LoRA on."""
    if lora_math.enabled(lora):
        return lora_math.adapter_logical_axes(model, lora)
    return param_logical_axes(model)


def abstract_train_state(model: ModelConfig, optimizer, lora: LoraConfig | None = None) -> dict:
    """The train state {"step", "params", "opt_state"} as shapes and dtypes, on no mesh (no device touched:
    the preflight compares it with a saved step before a multi-process job has joined)."""
    params = lora_math.abstract_adapters(model, lora) if lora_math.enabled(lora) else abstract_params(model)
    return {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": params,
        "opt_state": jax.eval_shape(optimizer.init, params),
    }


def state_shardings(
    model: ModelConfig, rules: Sequence, mesh: Mesh, optimizer, lora: LoraConfig | None = None
) -> tuple[Any, Any]:
    """(shardings, abstract state) of the train state on this mesh, from the logical axis rules."""
    abstract = abstract_train_state(model, optimizer, lora)
    param_sh = tree_shardings(trainable_logical_axes(model, lora), abstract["params"], mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, abstract["opt_state"], param_sh, transform_non_params=lambda _: replicated
    )
    shardings = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return shardings, abstract


def base_shardings(model: ModelConfig, rules: Sequence, mesh: Mesh) -> tuple[Any, Any]:
    """(shardings, abstract params) of a LoRA run's frozen base on this mesh: the model's params, laid out
    as full training lays them out."""
    abstract = abstract_params(model)
    shardings = tree_shardings(param_logical_axes(model), abstract, mesh, rules)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return shardings, abstract


def init_base(model: ModelConfig, shardings, *, seed: int) -> dict:
    """A LoRA run's base initialised from `seed` (no load_parameters_path), as full training would init it."""
    return jax.jit(lambda rng: init_params(model, rng), out_shardings=shardings)(jax.random.key(seed))


def init_state(model: ModelConfig, optimizer, shardings, *, seed: int, lora: LoraConfig | None = None) -> dict:
    """Fresh parameters (with LoRA on: fresh adapters) and optimizer state, created already sharded (never
    whole on one device)."""

    def init(rng):
        if lora_math.enabled(lora):
            params = lora_math.init_adapters(model, lora, jax.random.fold_in(rng, ADAPTER_STREAM))
        else:
            params = init_params(model, rng)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def state_around(params, optimizer, shardings) -> dict:
    """A step-0 train state around loaded `params`: a new optimizer state, sharded like the rest."""
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    return {"step": step, "params": params, "opt_state": opt_state}
