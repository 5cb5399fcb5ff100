"""The pure train step: loss, gradients (with micro-step accumulation), optimizer update, metrics.

`train_step(state, batch) -> (state, metrics)`; state is {"step", "params", "opt_state"}; metrics are
device arrays that the loop reads one step late. No logging, host syncs or globals in here.

With LoRA on (`lora` given, lora_rank > 0) the state's params are the adapters and every step function
takes the frozen base as one more argument, `train_step(state, batch, base)`: the model runs with
`trainer.model.lora.merge(base, adapters)`, computed one decoder layer at a time inside the layers' scan
(`trainer.model.lora.layer_adapter`), gradients and optimizer updates reach the adapters only, and
the base is neither donated nor returned.

With `objective=dpo` (`preference` given) the batch's rows 2k and 2k + 1 are a preference pair, the
objective is the DPO loss over pairs (`trainer.program.preference`) of per-row reply log-probabilities
(`sequence_logps`), and the frozen model the step takes is the reference: `train_step(state, batch,
reference)` (under LoRA the base, whose unadapted log-probabilities are the reference's).
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

from trainer import model
from trainer.config.schema import LoraConfig, ModelConfig, PreferenceConfig
from trainer.model import lora as lora_math
from trainer.model.layers import BTD
from trainer.parallel.activations import UNSHARDED, ActivationSharding, axes_of
from trainer.parallel.context import context_shards, reorder, zigzag_order
from trainer.program import preference as preference_math

BATCH = ("activation_batch",)
LENGTH = ("activation_length",)
DATA = "data"  # the mesh axis of data-parallel replicas (slices x ici_data_parallelism)
VOCAB = ("activation_vocab",)

# Logits are computed for at most this many tokens per device at once: 256 x 151936 x 4 B ~ 156 MB of
# float32 logits per device at most (~34 MB for a 32k vocab), next to their gradient in the compute dtype.
# No chunk's logits outlive its iteration.
LOSS_CHUNK_TOKENS = 256


def _logits_layout(
    shard: ActivationSharding, rows: int, vocab: int, length: int = 1
) -> tuple[PartitionSpec, PartitionSpec]:
    """(hidden [B, c, D] spec, logits [B, c, V] spec) of the vocabulary-parallel loss; a chunk of
    `length` tokens stays split over the context axis (`activation_length`) as the model left it.

    The vocabulary is split over the mesh axes `activation_vocab` gives (tensor and fsdp by default),
    the batch rows over the batch axes left: each device computes the logits of every row of its group
    for its slice of the vocabulary, from the hidden states gathered over those axes. What crosses
    devices is activation-sized (the hidden states, the log-sum-exp's partial max and sum per token, the
    hidden states' gradient), never the [V, D] output projection or a [tokens, V] partial sum, and the
    projection's gradient stays on the device that holds its rows."""
    v = shard.spec(VOCAB, (vocab,))[0]
    b = shard.spec(BATCH, (rows,), skip=axes_of(v))[0]
    t = shard.spec(LENGTH, (length,), skip=(*axes_of(v), *axes_of(b)))[0]
    return PartitionSpec(b, t, None), PartitionSpec(b, t, v)


def _chunk_loss_and_grads(
    proj, cfg: ModelConfig, shard: ActivationSharding, z_loss_multiplier, hidden, targets, mask
):
    """(ce sum, z sum, d objective / d proj, d objective / d hidden) of a [B, c, D] chunk,
    vocabulary-parallel (`_logits_layout`), objective = ce + z_loss_multiplier * z.

    The logits' gradient is known once the log-sum-exp is: (1 + 2 z lse) softmax - onehot per masked
    token. It is pulled back through the projection right here, so the chunk's logits die with the
    chunk: nothing [tokens, V] is kept for the backward pass and nothing is computed twice."""
    dt = jnp.dtype(cfg.dtype)
    if shard.mesh is None:
        hidden_spec = logits_spec = None
    else:
        hidden_spec, logits_spec = _logits_layout(shard, hidden.shape[0], cfg.vocab_size, hidden.shape[1])

    h = hidden.astype(dt)  # gathered in the compute dtype
    h = h if hidden_spec is None else shard.pin(h, hidden_spec)
    pin = (lambda x: x) if logits_spec is None else partial(shard.pin, spec=logits_spec)
    logits = pin(model.logits_from_hidden(proj, cfg, h))  # float32 [B, c, V]
    top = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    lse = (jnp.log(total) + top)[..., 0]
    d_logits = (e / total) * (mask * (1.0 + 2.0 * z_loss_multiplier * lse))[..., None]  # the softmax's part
    if logits_spec is not None and logits_spec[2] is not None:
        # The vocabulary is split: the target's logit as a masked sum over it, a reduction over the split
        # dim (gathering the targets' rows of the split projection costs more than the step's largest
        # ICI all-gather on TPU). The one-hot is arithmetic, max(0, 1 - |v - target|) (exact while the
        # vocabulary is below 2^24), which XLA:CPU fuses into the reduction; a compare-and-select it
        # writes out first (17 ms against 4 for 512 tokens x 16k vocab on one core).
        vocab = jax.lax.broadcasted_iota(jnp.float32, logits.shape, 2)
        hit = jnp.maximum(0.0, 1.0 - jnp.abs(vocab - targets[..., None].astype(jnp.float32)))
        target_logit = jnp.sum(logits * hit, axis=-1)
        d_logits = d_logits - hit * mask[..., None]
        d_proj, d_hidden = model.logits_pullback(proj, cfg, h, pin(d_logits))
    else:
        # The whole vocabulary is here: the target's logit, and the "- onehot" of its gradient, through
        # the target's row of the projection, a local gather, without another pass over the logits.
        rows, pull_rows = jax.vjp(lambda p: model.output_rows(p, cfg, targets), proj)
        target_logit = jnp.einsum("bcd,bcd->bc", h, rows, preferred_element_type=jnp.float32)
        d_proj, d_hidden = model.logits_pullback(proj, cfg, h, pin(d_logits))
        minus = -mask[..., None]
        (d_target_rows,) = pull_rows((minus * h).astype(rows.dtype))
        d_proj = jax.tree.map(jnp.add, d_proj, d_target_rows)
        d_hidden = d_hidden + (minus * rows).astype(d_hidden.dtype)
    return jnp.sum((lse - target_logit) * mask), jnp.sum(jnp.square(lse) * mask), d_proj, d_hidden


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


def token_losses(
    params,
    cfg: ModelConfig,
    hidden,
    targets,
    mask,
    *,
    z_loss_multiplier: float = 0.0,
    shard: ActivationSharding = UNSHARDED,
):
    """(objective, ce sum, z sum) over the masked tokens, in float32: cross-entropy, log(Z)^2 and
    objective = ce + z_loss_multiplier * z. `params` holds the output projection (`output_params`).

    The logits are vocabulary-parallel (`_logits_layout`), computed a chunk of the sequence at a time (a
    device holds at most as many logits at once as LOSS_CHUNK_TOKENS tokens have over the whole
    vocabulary), and the objective's gradient is computed with them in the forward pass
    (`_chunk_loss_and_grads`): the backward pass only scales the kept gradients of the projection and of
    the hidden states, so the logits are neither kept nor computed a second time (three
    [tokens, V, D] matmuls per chunk, not four). Only the objective is differentiable; ce and z are
    reported as they are.

    Under context parallelism (the sequence split N ways) chunk i takes the i-th piece of every
    device's shard of the sequence, so a chunk stays split like the sequence and nothing is gathered.
    """
    b, t = targets.shape
    ways = context_shards(shard)
    chunks = _sequence_chunks(_rows_per_device(shard, b, cfg.vocab_size), t // ways)
    piece = t // (ways * chunks)

    def cut(x, i):  # [B, T, ...] -> chunk i [B, ways * piece, ...]
        split = x.reshape(b, ways, chunks, piece, *x.shape[2:])
        return jax.lax.dynamic_index_in_dim(split, i, axis=2, keepdims=False).reshape(
            b, ways * piece, *x.shape[2:]
        )

    one = partial(_chunk_loss_and_grads, cfg=cfg, shard=shard, z_loss_multiplier=z_loss_multiplier)

    def forward(proj, hidden, targets, m):
        if chunks == 1:
            ce, z, d_proj, d_hidden = one(proj, hidden=hidden, targets=targets, mask=m)
            d_hidden = shard(d_hidden, BTD)  # reduced over the vocabulary's axes into the model's layout
        else:

            def body(acc, i):
                ce, z, dp, dh = one(
                    proj, hidden=shard(cut(hidden, i), BTD), targets=cut(targets, i), mask=cut(m, i)
                )
                return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, (ce, z, dp)), shard(dh, BTD)

            zero = jnp.zeros((), jnp.float32)
            init = (zero, zero, jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), proj))
            (ce, z, d_proj), d_hidden = jax.lax.scan(body, init, jnp.arange(chunks))
            d_hidden = d_hidden.reshape(chunks, b, ways, piece, hidden.shape[2])  # back to cut's inverse
            d_hidden = shard(d_hidden.transpose(1, 2, 0, 3, 4).reshape(hidden.shape), BTD)
            d_proj = jax.tree.map(lambda d, p: d.astype(p.dtype), d_proj, proj)
        return (ce + z_loss_multiplier * z, ce, z), (d_proj, d_hidden.astype(hidden.dtype))

    @jax.custom_vjp
    def losses(proj, hidden, targets, m):
        return forward(proj, hidden, targets, m)[0]

    def backward(kept, cotangents):
        (d_proj, d_hidden), g = kept, cotangents[0]  # ce and z leave as stop_gradient: no cotangent
        scale = lambda d: (d * g).astype(d.dtype)  # noqa: E731
        return jax.tree.map(scale, d_proj), scale(d_hidden), None, None

    losses.defvjp(forward, backward)
    objective, ce, z = losses(params, hidden, targets, mask.astype(jnp.float32))
    return objective, jax.lax.stop_gradient(ce), jax.lax.stop_gradient(z)


