"""The pure train step: loss, gradients (with micro-step accumulation), optimizer update, metrics.

`train_step(state, batch) -> (state, metrics)`; state is {"step", "params", "opt_state"}; metrics are
device arrays that the loop reads one step late. No logging, host syncs or globals in here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from trainer import model as qwen3
from trainer.config.schema import ModelConfig
from trainer.model.layers import BTD
from trainer.parallel.activations import UNSHARDED, ActivationSharding, axes_of

BATCH = ("activation_batch",)
DATA = "data"  # the mesh axis of data-parallel replicas (slices x ici_data_parallelism)
VOCAB = ("activation_vocab",)

# Logits are computed for at most this many tokens per device at once (rematerialised in the backward
# pass): 512 x 151936 x 4 B ~ 311 MB of float32 logits per device at most, ~67 MB for a 32k vocab.
LOSS_CHUNK_TOKENS = 512


def _logits_layout(shard: ActivationSharding, rows: int, vocab: int) -> tuple[PartitionSpec, PartitionSpec]:
    """(hidden [B, c, D] spec, logits [B, c, V] spec) of the vocabulary-parallel loss.

    The vocabulary is split over the mesh axes `activation_vocab` gives (tensor and fsdp by default),
    the batch rows over the batch axes left: each device computes the logits of every row of its group
    for its slice of the vocabulary, from the hidden states gathered over those axes. What crosses
    devices is activation-sized (the hidden states, the log-sum-exp's partial max and sum per token, the
    hidden states' gradient), never the [V, D] output projection or a [tokens, V] partial sum, and the
    projection's gradient stays on the device that holds its rows."""
    v = shard.spec(VOCAB, (vocab,))[0]
    b = shard.spec(BATCH, (rows,), skip=axes_of(v))[0]
    return PartitionSpec(b, None, None), PartitionSpec(b, None, v)


def _chunk_losses(params, cfg: ModelConfig, shard: ActivationSharding, hidden, targets, mask):
    """(ce sum, z sum) of a [B, c, D] chunk, vocabulary-parallel (`_logits_layout`)."""
    hidden = hidden.astype(cfg.dtype)  # gathered in the compute dtype
    logits = qwen3.logits_from_hidden  # float32 [B, c, V]
    if shard.mesh is None:
        logits = logits(params, cfg, hidden)
    else:
        hidden_spec, logits_spec = _logits_layout(shard, hidden.shape[0], cfg.vocab_size)
        logits = shard.pin(logits(params, cfg, shard.pin(hidden, hidden_spec)), logits_spec)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # The target's logit as a masked sum over the vocabulary: a reduction over the split dim, where a
    # gather at the target index would gather the logits.
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == targets[..., None]
    target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    return jnp.sum((lse - target_logit) * mask), jnp.sum(jnp.square(lse) * mask)


def output_params(params, cfg: ModelConfig, shard: ActivationSharding) -> dict:
    """The output projection (the tied embedding or lm_head) in the compute dtype, split by vocabulary
    rows as the loss's logits are (`_logits_layout`), once per step (outside the loss's chunk loop).

    With the default rules the tied embedding is stored that way, so this moves nothing; an untied
    lm_head (stored split over its model dimension) is redistributed once, a fraction of gathering it."""
    dt = jnp.dtype(cfg.dtype)
    if shard.mesh is None:
        key = "embed_tokens" if cfg.logits_via_embedding else "lm_head"
        return {key: params[key].astype(dt)}
    v = shard.spec(VOCAB, (cfg.vocab_size,))[0]
    if cfg.logits_via_embedding:
        return {"embed_tokens": shard.pin(params["embed_tokens"].astype(dt), PartitionSpec(v, None))}
    return {"lm_head": shard.pin(params["lm_head"].astype(dt), PartitionSpec(None, v))}


def _rows_per_device(shard: ActivationSharding, rows: int, vocab: int) -> float:
    """A device's share of the logits, in rows of the whole vocabulary: the rows it computes (of its
    group) times the fraction of the vocabulary it holds."""
    if shard.mesh is None:
        return rows
    _, (b, _, v) = _logits_layout(shard, rows, vocab)
    ways = [math.prod(shard.mesh.shape[a] for a in axes_of(e)) for e in (b, v)]
    return -(-rows // ways[0]) / ways[1]


def _sequence_chunks(rows_per_device: float, length: int) -> int:
    """Fewest chunks, dividing `length`, whose logits hold at most LOSS_CHUNK_TOKENS tokens per device."""
    for n in range(1, length + 1):
        if length % n == 0 and rows_per_device * (length // n) <= LOSS_CHUNK_TOKENS:
            return n
    return length


def token_losses(params, cfg: ModelConfig, hidden, targets, mask, *, shard: ActivationSharding = UNSHARDED):
    """Sum over tokens of cross-entropy and of log(Z)^2, with the mask applied, in float32.

    The logits are vocabulary-parallel (`_logits_layout`). The sequence is cut into chunks, each
    checkpointed so the backward pass recomputes its logits instead of keeping them; a device holds at
    most as many logits at once as LOSS_CHUNK_TOKENS tokens have over the whole vocabulary.
    """
    b, t = targets.shape
    m = mask.astype(jnp.float32)
    chunks = _sequence_chunks(_rows_per_device(shard, b, cfg.vocab_size), t)
    fn = jax.checkpoint(partial(_chunk_losses, params, cfg, shard))
    if chunks == 1:
        return fn(hidden, targets, m)
    c = t // chunks

    def one(i):
        cut = partial(jax.lax.dynamic_slice_in_dim, start_index=i * c, slice_size=c, axis=1)
        return fn(shard(cut(hidden), BTD), cut(targets), cut(m))

    ce, z = jax.lax.map(one, jnp.arange(chunks))
    return jnp.sum(ce), jnp.sum(z)


def loss_sums(
    params, cfg: ModelConfig, z_loss_multiplier: float, batch: dict, *, shard: ActivationSharding = UNSHARDED
) -> tuple[jax.Array, dict]:
    """Objective summed over the batch's tokens (not averaged), so micro-steps add up exactly; `shard` pins
    the model's activations to the mesh."""
    hidden, aux_loss = qwen3.forward(
        params, cfg, batch["inputs"], batch["positions"], batch["segment_ids"], shard=shard
    )
    ce, z = token_losses(
        output_params(params, cfg, shard), cfg, hidden, batch["targets"], batch["loss_mask"], shard=shard
    )
    tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    objective = ce + z_loss_multiplier * z
    return objective, {"ce_sum": ce, "z_sum": z, "tokens": tokens, "aux_loss": aux_loss}


def _split_micro(batch: dict, n: int) -> dict:
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)


def _replicas(shard: ActivationSharding) -> int:
    return shard.mesh.shape.get(DATA, 1) if shard.mesh is not None else 1


def per_replica(fn: Callable, shard: ActivationSharding, combine: Callable) -> Callable:
    """`(params, batch) -> combine(fn(params, batch, shard))`, run per data-parallel replica.

    With a data axis over several devices the body is a `shard_map` manual over that axis: each replica
    sees its own rows of the batch and a replicated copy of the params, the compiler partitions the rest
    of the mesh (fsdp, tensor, expert) inside it, and only what `combine` sends (its psums) crosses the
    data axis, which spans the slices (the DCN). With one replica it is `fn` as is."""
    if _replicas(shard) == 1:
        return lambda params, batch: fn(params, batch, shard)
    inner = shard.within((DATA,))
    return jax.shard_map(
        lambda params, batch: combine(fn(params, batch, inner)),
        mesh=shard.mesh,
        in_specs=(PartitionSpec(), PartitionSpec(DATA)),
        out_specs=PartitionSpec(),
        axis_names={DATA},
        check_vma=False,  # the splash kernel's own shard_map inside does not track varying axes
    )


def _summed_grads(cfg: ModelConfig, z_loss_multiplier: float, micro_steps: int, batch_spec):
    """`(params, batch, shard) -> (grads, parts)`: gradients of the token-summed objective over the
    batch's micro-steps (not yet divided by the token count) and its summed parts; the train step and
    the silent-data-corruption check (`make_replica_checksums`) compute exactly this."""

    def micro_grads(params, micro, shard):
        if batch_spec is not None:
            micro = {k: shard.pin(v, batch_spec) for k, v in micro.items()}

        def objective(p):
            total, parts = loss_sums(p, cfg, z_loss_multiplier, micro, shard=shard)
            return total + parts["aux_loss"] * parts["tokens"], parts

        (_, parts), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return grads, parts

    def summed_grads(params, batch, shard):
        if micro_steps == 1:
            return micro_grads(params, batch, shard)

        def body(acc, micro):
            g, p = micro_grads(params, micro, shard)
            return jax.tree.map(jnp.add, acc, (g, p)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        scalar = jnp.zeros((), jnp.float32)
        init = (zeros, {"ce_sum": scalar, "z_sum": scalar, "tokens": scalar, "aux_loss": scalar})
        (grads, parts), _ = jax.lax.scan(body, init, _split_micro(batch, micro_steps))
        return grads, dict(parts, aux_loss=parts["aux_loss"] / micro_steps)

    return summed_grads


def make_train_step(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    *,
    z_loss_multiplier: float,
    micro_steps: int,
    batch_spec: PartitionSpec | None = None,
    learning_rate: optax.Schedule | None = None,
    shard: ActivationSharding = UNSHARDED,
    data_reduce_dtype: str = "float32",
):
    """Build `train_step(state, batch)`.

    The global batch is split into `micro_steps` equal parts run in a scan; gradients of the token-summed
    objective are accumulated and divided once by the total token count, so k micro-steps give the same
    update as one k-times larger batch. The MoE aux loss is averaged over micro-steps.
    `batch_spec` pins each micro-batch's sharding and `shard` the model's activations (the caller knows
    the mesh).

    With a data axis over several devices (slices are data-parallel replicas), each replica computes and
    accumulates its gradients in a `shard_map` manual over the data axis, and they are summed across
    replicas once per step, in `data_reduce_dtype`: nothing but that gradient reduction crosses the
    data axis (the DCN between slices), whatever the compiler would choose.
    `learning_rate`, the optimizer's schedule, adds the rate this update used to the metrics: computed
    inside the compiled step, since evaluating an optax schedule eagerly on the host compiles each of
    its ~12 jnp ops on first use (~1 s in every new process).
    """

    summed_grads = _summed_grads(cfg, z_loss_multiplier, micro_steps, batch_spec)
    replicas = _replicas(shard)
    # XLA:CPU aborts on a bfloat16 all-reduce in a shard_map; CPU slices are emulated (no DCN).
    cpu = shard.mesh is not None and shard.mesh.devices.flat[0].platform == "cpu"
    reduce_dtype = jnp.dtype("float32" if cpu else data_reduce_dtype)

    def sum_replicas(out):
        grads, parts = out
        grads = jax.tree.map(lambda g: jax.lax.psum(g.astype(reduce_dtype), DATA).astype(g.dtype), grads)
        return grads, jax.lax.psum(dict(parts, aux_loss=parts["aux_loss"] / replicas), DATA)

    gradients = per_replica(summed_grads, shard, sum_replicas)

    def train_step(state: dict[str, Any], batch: dict) -> tuple[dict[str, Any], dict]:
        params = state["params"]
        grads, parts = gradients(params, batch)
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
    batch_spec: PartitionSpec | None = None,
    shard: ActivationSharding = UNSHARDED,
):
    """Build `eval_step(params, batch) -> {"ce_sum", "tokens"}`: the forward pass only (no gradient, no
    z-loss, no update), summed over the batch's loss-masked tokens, so the caller adds batches up exactly
    and divides once. The loss mask is the batch's own (assistant tokens only under SFT).

    `micro_steps` splits the batch into equal parts run in a scan: the eval batch is the same size on
    every mesh (the same tokens at every evaluation), so a smaller mesh runs it in more parts.
    """

    def sums(params, batch, shard):
        if batch_spec is not None:
            batch = {k: shard.pin(v, batch_spec) for k, v in batch.items()}
        _, parts = loss_sums(params, cfg, 0.0, batch, shard=shard)
        return {"ce_sum": parts["ce_sum"], "tokens": parts["tokens"]}

    def summed(params, batch, shard):
        if micro_steps == 1:
            return sums(params, batch, shard)

        def body(acc, micro):
            return jax.tree.map(jnp.add, acc, sums(params, micro, shard)), None

        zero = jnp.zeros((), jnp.float32)
        out, _ = jax.lax.scan(body, {"ce_sum": zero, "tokens": zero}, _split_micro(batch, micro_steps))
        return out

    replicated = per_replica(summed, shard, lambda out: jax.lax.psum(out, DATA))

    def eval_step(params, batch: dict) -> dict:
        return replicated(params, batch)

    return eval_step


def make_replica_checksums(
    cfg: ModelConfig,
    *,
    z_loss_multiplier: float,
    micro_steps: int,
    batch_spec: PartitionSpec | None = None,
    shard: ActivationSharding = UNSHARDED,
):
    """Build `checksums(params, batch) -> float32 [replicas, 3 + leaves]`: what each data-parallel replica
    computes of a train step on its own rows, before the gradients are summed across replicas: its
    objective's parts (ce, z, tokens) and the sum of each gradient leaf.

    The same computation (`_summed_grads`) as the train step, per replica and without the reduction, so
    two runs of it on the same rows are bitwise equal on healthy devices wherever they run: the
    silent-data-corruption check (trainer.runtime.sdc) compares them with the rows moved to other slices."""
    summed_grads = _summed_grads(cfg, z_loss_multiplier, micro_steps, batch_spec)

    def checksums(out):
        grads, parts = out
        sums = [jnp.sum(g.astype(jnp.float32)) for g in jax.tree.leaves(grads)]
        row = jnp.stack([parts["ce_sum"], parts["z_sum"], parts["tokens"], *sums]).astype(jnp.float32)
        return jax.lax.all_gather(row, DATA) if _replicas(shard) > 1 else row[None]

    if _replicas(shard) == 1:
        return lambda params, batch: checksums(summed_grads(params, batch, shard))
    return per_replica(summed_grads, shard, checksums)
