"""The DPO loss against Hugging Face: two models exported with `trainer-to-hf` and loaded by transformers
(the policy and the reference) give, from transformers' float32 log-probabilities on the same pairs, the
loss and rewards this trainer computes (trainer.program.step.row_logps + trainer.program.preference)
within 1e-5, for each of TRL's loss types.

The `interop` tier (needs torch + transformers; `.ci/run` installs them and runs pytest -m interop).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.interop, pytest.mark.slow]

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
POLICY, REFERENCE = "dense_tied", "dense_untied_kv1"  # two Qwen3 models over the same 160-token vocabulary


def _pairs(vocab: int, pairs: int = 3, length: int = 24) -> dict:
    """Rows 2k / 2k + 1: one prompt, two replies of different lengths; loss mask on the replies."""
    rng = np.random.default_rng(0)
    rows = {k: np.zeros((2 * pairs, length), np.int64) for k in ("ids", "mask")}
    for k in range(pairs):
        prompt = rng.integers(0, vocab, 7)
        for j in range(2):
            reply = rng.integers(0, vocab, int(rng.integers(4, length - 7)))
            doc = np.concatenate([prompt, reply])
            rows["ids"][2 * k + j, : len(doc)] = doc
            rows["mask"][2 * k + j, len(prompt) : len(doc)] = 1  # mask[i]: token i is a trained target
    return rows


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (trainer checkpoint, its trainer-to-hf export) for the policy and the reference."""
    from trainer.hf.to_hf import trainer_to_hf
    from trainer.hf.to_trainer import hf_to_trainer

    root = tmp_path_factory.mktemp("dpo-interop")
    out = {}
    for name in (POLICY, REFERENCE):
        ckpt = hf_to_trainer(FIXTURES / name, root / name)
        out[name] = (ckpt, trainer_to_hf(ckpt, root / f"{name}-hf"))
    return out


def _ours(ckpt, rows) -> np.ndarray:
    import jax.numpy as jnp

    from trainer.hf.checkpoints import checkpoint_model_config, load_checkpoint_params
    from trainer.program.step import row_logps

    cfg = checkpoint_model_config(ckpt)
    params = load_checkpoint_params(ckpt, cfg)
    ids = jnp.asarray(rows["ids"], jnp.int32)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    batch = {
        "inputs": inputs,
        "targets": targets,
        "positions": jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape),
        "segment_ids": jnp.ones_like(inputs),
        "loss_mask": jnp.asarray(rows["mask"][:, 1:], jnp.int32),
    }
    logps, _ = row_logps(params, cfg, batch)
    return np.asarray(logps, np.float64)


def _transformers(hf_dir, rows) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = torch.as_tensor(rows["ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (logp * torch.as_tensor(rows["mask"][:, 1:])).sum(-1).double().numpy()


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "hinge"])
def test_the_dpo_loss_equals_one_from_transformers_log_probabilities(exported, kind):
    import jax.numpy as jnp

    from trainer.config.schema import PreferenceConfig
    from trainer.program.preference import preference_sums

    rows = _pairs(160)
    tokens = rows["mask"][:, 1:].sum(1).astype(np.float64)
    ours = {name: _ours(ckpt, rows) for name, (ckpt, _) in exported.items()}
    theirs = {name: _transformers(hf, rows) for name, (_, hf) in exported.items()}
    for name in exported:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-4)

    cfg = PreferenceConfig(dpo_beta=0.3, dpo_loss_type=kind)
    loss, metrics = preference_sums(
        jnp.asarray(ours[POLICY], jnp.float32),
        jnp.asarray(ours[REFERENCE], jnp.float32),
        jnp.asarray(tokens, jnp.float32),
        cfg,
    )
    pol, ref = theirs[POLICY], theirs[REFERENCE]
    if kind == "ipo":
        pol, ref = pol / tokens, ref / tokens
    h = (pol[0::2] - pol[1::2]) - (ref[0::2] - ref[1::2])
    beta = cfg.dpo_beta
    expected = {
        "sigmoid": np.logaddexp(0.0, -beta * h),
        "hinge": np.maximum(0.0, 1 - beta * h),
        "ipo": (h - 1 / (2 * beta)) ** 2,
    }[kind]
    assert float(loss) / 3 == pytest.approx(expected.mean(), rel=1e-5, abs=1e-5)
    margins = beta * ((pol[0::2] - ref[0::2]) - (pol[1::2] - ref[1::2]))
    assert float(metrics["rewards/margins"]) / 3 == pytest.approx(margins.mean(), rel=1e-5, abs=1e-5)
