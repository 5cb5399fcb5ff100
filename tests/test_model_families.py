"""The model family seam and its second family, Llama 3: the registry the presets name, the `rope_scaling`
key, Llama's RoPE against Hugging Face's formula, and what its config.json mapping reads, writes and refuses.

Logits, loss, greedy decoding and the bitwise round trip against transformers' own Llama fixtures are in
tests/test_hf_interop.py (NAMES); generated cases against a live transformers in tests/test_llama3_interop.py.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from trainer import model
from trainer.config import ConfigError, load_config
from trainer.config.rope_scaling import (
    Llama3RopeScaling,
    parse_rope_scaling,
    rope_scaling_text,
)
from trainer.config.schema import flat_fields
from trainer.model.families import FAMILIES
from trainer.model.hf import HfFormatError, hf_config, model_keys_from_hf, tensor_plan

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (REPO / "configs" / "models").glob("*.yml"))
FIXTURES = REPO / "tests" / "fixtures" / "hf"
LLAMA_31 = "llama3:factor=8.0,low_freq_factor=1.0,high_freq_factor=4.0,original_max_position_embeddings=8192"


def _model(name: str, *overrides: str):
    return load_config("base.yml", [f"model={name}", *overrides]).model


# --- the registry -------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_sets_a_family_that_lists_it(preset):
    text = (REPO / "configs" / "models" / f"{preset}.yml").read_text()
    cfg = _model(preset)
    assert f"model_family: {cfg.model_family}\n" in text  # set by the preset, not left to base.yml
    assert preset in FAMILIES[cfg.model_family].presets


def test_the_families_list_exactly_the_shipped_presets_and_the_schema_offers_exactly_the_families():
    listed = [p for f in FAMILIES.values() for p in f.presets]
    assert sorted(listed) == PRESETS and len(set(listed)) == len(listed)
    assert flat_fields()["model_family"][1].metadata["choices"] == tuple(FAMILIES)
    assert {f.name for f in FAMILIES.values()} == set(FAMILIES)


def test_nothing_outside_trainer_model_imports_a_family_by_name():
    """The runtime, the tools and the HF files ask `trainer.model`; only the registry names a family."""
    families = {f"trainer.model.{name}" for name in FAMILIES}
    offenders = []
    for path in (REPO / "trainer").rglob("*.py"):
        if path.is_relative_to(REPO / "trainer" / "model"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {f"{node.module}.{a.name}" for a in node.names} | {node.module}
                aliased = node.module == "trainer" and any(a.asname in FAMILIES for a in node.names)
                if (
                    names & families
                    or any(n.startswith(tuple(f + "." for f in families)) for n in names)
                    or aliased
                ):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


def test_an_unknown_family_is_named_with_the_choices():
    with pytest.raises(ConfigError, match="model_family='gemma' is not one of 'qwen3', 'llama3'"):
        load_config("base.yml", ["model=qwen3-tiny", "model_family=gemma"])


# --- rope_scaling -------------------------------------------------------------------------------------


def test_rope_scaling_text_is_canonical_and_parses_back_to_the_same_parameters():
    scaling = parse_rope_scaling(
        " llama3: factor=8, low_freq_factor=1,high_freq_factor=4.0 ,original_max_position_embeddings=8192"
    )
    assert scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    assert rope_scaling_text(scaling) == LLAMA_31
    assert parse_rope_scaling(LLAMA_31) == scaling
    assert parse_rope_scaling("none") is None and rope_scaling_text(None) == "none"


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("longrope:factor=4", "unknown scaling type 'longrope'; known: none, linear, dynamic, yarn, llama3"),
        (
            "llama3:factor=8",
            "llama3 needs low_freq_factor, high_freq_factor, original_max_position_embeddings too",
        ),
        ("llama3:factr=8", "did you mean 'factor'?"),
        (LLAMA_31 + ",factor=2", "factor is given twice"),
        (LLAMA_31.replace("8192", "8192.5"), "original_max_position_embeddings='8192.5' must be a whole number"),
        (LLAMA_31.replace("factor=8.0", "factor=big"), "factor='big' must be a finite number"),
        (LLAMA_31.replace("high_freq_factor=4.0", "high_freq_factor=0.5"), "high_freq_factor=0.5 must exceed"),
        (LLAMA_31.replace("factor=8.0", "factor=0"), "factor=0.0 must be > 0"),
    ],
)
def test_a_bad_rope_scaling_is_a_config_error_naming_the_part_and_the_form(text, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("base.yml", ["model=llama3-tiny", f"rope_scaling={text}"])
    assert fragment in str(err.value) and "rope_scaling=" in str(err.value)


def _hf_llama3_inv_freq(head_dim: int, theta: float, s: Llama3RopeScaling) -> np.ndarray:
    """transformers' `_compute_llama3_parameters`, written out in float64 with numpy."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low, high = (
        s.original_max_position_embeddings / s.low_freq_factor,
        s.original_max_position_embeddings / s.high_freq_factor,
    )
    scaled = np.where(wavelen > low, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    return np.where((wavelen >= high) & (wavelen <= low), smoothed, scaled)


@pytest.mark.parametrize("preset", ["llama3.2-1b", "llama3.1-8b"])
def test_llama3_rope_frequencies_are_hugging_faces_and_scale_only_the_long_wavelengths(preset):
    import jax.numpy as jnp

    from trainer.model.layers import rope_tables

    cfg = _model(preset)
    scaling = parse_rope_scaling(cfg.rope_scaling)
    positions = jnp.ones((1, 1), jnp.int32)
    _, sin = rope_tables(positions, cfg.head_dim, cfg.rope_max_timescale, jnp.float32, scaling)
    _, sin_plain = rope_tables(positions, cfg.head_dim, cfg.rope_max_timescale, jnp.float32)
    # At position 1 each angle is its frequency (every one <= 1 rad, where arcsin inverts sin).
    got = np.arcsin(np.asarray(sin[0, 0, : cfg.head_dim // 2], np.float64))
    plain = np.arcsin(np.asarray(sin_plain[0, 0, : cfg.head_dim // 2], np.float64))
    want = _hf_llama3_inv_freq(cfg.head_dim, cfg.rope_max_timescale, scaling)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    wavelen = 2 * math.pi / plain
    short = wavelen < scaling.original_max_position_embeddings / scaling.high_freq_factor
    long = wavelen > scaling.original_max_position_embeddings / scaling.low_freq_factor
    np.testing.assert_allclose(got[short], plain[short], rtol=1e-6)
    np.testing.assert_allclose(got[long], plain[long] / scaling.factor, rtol=1e-5)
    assert short.any() and long.any() and (~short & ~long).any()


@pytest.mark.parametrize("name", ["llama_tied", "llama_untied_kv1"])
def test_the_llama_fixtures_depend_on_their_rope_scaling(name, tmp_path):
    """Parity with transformers (test_hf_interop.py) proves the scaling only if dropping it changes the
    logits by far more than the 1e-4 tolerance."""
    from trainer.hf.load import load_hf
    from trainer.hf.logits import compute_logits

    cfg, params = load_hf(FIXTURES / name, dtype="float32", weight_dtype="float32")
    expected = np.load(FIXTURES / name / "expected.npz")
    assert cfg.model_family == "llama3" and cfg.rope_scaling != "none" and not cfg.use_qk_norm
    unscaled = compute_logits(params, dataclasses.replace(cfg, rope_scaling="none"), expected["input_ids"])
    assert np.abs(unscaled - expected["logits"]).max() > 1e-2


# --- Llama's config.json ------------------------------------------------------------------------------


def _fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_llama_config_json_reads_the_same_in_the_4x_and_5x_spellings():
    legacy = _fixture_config("llama_untied_kv1")  # rope_theta on top, the scaling under rope_scaling, no head_dim
    keys = model_keys_from_hf(legacy)
    assert keys["head_dim"] == legacy["hidden_size"] // legacy["num_attention_heads"]
    assert keys["rope_scaling"] == (
        "llama3:factor=8.0,low_freq_factor=1.0,high_freq_factor=2.0,original_max_position_embeddings=32"
    )
    current = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    current["rope_parameters"] = {**legacy["rope_scaling"], "rope_theta": legacy["rope_theta"]}
    assert model_keys_from_hf(current) == keys
    plain = {**current, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert model_keys_from_hf(plain)["rope_scaling"] == "none"
    assert keys["model_family"] == "llama3" and keys["use_qk_norm"] is False


@pytest.mark.parametrize(
    "edit,fragment",
    [
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type 'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "has no 'factor'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0.5}}, "factor=0.5 must be >= 1"),
        ({"partial_rotary_factor": 0.5}, "partial rotary embeddings are not supported"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
            "has no 'low_freq_factor'",
        ),
        ({"mlp_bias": True}, "mlp_bias=True: an MLP with biases is not supported"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "qwen3"}, "does not match model_type 'qwen3'"),
    ],
)
def test_unsupported_llama_config_json_values_are_named_with_the_file(edit, fragment):
    hf = {**_fixture_config("llama_tied"), **edit}
    with pytest.raises(HfFormatError) as err:
        model_keys_from_hf(hf, "/models/llama/config.json")
    assert fragment in str(err.value) and "/models/llama/config.json" in str(err.value)


@pytest.mark.parametrize("preset,tied,factor", [("llama3.2-1b", True, 32.0), ("llama3.1-8b", False, 8.0)])
def test_a_llama_preset_exports_as_llama_for_causal_lm_with_its_rope_scaling_and_tie_flag(preset, tied, factor):
    cfg = _model(preset)
    out = hf_config(cfg, "bfloat16")
    assert out["architectures"] == ["LlamaForCausalLM"] and out["model_type"] == "llama"
    assert out["tie_word_embeddings"] is tied and out["rope_theta"] == 500_000.0
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 8192
    assert out["rope_scaling"] == scaling and out["rope_parameters"] == {**scaling, "rope_theta": 500_000.0}
    assert (out["num_attention_heads"], out["num_key_value_heads"], out["rms_norm_eps"]) == (32, 8, 1e-5)
    assert out["max_position_embeddings"] > 8192
    keys = model_keys_from_hf(out)
    assert {k: getattr(cfg, k) for k in keys} == keys  # the export describes the preset's architecture
    names = {p.hf_name for leaf in tensor_plan(cfg) for p in leaf.pieces}
    assert not any("q_norm" in n or "k_norm" in n for n in names)
    assert ("lm_head.weight" in names) is not tied


@pytest.mark.parametrize(
    "preset,overrides,fragment",
    [
        ("llama3-tiny", ["use_qk_norm=true"], "use_qk_norm=true has no Llama equivalent"),
        ("llama3-tiny", ["num_experts=4", "base_moe_mlp_dim=64", "num_experts_per_tok=2"], "Llama 3 is dense"),
    ],
)
def test_a_config_with_no_equivalent_in_its_familys_architecture_is_refused_on_export(preset, overrides, fragment):
    with pytest.raises(HfFormatError, match=fragment):
        hf_config(_model(preset, *overrides), "float32")


def test_the_model_functions_ask_the_family_the_config_names(monkeypatch):
    """Another FLOPs for the llama3 family: llama3 configs see it through the same `trainer.model` call,
    qwen3 configs do not."""
    from types import SimpleNamespace

    fake = SimpleNamespace(count_params=lambda cfg: (7, 5))
    monkeypatch.setitem(FAMILIES, "llama3", dataclasses.replace(FAMILIES["llama3"], flops=fake))
    assert model.count_params(_model("llama3-tiny")) == (7, 5)
    qwen = _model("qwen3-tiny")
    assert model.count_params(qwen) == FAMILIES["qwen3"].flops.count_params(qwen) != (7, 5)