def _chunk_logps(proj, cfg: ModelConfig, shard: ActivationSharding, hidden, targets, mask):
    """Per-row sum [B] of the masked targets' log-probabilities of a [B, c, D] chunk, vocabulary-parallel
    (`_logits_layout`) like `_chunk_loss_and_grads`."""
    dt = jnp.dtype(cfg.dtype)
    if shard.mesh is None:
        hidden_spec = logits_spec = None
    else:
        hidden_spec, logits_spec = _logits_layout(shard, hidden.shape[0], cfg.vocab_size, hidden.shape[1])
    h = hidden.astype(dt)
    h = h if hidden_spec is None else shard.pin(h, hidden_spec)
    logits = model.logits_from_hidden(proj, cfg, h)  # float32 [B, c, V]
    logits = logits if logits_spec is None else shard.pin(logits, logits_spec)
    lse = jax.nn.logsumexp(logits, axis=-1)
    if logits_spec is not None and logits_spec[2] is not None:  # split vocabulary: a masked sum over it
        vocab = jax.lax.broadcasted_iota(jnp.float32, logits.shape, 2)
        hit = jnp.maximum(0.0, 1.0 - jnp.abs(vocab - targets[..., None].astype(jnp.float32)))
        target_logit = jnp.sum(logits * hit, axis=-1)
    else:
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((target_logit - lse) * mask, axis=1)


