"""Parameter counts of every shipped preset: analytic, without allocating a single weight."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from trainer import model
from trainer.config import load_config

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "models").glob("*.yml"))

# Published sizes (Qwen3 model cards / technical report; Llama 3.1 / 3.2 model cards): total, and active per
# token for the MoE.
PUBLISHED = {
    "qwen3-0.6b": (0.6e9, None),
    "qwen3-1.7b": (1.7e9, None),
    "qwen3-4b": (4.0e9, None),
    "qwen3-8b": (8.2e9, None),
    "qwen3-14b": (14.8e9, None),
    "qwen3-32b": (32.8e9, None),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "llama3.2-1b": (1.23e9, None),
    "llama3.2-3b": (3.21e9, None),
    "llama3.1-8b": (8.03e9, None),
}
# The exact totals of the Llama checkpoints (the parameters of their published safetensors).
EXACT = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248}


def _model_cfg(name: str):
    return load_config("base.yml", [f"model={name}"]).model


def _abstract_size(cfg) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.abstract_params(cfg)))


def test_every_published_preset_has_a_published_size():
    assert set(PUBLISHED) <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_matches_the_published_size_within_2_percent(name):
    total, active = model.count_params(_model_cfg(name))
    published_total, published_active = PUBLISHED[name]
    assert total == pytest.approx(published_total, rel=0.02)
    assert active == pytest.approx(published_active or published_total, rel=0.02)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_llama_preset_parameter_count_is_exactly_the_published_checkpoints(name):
    assert model.count_params(_model_cfg(name)) == (EXACT[name], EXACT[name])


@pytest.mark.parametrize("name", PRESETS)
def test_count_params_equals_the_elements_of_abstract_params(name):
    cfg = _model_cfg(name)
    assert model.count_params(cfg)[0] == _abstract_size(cfg)


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-tiny-moe", "llama3-tiny"])
def test_count_params_equals_the_elements_of_abstract_params_without_scan(name):
    import dataclasses

    cfg = dataclasses.replace(_model_cfg(name), scan_layers=False)
    assert model.count_params(cfg)[0] == _abstract_size(cfg)


def test_moe_active_params_count_only_the_routed_experts():
    cfg = _model_cfg("qwen3-tiny-moe")
    total, active = model.count_params(cfg)
    expert = 3 * cfg.base_emb_dim * cfg.base_moe_mlp_dim
    unused = cfg.base_num_decoder_layers * (cfg.num_experts - cfg.num_experts_per_tok) * expert
    assert total - active == unused


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-8b", "qwen3-30b-a3b", "llama3.2-1b", "llama3.1-8b"])
def test_training_flops_are_six_times_active_matmul_params_plus_causal_attention(name):
    cfg = _model_cfg(name)
    _, active = model.count_params(cfg)
    qk_norms = 2 * cfg.head_dim if cfg.use_qk_norm else 0  # Qwen3's; Llama has none
    norms = cfg.base_num_decoder_layers * (2 * cfg.base_emb_dim + qk_norms) + cfg.base_emb_dim
    lookup_only = 0 if cfg.logits_via_embedding else cfg.vocab_size * cfg.base_emb_dim  # tied: table is the head
    seq = 4096
    attention = 6 * cfg.base_num_decoder_layers * cfg.base_num_query_heads * cfg.head_dim * seq
    expected = 6 * (active - norms - lookup_only) + attention
    assert model.training_flops_per_token(cfg, seq) == pytest.approx(expected, rel=1e-12)
