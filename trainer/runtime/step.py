"""The pure train step: loss, gradients (with micro-step accumulation), optimizer update, metrics.

`train_step(state, batch) -> (state, metrics)`; state is {"step", "params", "opt_state"}; metrics are
device arrays that the loop reads one step late. No logging, host syncs or globals in here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainer import model as qwen3
from trainer.config.schema import ModelConfig
from trainer.parallel.activations import UNSHARDED, ActivationSharding

# Logits are computed over at most this many tokens at once (rematerialised in the backward pass),
# so the [tokens, vocab] float32 matrix never exists in full: 8192 x 151936 x 4 B ~ 5 GB at most,
# and for a 32k vocab ~1 GB.
LOSS_CHUNK_TOKENS = 8192


def _chunk_losses(params, cfg: ModelConfig, hidden, targets, mask):
    logits = qwen3.logits_from_hidden(params, cfg, hidden)  # float32 [n, vocab]
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jnp.sum((lse - target_logit) * mask), jnp.sum(jnp.square(lse) * mask)


def token_losses(params, cfg: ModelConfig, hidden, targets, mask):
    """Sum over tokens of cross-entropy and of log(Z)^2, with the mask applied, in float32.

    Long inputs are split into chunks of LOSS_CHUNK_TOKENS, each checkpointed so the backward pass
    recomputes its logits instead of keeping them.
    """
    d = hidden.shape[-1]
    h, t, m = hidden.reshape(-1, d), targets.reshape(-1), mask.reshape(-1).astype(jnp.float32)
    n = h.shape[0]
    if n <= LOSS_CHUNK_TOKENS:
        return _chunk_losses(params, cfg, h, t, m)
    chunks = -(-n // LOSS_CHUNK_TOKENS)
    pad = chunks * LOSS_CHUNK_TOKENS - n
    h = jnp.pad(h, ((0, pad), (0, 0))).reshape(chunks, LOSS_CHUNK_TOKENS, d)
    t = jnp.pad(t, (0, pad)).reshape(chunks, LOSS_CHUNK_TOKENS)
    m = jnp.pad(m, (0, pad)).reshape(chunks, LOSS_CHUNK_TOKENS)
    fn = jax.checkpoint(partial(_chunk_losses, params, cfg))
    ce, z = jax.lax.map(lambda xs: fn(*xs), (h, t, m))
    return jnp.sum(ce), jnp.sum(z)


def loss_sums(
    params, cfg: ModelConfig, z_loss_multiplier: float, batch: dict, *, shard: ActivationSharding = UNSHARDED
) -> tuple[jax.Array, dict]:
    """Objective summed over the batch's tokens (not averaged), so micro-steps add up exactly; `shard` pins
    the model's activations to the mesh."""
    hidden, aux_loss = qwen3.forward(
        params, cfg, batch["inputs"], batch["positions"], batch["segment_ids"], shard=shard
    )
    ce, z = token_losses(params, cfg, hidden, batch["targets"], batch["loss_mask"])
    tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    objective = ce + z_loss_multiplier * z
    return objective, {"ce_sum": ce, "z_sum": z, "tokens": tokens, "aux_loss": aux_loss}


def _split_micro(batch: dict, n: int) -> dict:
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)


def make_train_step(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    *,
    z_loss_multiplier: float,
    micro_steps: int,
    constrain_micro: Callable[[dict], dict] = lambda b: b,
    learning_rate: optax.Schedule | None = None,
    shard: ActivationSharding = UNSHARDED,
):
    """Build `train_step(state, batch)`.

    The global batch is split into `micro_steps` equal parts run in a scan; gradients of the token-summed
    objective are accumulated and divided once by the total token count, so k micro-steps give the same
    update as one k-times larger batch. The MoE aux loss is averaged over micro-steps.
    `constrain_micro` pins each micro-batch's sharding and `shard` the model's activations (the caller
    knows the mesh).
    `learning_rate`, the optimizer's schedule, adds the rate this update used to the metrics: computed
    inside the compiled step, since evaluating an optax schedule eagerly on the host compiles each of
    its ~12 jnp ops on first use (~1 s in every new process).
    """

    def micro_grads(params, micro):
        micro = constrain_micro(micro)

        def objective(p):
            total, parts = loss_sums(p, cfg, z_loss_multiplier, micro, shard=shard)
            return total + parts["aux_loss"] * parts["tokens"], parts

        (_, parts), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return grads, parts

    def train_step(state: dict[str, Any], batch: dict) -> tuple[dict[str, Any], dict]:
        params = state["params"]
        if micro_steps == 1:
            grads, parts = micro_grads(params, batch)
        else:

            def body(acc, micro):
                g, p = micro_grads(params, micro)
                return jax.tree.map(jnp.add, acc, (g, p)), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            scalar = jnp.zeros((), jnp.float32)
            init = (zeros, {"ce_sum": scalar, "z_sum": scalar, "tokens": scalar, "aux_loss": scalar})
            (grads, parts), _ = jax.lax.scan(body, init, _split_micro(batch, micro_steps))
            parts = dict(parts, aux_loss=parts["aux_loss"] / micro_steps)
        denom = jnp.maximum(parts["tokens"], 1.0)
        grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
        loss, grad_norm = parts["ce_sum"] / denom, optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite loss or gradient never reaches the state: the update is dropped here and the host
        # applies nan_policy when it reads `finite` (one step late), so no saved state is ever poisoned.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        metrics = {
            "loss": loss,
            "z_loss": parts["z_sum"] / denom,
            "aux_loss": parts["aux_loss"],
            "grad_norm": grad_norm,
            "tokens": parts["tokens"],
            "finite": finite,
        }
        if learning_rate is not None:
            metrics["learning_rate"] = learning_rate(state["step"])
        return {
            "step": state["step"] + 1,
            "params": keep(new_params, params),
            "opt_state": keep(opt_state, state["opt_state"]),
        }, metrics

    return train_step


def make_eval_step(
    cfg: ModelConfig,
    *,
    micro_steps: int = 1,
    constrain_micro: Callable[[dict], dict] = lambda b: b,
    shard: ActivationSharding = UNSHARDED,
):
    """Build `eval_step(params, batch) -> {"ce_sum", "tokens"}`: the forward pass only (no gradient, no
    z-loss, no update), summed over the batch's loss-masked tokens, so the caller adds batches up exactly
    and divides once. The loss mask is the batch's own (assistant tokens only under SFT).

    `micro_steps` splits the batch into equal parts run in a scan: the eval batch is the same size on
    every mesh (the same tokens at every evaluation), so a smaller mesh runs it in more parts.
    """

    def sums(params, batch):
        _, parts = loss_sums(params, cfg, 0.0, constrain_micro(batch), shard=shard)
        return {"ce_sum": parts["ce_sum"], "tokens": parts["tokens"]}

    def eval_step(params, batch: dict) -> dict:
        if micro_steps == 1:
            return sums(params, batch)

        def body(acc, micro):
            return jax.tree.map(jnp.add, acc, sums(params, micro)), None

        zero = jnp.zeros((), jnp.float32)
        out, _ = jax.lax.scan(body, {"ce_sum": zero, "tokens": zero}, _split_micro(batch, micro_steps))
        return out

    return eval_step
