"""Direct preference optimization: the per-pair losses and metrics, as TRL's DPOTrainer defines them.

A batch under `objective=dpo` holds pairs: row 2k is prompt + chosen reply and row 2k + 1 prompt + rejected
reply of pair k, loss-masked on the reply. The inputs here are per-row sums of the reply tokens'
log-probabilities (`trainer.program.step.sequence_logps`) under the policy and under the frozen reference,
and the reply token counts. With the log-ratio h = (policy_chosen - policy_rejected) - (ref_chosen -
ref_rejected) and beta = dpo_beta:

  sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps = dpo_label_smoothing)
  hinge    max(0, 1 - beta h)
  ipo      (h - 1 / (2 beta))^2, over log-probabilities averaged over each reply's tokens (as TRL does)

Metrics (TRL's names): rewards/chosen = beta (policy_chosen - ref_chosen), rewards/rejected likewise,
rewards/accuracies = [chosen reward > rejected reward], rewards/margins = their difference,
logps/chosen and logps/rejected = the policy's log-probabilities (ipo: per-token averages, like TRL).
Everything is returned as sums over pairs, so micro-steps and replicas add up exactly and the caller
divides once by the pair count. A pair counts only when both of its rows have reply tokens: the padding
pairs of a data stream that has run out (held-out evaluation's last batches) and a pair whose reply
truncation cut entirely add nothing to the loss, its gradient, the metrics or the count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.config.schema import PreferenceConfig

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
# The metrics' names as TRL logs them; each is a mean over pairs.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def pair_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) halves of a per-row [2P] array laid out as rows 2k (chosen), 2k + 1 (rejected)."""
    pairs = x.reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def pair_losses(logratios: jax.Array, cfg: PreferenceConfig) -> jax.Array:
    """Per-pair loss [P] of the log-ratio h (module doc), for `cfg.dpo_loss_type`."""
    beta = cfg.dpo_beta
    if cfg.dpo_loss_type == "sigmoid":
        eps = cfg.dpo_label_smoothing
        return -jax.nn.log_sigmoid(beta * logratios) * (1 - eps) - jax.nn.log_sigmoid(-beta * logratios) * eps
    if cfg.dpo_loss_type == "hinge":
        return jax.nn.relu(1 - beta * logratios)
    if cfg.dpo_loss_type == "ipo":
        return jnp.square(logratios - 1 / (2 * beta))
    raise ValueError(f"dpo_loss_type={cfg.dpo_loss_type!r}: one of {', '.join(LOSS_TYPES)}")


def preference_sums(
    policy_logps: jax.Array, reference_logps: jax.Array, tokens: jax.Array, cfg: PreferenceConfig
) -> tuple[jax.Array, dict]:
    """(loss summed over pairs, {metric: sum over pairs} | {"pairs"}) of per-row reply log-prob sums [2P]
    under the policy and the reference, with `tokens` [2P] the reply tokens of each row. The reference's
    log-probabilities carry no gradient."""
    reference_logps = jax.lax.stop_gradient(reference_logps)
    if cfg.dpo_loss_type == "ipo":  # TRL's IPO compares log-probabilities averaged over each reply
        per_token = jnp.maximum(tokens, 1.0)
        ratio_logps, ratio_ref = policy_logps / per_token, reference_logps / per_token
    else:
        ratio_logps, ratio_ref = policy_logps, reference_logps
    pc, pr = pair_rows(ratio_logps)
    rc, rr = pair_rows(ratio_ref)
    tc, tr = pair_rows(tokens)
    counted = ((tc > 0) & (tr > 0)).astype(jnp.float32)  # both replies present (module doc)
    losses = jnp.where(counted > 0, pair_losses((pc - pr) - (rc - rr), cfg), 0.0)
    chosen = jax.lax.stop_gradient(cfg.dpo_beta * (pc - rc)) * counted
    rejected = jax.lax.stop_gradient(cfg.dpo_beta * (pr - rr)) * counted
    metrics = {
        "rewards/chosen": jnp.sum(chosen),
        "rewards/rejected": jnp.sum(rejected),
        "rewards/accuracies": jnp.sum((chosen > rejected).astype(jnp.float32) * counted),
        "rewards/margins": jnp.sum(chosen - rejected),
        "logps/chosen": jnp.sum(jax.lax.stop_gradient(pc) * counted),
        "logps/rejected": jnp.sum(jax.lax.stop_gradient(pr) * counted),
        "pairs": jnp.sum(counted),
    }
    return jnp.sum(losses), metrics
