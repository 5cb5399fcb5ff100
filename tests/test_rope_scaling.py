"""The `rope_scaling` types linear, dynamic and yarn (llama3's own tests are in tests/test_model_families.py):
their canonical text and its validation, the rotary tables they give, and their config.json spelling in
both families, read and written. Against a live transformers: tests/test_rope_scaling_interop.py."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from trainer.config import ConfigError, load_config
from trainer.config.rope_scaling import (
    DynamicRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    YarnRopeScaling,
    parse_rope_scaling,
    rope_scaling_text,
)
from trainer.model.hf import HfFormatError, hf_config, model_keys_from_hf

YARN = "yarn:factor=4.0,original_max_position_embeddings=16,beta_fast=32.0,beta_slow=1.0"
CANONICAL = [
    "linear:factor=2.5",
    "dynamic:factor=2.0,original_max_position_embeddings=4096",
    YARN,
    YARN + ",attention_factor=1.25",
    YARN + ",mscale=0.707,mscale_all_dim=1.0,truncate=false",
    "llama3:factor=8.0,low_freq_factor=1.0,high_freq_factor=4.0,original_max_position_embeddings=8192",
]


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_text_parses_and_writes_back_unchanged(text):
    scaling = parse_rope_scaling(text)
    assert rope_scaling_text(scaling) == text
    assert parse_rope_scaling(rope_scaling_text(scaling)) == scaling


def test_optional_yarn_parameters_default_and_their_text_omits_the_defaults_in_declaration_order():
    plain = parse_rope_scaling(" yarn: beta_slow=1, beta_fast=32,factor=4,original_max_position_embeddings=16")
    assert plain == YarnRopeScaling(4.0, 16, 32.0, 1.0)
    assert (plain.attention_factor, plain.mscale, plain.mscale_all_dim, plain.truncate) == (None, None, None, True)
    assert rope_scaling_text(plain) == YARN
    assert parse_rope_scaling(YARN + ",truncate=true") == plain  # the default: not written back
    shuffled = parse_rope_scaling(YARN + ",truncate=false,mscale_all_dim=1,mscale=0.707")
    assert rope_scaling_text(shuffled) == YARN + ",mscale=0.707,mscale_all_dim=1.0,truncate=false"
    assert parse_rope_scaling("linear:factor=2") == LinearRopeScaling(2.0)
    assert parse_rope_scaling(CANONICAL[1]) == DynamicRopeScaling(2.0, 4096)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("linear:factor=0.5", "factor=0.5 must be >= 1"),
        ("linear:factor=2,original_max_position_embeddings=8", "is not a parameter of linear (factor)"),
        ("dynamic:factor=2", "dynamic needs original_max_position_embeddings too"),
        ("dynamic:factor=2,original_max_position_embeddings=0", "original_max_position_embeddings=0 must be > 0"),
        ("yarn:factor=4", "yarn needs original_max_position_embeddings, beta_fast, beta_slow too"),
        ("yarn:factor=4", "(optional: attention_factor, mscale, mscale_all_dim, truncate)"),
        (YARN.replace("beta_fast=32.0", "beta_fast=0.5"), "beta_fast=0.5 must be >= beta_slow=1.0"),
        (YARN + ",truncate=yes", "truncate='yes' must be true or false"),
        (YARN + ",attention_factor=0", "attention_factor=0.0 must be > 0"),
        (YARN + ",mscale=nan", "mscale='nan' must be a finite number"),
        (YARN + ",mscal=1", "did you mean 'mscale'?"),
    ],
)
def test_a_bad_scaling_is_a_config_error_naming_the_part(text, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("base.yml", ["model=qwen3-tiny", f"rope_scaling={text}"])
    assert fragment in str(err.value) and "rope_scaling=" in str(err.value)


@pytest.mark.slow
def test_the_cli_refuses_a_bad_scaling_with_exit_2_before_any_compute(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "base.yml", "model=qwen3-tiny", "rope_scaling=linear:factor=0.5"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and "rope_scaling='linear:factor=0.5'" in proc.stderr, proc.stderr
    assert "factor=0.5 must be >= 1" in proc.stderr
    assert not any(tmp_path.iterdir())


# --- the rotary tables -----------------------------------------------------------------------------------


def _tables(scaling, length=None, positions=64, head_dim=16, theta=10_000.0):
    import jax.numpy as jnp

    from trainer.model.layers import rope_tables

    pos = jnp.arange(positions, dtype=jnp.int32)[None]
    cos, sin = rope_tables(pos, head_dim, theta, jnp.float32, scaling, length)
    return np.asarray(cos[0], np.float64), np.asarray(sin[0], np.float64)


def test_yarn_multiplies_cos_and_sin_by_its_attention_factor():
    for text, factor in [
        (YARN, 0.1 * math.log(4.0) + 1),
        (YARN + ",attention_factor=1.25", 1.25),
        (YARN + ",mscale=0.5,mscale_all_dim=1.0", (0.05 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1)),
    ]:
        cos, sin = _tables(parse_rope_scaling(text))
        np.testing.assert_allclose(cos**2 + sin**2, factor**2, rtol=1e-5)
    cos, sin = _tables(LinearRopeScaling(2.0))
    np.testing.assert_allclose(cos**2 + sin**2, 1.0, rtol=1e-6)


def test_linear_divides_every_frequency_by_its_factor():
    _, sin = _tables(LinearRopeScaling(4.0))
    _, plain = _tables(None)
    np.testing.assert_allclose(sin[4], plain[1], atol=1e-6)  # position 4 at a quarter speed = position 1


def test_dynamic_reads_the_static_length_and_is_plain_rope_up_to_the_original_context():
    scaling = DynamicRopeScaling(2.0, 16)
    plain = _tables(None)
    np.testing.assert_array_equal(_tables(scaling, length=16)[1], plain[1])
    np.testing.assert_array_equal(_tables(scaling, positions=16)[1], _tables(None, positions=16)[1])
    longer = _tables(scaling, length=64)[1]
    assert np.abs(longer - plain[1]).max() > 1e-2
    np.testing.assert_array_equal(_tables(scaling)[1], longer)  # the default length: the table's T


# --- config.json ---------------------------------------------------------------------------------------

SCALINGS = [parse_rope_scaling(t) for t in CANONICAL]


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama3-tiny"])
@pytest.mark.parametrize("text", CANONICAL)
def test_every_type_exports_in_both_spellings_and_reads_back_to_the_same_key(preset, text):
    cfg = load_config("base.yml", [f"model={preset}", f"rope_scaling={text}"]).model
    out = hf_config(cfg, "float32")
    scaling = parse_rope_scaling(text)
    params = out["rope_parameters"]
    assert params["rope_type"] == scaling.type and params["rope_theta"] == cfg.rope_max_timescale
    assert out["rope_scaling"] == {k: v for k, v in params.items() if k != "rope_theta"}
    assert out["rope_theta"] == cfg.rope_max_timescale
    assert model_keys_from_hf(out)["rope_scaling"] == text
    if isinstance(scaling, DynamicRopeScaling):  # transformers reads dynamic's original context here
        assert out["max_position_embeddings"] == scaling.original_max_position_embeddings
        assert "original_max_position_embeddings" not in params
    if isinstance(scaling, YarnRopeScaling):
        assert out["max_position_embeddings"] == 64 and params["original_max_position_embeddings"] == 16
        assert ("truncate" in params) is (not scaling.truncate)


def _qwen3(**edit) -> dict:
    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
    }
    return {**hf, **edit}


def _read(hf: dict):
    return parse_rope_scaling(model_keys_from_hf(hf)["rope_scaling"])


def test_the_4x_spelling_with_type_and_a_top_level_theta_reads_the_same():
    current = _qwen3(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    legacy = _qwen3(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5)
    assert model_keys_from_hf(current) == model_keys_from_hf(legacy)
    assert _read(legacy) == LinearRopeScaling(2.0) and model_keys_from_hf(legacy)["rope_max_timescale"] == 5e5


def test_parameters_transformers_fills_in_are_filled_in_alike():
    yarn = {"rope_type": "yarn", "rope_theta": 1e4}
    # No factor: max_position_embeddings / original; no betas: 32 / 1; null mscales: absent.
    got = _read(_qwen3(rope_parameters={**yarn, "original_max_position_embeddings": 16, "mscale": 0}))
    assert got == YarnRopeScaling(4.0, 16, 32.0, 1.0)
    # The original context: top level first (as transformers' standardization), then the section, then
    # max_position_embeddings.
    top = _qwen3(original_max_position_embeddings=8, rope_parameters={**yarn, "factor": 2.0})
    assert _read(top).original_max_position_embeddings == 8
    assert _read(_qwen3(rope_parameters={**yarn, "factor": 2.0})).original_max_position_embeddings == 64
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert _read(_qwen3(rope_parameters=llama3)) == Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    # dynamic's original context is max_position_embeddings, whatever else the section says.
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    assert _read(_qwen3(rope_parameters=dynamic)) == DynamicRopeScaling(2.0, 64)


@pytest.mark.parametrize(
    "edit,fragment",
    [
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type 'longrope' is not supported for Qwen3"),
        ({"rope_parameters": {"rope_type": "dynamic"}}, "has no 'factor' (rope_type dynamic needs it)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 0.5}}, "factor=0.5 must be >= 1"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2, "truncate": "no"}}, "truncate='no' must be true"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2, "beta_fast": "x"}},
            "beta_fast='x' must be a number",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2}, "partial_rotary_factor": 0.5}, "partial rotary"),
    ],
)
def test_an_unsupported_rope_section_is_named_with_the_file(edit, fragment):
    with pytest.raises(HfFormatError) as err:
        model_keys_from_hf(_qwen3(**edit), "/models/q/config.json")
    assert fragment in str(err.value) and "/models/q/config.json" in str(err.value)
