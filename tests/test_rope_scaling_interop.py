"""The `rope_scaling` types against a live transformers: the inverse frequencies and attention factor of
every type equal transformers' `ROPE_INIT_FUNCTIONS` for the same config.json, and random tiny Qwen3 and
Llama models with linear, dynamic and YaRN scaling, saved by transformers, imported through
`hf_to_trainer`, give float32 logits within 1e-4 of transformers' at positions past the original context;
their export carries the same RoPE section and loads back in transformers to the very same logits.

The `interop` tier (torch and transformers; `.ci/run` installs them and runs `python -m pytest -m interop`);
without them it skips. Dynamic NTK is compared on unpacked sequences in one forward, where transformers'
length (max position + 1) and the static sequence length used here coincide (`trainer/model/rope.py`).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.interop

LOGITS_ATOL = 1e-4
SEQUENCE = 64  # past every case's original context (16 or 32)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
FREQUENCY_CASES = {
    "linear": ({"rope_type": "linear", "factor": 2.5}, 64, 1e4, 128),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 64, 1e4, 32),
    "yarn": (YARN, 64, 1e4, 64),
    "yarn-128-theta-1e6": ({**YARN, "factor": 8.0, "original_max_position_embeddings": 4096}, 128, 1e6, 32768),
    "yarn-untruncated": ({**YARN, "truncate": False}, 64, 1e4, 64),
    "yarn-betas": ({**YARN, "beta_fast": 16.0, "beta_slow": 2.0}, 64, 1e4, 64),
    "yarn-attention-factor": ({**YARN, "attention_factor": 1.5}, 64, 1e4, 64),
    "yarn-mscales": ({**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}, 64, 1e4, 64),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        64,
        5e5,
        64,
    ),
}


def _llama_config(rope: dict, head_dim: int, theta: float, max_positions: int):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters={**rope, "rope_theta": theta},
    )


@pytest.mark.parametrize("case", sorted(FREQUENCY_CASES))
def test_frequencies_and_attention_factor_are_transformers(case):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trainer.config.rope_scaling import parse_rope_scaling
    from trainer.model.hf import model_keys_from_hf
    from trainer.model.rope import rope_frequencies

    rope, head_dim, theta, max_positions = FREQUENCY_CASES[case]
    config = _llama_config(rope, head_dim, theta, max_positions)
    hf = {**config.to_dict(), "architectures": ["LlamaForCausalLM"], "intermediate_size": 64, "vocab_size": 96}
    scaling = parse_rope_scaling(model_keys_from_hf(hf)["rope_scaling"])
    assert scaling.type == rope["rope_type"]
    lengths = [16, max_positions, 3 * max_positions + 5] if rope["rope_type"] == "dynamic" else [SEQUENCE]
    for length in lengths:
        want, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None, seq_len=length)
        got, got_factor = rope_frequencies(theta, head_dim, scaling, length)
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6, err_msg=f"length {length}")
        assert got_factor == pytest.approx(want_factor, rel=1e-12)


COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
COMMON.update(num_key_value_heads=2, head_dim=16, hidden_act="silu", tie_word_embeddings=False)
LOGIT_CASES = {
    # The case: Qwen3 with YaRN over an original context of 16, run to 64.
    "qwen3-yarn": ("qwen3", dict(max_position_embeddings=64, rope_parameters={**YARN, "rope_theta": 1e4})),
    "qwen3-yarn-mscales-untruncated": (
        "qwen3",
        dict(
            max_position_embeddings=64,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False, "rope_theta": 1e4},
        ),
    ),
    "qwen3-dynamic": (
        "qwen3",
        dict(
            max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        ),
    ),
    "llama-linear": (
        "llama",
        dict(
            max_position_embeddings=256, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}
        ),
    ),
    "llama-yarn": (
        "llama",
        dict(
            max_position_embeddings=128,
            rope_parameters={**YARN, "factor": 8.0, "attention_factor": 1.3, "beta_fast": 16.0, "rope_theta": 1e4},
        ),
    ),
}


def _classes(family: str):
    import transformers

    if family == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config
    return transformers.LlamaForCausalLM, transformers.LlamaConfig


def _save_random(path, family: str, kwargs: dict, seed: int) -> None:
    """Norm weights ~ 1 + 0.3 N(0,1), embedding ~ 0.5 N(0,1), matrices ~ 0.12 N(0,1), float32 safetensors."""
    import torch

    model_class, config_class = _classes(family)
    gen = torch.Generator().manual_seed(seed)
    model = model_class(config_class(**{**COMMON, **kwargs})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else (0.5 if "embed_tokens" in name else 0.12) * noise)
    model.save_pretrained(path, safe_serialization=True)


def _torch_logits(path, family: str, ids: np.ndarray) -> np.ndarray:
    import torch

    model = _classes(family)[0].from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(LOGIT_CASES))
def test_scaled_models_give_transformers_logits_and_export_the_same_rope_section(case, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import dataclasses
    import json

    from trainer.hf.checkpoints import checkpoint_model_config, load_checkpoint_params
    from trainer.hf.logits import compute_logits
    from trainer.hf.to_hf import trainer_to_hf
    from trainer.hf.to_trainer import hf_to_trainer

    family, kwargs = LOGIT_CASES[case]
    source = tmp_path / "hf"
    _save_random(source, family, kwargs, seed=sorted(LOGIT_CASES).index(case))
    ids = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(2, SEQUENCE))
    expected = _torch_logits(source, family, ids)

    ckpt = hf_to_trainer(source, tmp_path / "ckpt")
    cfg = checkpoint_model_config(ckpt)
    assert cfg.rope_scaling.startswith(kwargs["rope_parameters"]["rope_type"] + ":")
    logits = compute_logits(load_checkpoint_params(ckpt, cfg), cfg, ids)
    assert np.abs(logits - expected).max() <= LOGITS_ATOL
    unscaled = compute_logits(
        load_checkpoint_params(ckpt, cfg), dataclasses.replace(cfg, rope_scaling="none"), ids
    )
    assert np.abs(unscaled - expected).max() > 10 * LOGITS_ATOL  # the scaling is what made them agree

    export = trainer_to_hf(ckpt, tmp_path / "export")
    theirs = json.loads((source / "config.json").read_text())
    ours = json.loads((export / "config.json").read_text())
    for key, value in theirs["rope_parameters"].items():  # every parameter transformers wrote, unchanged
        assert ours["rope_parameters"][key] == value, key
    if kwargs["rope_parameters"]["rope_type"] in ("dynamic", "yarn"):  # chosen to be the scaled length
        assert ours["max_position_embeddings"] == theirs["max_position_embeddings"]
    np.testing.assert_array_equal(_torch_logits(export, family, ids), expected)