def sequence_logps(
    params, cfg: ModelConfig, hidden, targets, mask, *, shard: ActivationSharding = UNSHARDED
) -> jax.Array:
    """Per-row sum [B] (float32) of the log-probabilities of the masked targets: a preference pair's reply
    log-probability under the model (objective=dpo). `params` holds the output projection
    (`output_params`).

    The same chunked, vocabulary-parallel logits as `token_losses` (at most LOSS_CHUNK_TOKENS tokens'
    logits per device at once, split like the sequence under context parallelism), differentiated by JAX:
    each chunk is rematerialised in the backward pass, so no chunk's logits outlive its iteration."""
    b, t = targets.shape
    ways = context_shards(shard)
    chunks = _sequence_chunks(_rows_per_device(shard, b, cfg.vocab_size), t // ways)
    piece = t // (ways * chunks)
    mask = mask.astype(jnp.float32)
    one = jax.checkpoint(partial(_chunk_logps, cfg=cfg, shard=shard))
    if chunks == 1:
        return one(params, hidden=hidden, targets=targets, mask=mask)

    def cut(x, i):
        split = x.reshape(b, ways, chunks, piece, *x.shape[2:])
        return jax.lax.dynamic_index_in_dim(split, i, axis=2, keepdims=False).reshape(
            b, ways * piece, *x.shape[2:]
        )

    def body(acc, i):
        part = one(params, hidden=shard(cut(hidden, i), BTD), targets=cut(targets, i), mask=cut(mask, i))
        return acc + part, None

    out, _ = jax.lax.scan(body, jnp.zeros((b,), jnp.float32), jnp.arange(chunks))
    return out


def row_logps(params, cfg: ModelConfig, batch: dict, *, shard: ActivationSharding = UNSHARDED, layers=None):
    """(per-row reply log-probability sums [B], MoE aux loss) of `params` (with `layers`: `loss_sums`) on a
    batch (`sequence_logps`); under context parallelism the tokens are put in the zigzag order first, which
    the sums do not see."""
    shards = context_shards(shard)
    if shards > 1:
        batch = reorder(batch, zigzag_order(batch["inputs"].shape[1], shards))
    hidden, aux_loss = model.forward(
        params, cfg, batch["inputs"], batch["positions"], batch["segment_ids"], shard=shard, layers=layers
    )
    logps = sequence_logps(
        output_params(params, cfg, shard), cfg, hidden, batch["targets"], batch["loss_mask"], shard=shard
    )
    return logps, aux_loss


def preference_loss_sums(
    policy, reference, cfg: ModelConfig, pref: PreferenceConfig, batch: dict, *, shard=UNSHARDED, layers=None
) -> tuple[jax.Array, dict]:
    """DPO loss summed over the batch's pairs (rows 2k, 2k + 1: `trainer.program.preference`) of the
    `policy` params (with `layers`, the policy's per-layer adapter: `loss_sums`) against the frozen
    `reference` params (no gradient through them), and its parts:
    ce_sum = the loss sum (what the loop reports as loss, divided by `pairs`), z_sum = 0, tokens (the
    reply tokens), aux_loss, pairs and the TRL metrics' sums."""
    policy_logps, aux_loss = row_logps(policy, cfg, batch, shard=shard, layers=layers)
    reference_logps, _ = row_logps(jax.lax.stop_gradient(reference), cfg, batch, shard=shard)
    tokens_per_row = jnp.sum(batch["loss_mask"].astype(jnp.float32), axis=1)
    loss, metrics = preference_math.preference_sums(policy_logps, reference_logps, tokens_per_row, pref)
    parts = {"ce_sum": loss, "z_sum": jnp.zeros((), jnp.float32), "tokens": jnp.sum(tokens_per_row)}
    return loss, {**parts, "aux_loss": aux_loss, **metrics}


def loss_sums(
    params,
    cfg: ModelConfig,
    z_loss_multiplier: float,
    batch: dict,
    *,
    shard: ActivationSharding = UNSHARDED,
    layers=None,
) -> tuple[jax.Array, dict]:
    """Objective summed over the batch's tokens (not averaged), so micro-steps add up exactly; `shard` pins
    the model's activations to the mesh; `layers` transforms each decoder block's params inside it
    (`trainer.model.forward`; LoRA's per-layer merge, `model_weights`). Under context parallelism the
    tokens are first put in the zigzag order over the context axis (trainer/parallel/context.py); the sums
    do not depend on it."""
    shards = context_shards(shard)
    if shards > 1:
        batch = reorder(batch, zigzag_order(batch["inputs"].shape[1], shards))
    hidden, aux_loss = model.forward(
        params, cfg, batch["inputs"], batch["positions"], batch["segment_ids"], shard=shard, layers=layers
    )
    objective, ce, z = token_losses(
        output_params(params, cfg, shard),
        cfg,
        hidden,
        batch["targets"],
        batch["loss_mask"],
        z_loss_multiplier=z_loss_multiplier,
        shard=shard,
    )
    tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    return objective, {"ce_sum": ce, "z_sum": z, "tokens": tokens, "aux_loss": aux_loss}


def model_weights(cfg: ModelConfig, lora: LoraConfig | None) -> Callable:
    """`(trainable, frozen) -> (params, layers)`, what the model runs with (`loss_sums`' params and
    `layers`): the trainable params themselves and no layer adapter, or with LoRA on the frozen base and
    the trainable adapters merged into it one decoder layer at a time (`lora.layer_adapter`: the model
    computes `lora.merge(base, adapters)` without ever holding every layer's merged weights at once)."""
    if not lora_math.enabled(lora):
        return lambda trainable, frozen: (trainable, None)
    return lambda trainable, frozen: (frozen, lora_math.layer_adapter(trainable, lora))


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


def _interleave(batch: dict, micro_steps: int, replicas: int) -> dict:
    """The global batch's rows reordered so that replica r's m-th micro-step (its m-th block of its
    contiguous share) holds the batch's group m * replicas + r, the groups being equal runs of rows."""

    def one(x):
        groups = x.reshape(micro_steps, replicas, x.shape[0] // (micro_steps * replicas), *x.shape[1:])
        return groups.swapaxes(0, 1).reshape(x.shape)

    return jax.tree.map(one, batch)


def _add_row(r: int, total, every):
    return total + every[r].astype(total.dtype)


def ordered_sums(group_sums: Callable, zeros: Callable, shard: ActivationSharding, micro_steps: int) -> Callable:
    """`(params, batch) -> the sum over the batch's groups of group_sums(params, group, shard), added in the
    groups' order`: the batch is micro_steps x replicas equal groups of rows (`_interleave` hands group
    m * replicas + r to replica r's m-th micro-step), and after each micro-step every replica all-gathers
    the replicas' results and adds them, in replica order, to its running total, which starts at
    `zeros(params)`.

    A group's result is computed by the same program on the same rows whichever replica runs it, and the
    additions happen in the same order, so the total has the same bits on any number of replicas (each
    holding the same total). What crosses the data axis is every replica's result, not one reduced sum."""
    replicas = _replicas(shard)

    def body(params, rows, inner):
        def add(total, group):
            # Barriers keep the compiler from fusing the group's computation with the gathering and adding
            # around it, which differ with the replica count: the group's program is then the same on all.
            out = jax.lax.optimization_barrier(group_sums(params, jax.lax.optimization_barrier(group), inner))
            if inner.mesh is None or replicas == 1:
                every = jax.tree.map(lambda x: x[None], out)
            else:
                every = jax.lax.all_gather(out, DATA)
            for r in range(replicas):
                total = jax.tree.map(partial(_add_row, r), total, every)
            return total, None

        total, _ = jax.lax.scan(add, zeros(params), _split_micro(rows, micro_steps))
        return total

    if shard.mesh is None:
        return lambda params, batch: body(params, batch, shard)
    # Manual over the data axis even with one replica: the program around a group is the same on every count.
    mapped = jax.shard_map(
        partial(body, inner=shard.within((DATA,))),
        mesh=shard.mesh,
        in_specs=(PartitionSpec(), PartitionSpec(DATA)),
        out_specs=PartitionSpec(),
        axis_names={DATA},
        check_vma=False,
    )
    return lambda params, batch: mapped(params, _interleave(batch, micro_steps, replicas))


def _objective_sums(cfg: ModelConfig, z_loss_multiplier: float, weights: Callable, pref: PreferenceConfig | None):
    """`(trainable, frozen, batch, shard) -> (objective sum, parts)`: the token-summed language-model loss
    (`loss_sums`), or with `pref` (objective=dpo) the pair-summed DPO loss of the policy
    `weights(trainable, frozen)` against the reference `frozen` (`preference_loss_sums`); the MoE aux loss
    is added once per token (per pair under DPO), so the division by that count averages it."""
    if pref is None:

        def lm(trainable, frozen, batch, shard):
            params, layers = weights(trainable, frozen)
            total, parts = loss_sums(params, cfg, z_loss_multiplier, batch, shard=shard, layers=layers)
            return total + parts["aux_loss"] * parts["tokens"], parts

        return lm

    def dpo(trainable, frozen, batch, shard):
        params, layers = weights(trainable, frozen)
        total, parts = preference_loss_sums(params, frozen, cfg, pref, batch, shard=shard, layers=layers)
        return total + parts["aux_loss"] * parts["pairs"], parts

    return dpo


def _zero_parts(pref: PreferenceConfig | None) -> dict:
    scalar = jnp.zeros((), jnp.float32)
    keys = ("ce_sum", "z_sum", "tokens", "aux_loss", *((*preference_math.METRICS, "pairs") if pref else ()))
    return dict.fromkeys(keys, scalar)


def _summed_grads(
    cfg: ModelConfig,
    z_loss_multiplier: float,
    micro_steps: int,
    batch_spec,
    weights: Callable,
    pref: PreferenceConfig | None = None,
):
    """`((trainable, frozen), batch, shard) -> (grads, parts)`: gradients, with respect to the trainable
    params only, of the summed objective (`_objective_sums`) over the batch's micro-steps (not yet divided
    by the token or pair count) and its summed parts; `weights(trainable, frozen)` gives the params the
    model runs with (`model_weights`). The train step and the silent-data-corruption check
    (`make_replica_checksums`) compute exactly this."""
    objective_sums = _objective_sums(cfg, z_loss_multiplier, weights, pref)

    def micro_grads(params, micro, shard):
        trainable, frozen = params
        if batch_spec is not None:
            micro = {k: shard.pin(v, batch_spec) for k, v in micro.items()}

        def objective(p):
            return objective_sums(p, frozen, micro, shard)

        (_, parts), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
        return grads, parts

    def summed_grads(params, batch, shard):
        if micro_steps == 1:
            return micro_grads(params, batch, shard)

        def body(acc, micro):
            g, p = micro_grads(params, micro, shard)
            return jax.tree.map(jnp.add, acc, (g, p)), None

        zeros = jax.tree.map(jnp.zeros_like, params[0])
        init = (zeros, _zero_parts(pref))
        (grads, parts), _ = jax.lax.scan(body, init, _split_micro(batch, micro_steps))
        return grads, dict(parts, aux_loss=parts["aux_loss"] / micro_steps)

    return summed_grads


def _replica_gradients(
    cfg: ModelConfig,
    z_loss_multiplier: float,
    micro_steps: int,
    batch_spec,
    shard: ActivationSharding,
    data_reduce_dtype: str,
    lora: LoraConfig | None,
    preference: PreferenceConfig | None,
) -> Callable:
    """`(params, batch) -> (grads, parts)` summed over the batch: each replica sums its own rows'
    (`per_replica`), then the replicas' sums are all-reduced in `data_reduce_dtype`."""
    summed_grads = _summed_grads(
        cfg, z_loss_multiplier, micro_steps, batch_spec, model_weights(cfg, lora), preference
    )
    replicas = _replicas(shard)
    # XLA:CPU aborts on a bfloat16 all-reduce in a shard_map; CPU slices are emulated (no DCN).
    cpu = shard.mesh is not None and shard.mesh.devices.flat[0].platform == "cpu"
    reduce_dtype = jnp.dtype("float32" if cpu else data_reduce_dtype)

    def sum_replicas(out):
        grads, parts = out
        grads = jax.tree.map(lambda g: jax.lax.psum(g.astype(reduce_dtype), DATA).astype(g.dtype), grads)
        return grads, jax.lax.psum(dict(parts, aux_loss=parts["aux_loss"] / replicas), DATA)

    return per_replica(summed_grads, shard, sum_replicas)


def make_train_step(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    *,
    z_loss_multiplier: float,
    micro_steps: int,
    ordered_groups: int = 0,
    batch_spec: PartitionSpec | None = None,
    learning_rate: optax.Schedule | None = None,
    shard: ActivationSharding = UNSHARDED,
    data_reduce_dtype: str = "float32",
    lora: LoraConfig | None = None,
    preference: PreferenceConfig | None = None,
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
    `lora` (lora_rank > 0): the state's params are adapters over the `base` the step takes (module doc).
    `preference` (objective=dpo): the objective is the DPO loss averaged over the batch's pairs, against
    the frozen reference the step takes as `base` (under LoRA the base itself, without adapters), and
    the metrics add TRL's rewards/* and logps/* (pair means).
    `ordered_groups` > 0 (elastic_resize_bitwise): the global batch is that many groups of rows, each
    replica running `micro_steps` of them, and their gradients and sums are added in the groups' order
    (`ordered_sums`) instead of per replica and then all-reduced: the update has the same bits on any
    number of replicas.
    """

    if ordered_groups:
        group_grads = _summed_grads(cfg, z_loss_multiplier, 1, batch_spec, model_weights(cfg, lora), preference)

        def zeros(params):
            return jax.tree.map(jnp.zeros_like, params[0]), _zero_parts(preference)

        ordered = ordered_sums(group_grads, zeros, shard, micro_steps)

        def gradients(params, batch):
            grads, parts = ordered(params, batch)
            return grads, dict(parts, aux_loss=parts["aux_loss"] / ordered_groups)

    else:
        gradients = _replica_gradients(
            cfg, z_loss_multiplier, micro_steps, batch_spec, shard, data_reduce_dtype, lora, preference
        )

    def train_step(state: dict[str, Any], batch: dict, base=None) -> tuple[dict[str, Any], dict]:

        params = state["params"]
        grads, parts = gradients((params, base), batch)
        denom = jnp.maximum(parts["pairs" if preference else "tokens"], 1.0)
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
            **{k: parts[k] / denom for k in (preference_math.METRICS if preference else ())},
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
    lora: LoraConfig | None = None,
    preference: PreferenceConfig | None = None,
):
    """Build `eval_step(params, batch) -> {"ce_sum", "tokens"}` (with LoRA on, `eval_step(adapters, batch,
    base)`): the forward pass only (no gradient, no
    z-loss, no update), summed over the batch's loss-masked tokens, so the caller adds batches up exactly
    and divides once. The loss mask is the batch's own (assistant tokens only under SFT).

    `micro_steps` splits the batch into equal parts run in a scan: the eval batch is the same size on
    every mesh (the same tokens at every evaluation), so a smaller mesh runs it in more parts.
    `preference` (objective=dpo): ce_sum is the DPO loss summed over pairs, with "pairs" and the sums of
    TRL's metrics (`trainer.program.preference.METRICS`) beside it, against the frozen reference `base`.
    """

    weights = model_weights(cfg, lora)
    keep = ("ce_sum", "tokens", *((*preference_math.METRICS, "pairs") if preference else ()))

    def sums(params, batch, shard):
        if batch_spec is not None:
            batch = {k: shard.pin(v, batch_spec) for k, v in batch.items()}
        trainable, frozen = params
        weights_, layers = weights(trainable, frozen)
        if preference is None:
            _, parts = loss_sums(weights_, cfg, 0.0, batch, shard=shard, layers=layers)
        else:
            _, parts = preference_loss_sums(weights_, frozen, cfg, preference, batch, shard=shard, layers=layers)
        return {k: parts[k] for k in keep}

    def summed(params, batch, shard):
        if micro_steps == 1:
            return sums(params, batch, shard)

        def body(acc, micro):
            return jax.tree.map(jnp.add, acc, sums(params, micro, shard)), None

        zero = jnp.zeros((), jnp.float32)
        out, _ = jax.lax.scan(body, dict.fromkeys(keep, zero), _split_micro(batch, micro_steps))
        return out

    replicated = per_replica(summed, shard, lambda out: jax.lax.psum(out, DATA))

    def eval_step(params, batch: dict, base=None) -> dict:
        return replicated((params, base), batch)

    return eval_step


def make_replica_checksums(
    cfg: ModelConfig,
    *,
    z_loss_multiplier: float,
    micro_steps: int,
    batch_spec: PartitionSpec | None = None,
    shard: ActivationSharding = UNSHARDED,
    lora: LoraConfig | None = None,
    preference: PreferenceConfig | None = None,
):
    """Build `checksums(params, batch) -> float32 [replicas, 3 + leaves]` (with LoRA on,
    `checksums(adapters, batch, base)`, the leaves the adapters'): what each data-parallel replica
    computes of a train step on its own rows, before the gradients are summed across replicas: its
    objective's parts (ce, z, tokens) and the sum of each gradient leaf.

    The same computation (`_summed_grads`) as the train step, per replica and without the reduction, so
    two runs of it on the same rows are bitwise equal on healthy devices wherever they run: the
    silent-data-corruption check (trainer.attempt.sdc) compares them with the rows moved to other slices.
    `preference`: the DPO objective, as in `make_train_step`."""
    summed_grads = _summed_grads(
        cfg, z_loss_multiplier, micro_steps, batch_spec, model_weights(cfg, lora), preference
    )

    def checksums(out):
        grads, parts = out
        sums = [jnp.sum(g.astype(jnp.float32)) for g in jax.tree.leaves(grads)]
        row = jnp.stack([parts["ce_sum"], parts["z_sum"], parts["tokens"], *sums]).astype(jnp.float32)
        return jax.lax.all_gather(row, DATA) if _replicas(shard) > 1 else row[None]

    if _replicas(shard) == 1:
        return lambda params, batch, base=None: checksums(summed_grads((params, base), batch, shard))
    replicated = per_replica(summed_grads, shard, checksums)
    return lambda params, batch, base=None: replicated((params, base), batch)
