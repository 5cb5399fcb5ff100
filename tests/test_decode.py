"""KV-cache decoding: the cache reproduces the full forward, one compiled step serves every position,
sampling obeys temperature / top-k / top-p and its seed, and the CLI checks its input before compute.
(Agreement with transformers' greedy decoding is in test_hf_interop.py.)"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import model as qwen3
from trainer.config.schema import ModelConfig
from trainer.model import generation

TINY = ModelConfig(
    base_num_decoder_layers=2,
    base_emb_dim=32,
    base_num_query_heads=4,
    base_num_kv_heads=2,
    head_dim=16,
    base_mlp_dim=64,
    vocab_size=97,
    rope_max_timescale=10_000.0,
    dtype="float32",
    weight_dtype="float32",
    scan_layers=True,
    remat_policy="none",
)
CONFIGS = {
    "scan": TINY,
    "loop": dataclasses.replace(TINY, scan_layers=False),
    "moe": dataclasses.replace(
        TINY, num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=24, moe_capacity_factor=1.0
    ),  # decoding must still be dropless
}


def _params(cfg: ModelConfig, seed: int = 0):
    return jax.jit(partial(qwen3.init_params, cfg))(jax.random.key(seed))


@pytest.fixture(scope="module")
def tiny_params():
    return _params(TINY)


@partial(jax.jit, static_argnums=1)
def _forward_logits(params, cfg, tokens):
    cfg = generation.for_inference(cfg)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = qwen3.forward(params, cfg, tokens, positions, jnp.ones_like(tokens))
    return qwen3.logits_from_hidden(params, cfg, hidden)


@pytest.mark.parametrize("layout", list(CONFIGS))
def test_prefill_then_cached_steps_give_the_full_forward_logits_at_every_position(layout):
    cfg = CONFIGS[layout]
    params = _params(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    want = _forward_logits(params, cfg, tokens)
    icfg = generation.for_inference(cfg)
    step = jax.jit(partial(generation.extend, cfg=icfg))
    cache = generation.init_cache(icfg, batch=2, max_length=12)  # longer than used: the tail stays masked
    logits, cache = step(params, tokens=tokens[:, :4], cache=cache)
    got = [logits]
    for t in range(4, 9):
        logits, cache = step(params, tokens=tokens[:, t : t + 1], cache=cache)
        got.append(logits)
    assert int(cache.length) == 9
    np.testing.assert_allclose(np.stack(got, 1), want[:, 3:], atol=1e-5)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        "dynamic:factor=2.0,original_max_position_embeddings=4",
        "yarn:factor=4.0,original_max_position_embeddings=4,beta_fast=32.0,beta_slow=1.0",
    ],
)
def test_scaled_rope_decodes_with_one_table_the_size_of_the_cache(rope_scaling):
    """Prefill and every cached step rotate by the table of a forward over the whole cache (dynamic NTK
    reads the cache's size, not the chunk's; YaRN's attention factor applies in both)."""
    cfg = dataclasses.replace(TINY, rope_scaling=rope_scaling)
    params = _params(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    want = _forward_logits(params, cfg, tokens)
    icfg = generation.for_inference(cfg)
    step = jax.jit(partial(generation.extend, cfg=icfg))
    logits, cache = step(params, tokens=tokens[:, :4], cache=generation.init_cache(icfg, batch=2, max_length=9))
    got = [logits]
    for t in range(4, 9):
        logits, cache = step(params, tokens=tokens[:, t : t + 1], cache=cache)
        got.append(logits)
    np.testing.assert_allclose(np.stack(got, 1), want[:, 3:], atol=1e-5)


def test_greedy_generation_equals_argmax_rollout_of_the_full_forward(tiny_params):
    prompt = np.array([[3, 14, 15, 92], [65, 35, 89, 79]], np.int32)
    seq = np.zeros((2, 10), np.int32)  # one shape for every rollout step: later slots cannot leak back (causal)
    seq[:, :4] = prompt
    for t in range(4, 10):  # no cache: re-run the whole sequence for every token
        seq[:, t] = np.asarray(jnp.argmax(_forward_logits(tiny_params, TINY, jnp.asarray(seq))[:, t - 1], -1))
    np.testing.assert_array_equal(generation.generate(tiny_params, TINY, prompt, 6), seq[:, 4:])


def test_one_compiled_step_serves_every_position(tiny_params):
    before = generation._next_token._cache_size()
    generation.generate(tiny_params, TINY, [1, 2, 3, 4, 5, 6, 7], 10)  # shapes no other test uses
    assert generation._next_token._cache_size() - before == 2  # the 7-token prefill and the one-token step


def test_generation_stops_once_every_row_has_produced_eos(tiny_params):
    first = generation.generate(tiny_params, TINY, [5, 6, 7], 8)[0]
    eos = int(first[2])
    out = generation.generate(tiny_params, TINY, [5, 6, 7], 8, eos_id=eos)[0]
    np.testing.assert_array_equal(out, first[: list(first).index(eos) + 1])


def test_sampling_is_reproducible_with_a_seed_and_varies_across_seeds(tiny_params):
    sampling = generation.Sampling(temperature=1.5)
    runs = [generation.generate(tiny_params, TINY, [5, 6, 7], 8, sampling, seed=s) for s in (0, 0, 1)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


PROBS = np.array([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    "sampling,allowed",
    [
        (generation.Sampling(temperature=0.0), {0}),
        (generation.Sampling(temperature=1.0, top_k=2), {0, 1}),
        (generation.Sampling(temperature=1.0, top_p=0.7), {0, 1}),  # 0.5 < 0.7 <= 0.5 + 0.3
        (generation.Sampling(temperature=1.0, top_p=0.5), {0}),  # the top token alone reaches 0.5
        (generation.Sampling(temperature=1.0, top_k=3, top_p=0.9), {0, 1, 2}),
        (generation.Sampling(temperature=1.0), {0, 1, 2, 3}),
    ],
)
def test_sampling_draws_only_from_the_kept_tokens(sampling, allowed):
    logits = jnp.log(jnp.tile(jnp.asarray(PROBS, jnp.float32), (4000, 1)))
    drawn = set(np.asarray(generation.sample(logits, jax.random.key(0), sampling)).tolist())
    assert drawn == allowed


def test_sampling_follows_the_temperature_scaled_distribution():
    logits = jnp.log(jnp.tile(jnp.asarray(PROBS, jnp.float32), (20000, 1)))
    drawn = np.asarray(generation.sample(logits, jax.random.key(1), generation.Sampling(temperature=2.0)))
    want = PROBS**0.5 / np.sum(PROBS**0.5)
    np.testing.assert_allclose(np.bincount(drawn, minlength=4) / drawn.size, want, atol=0.015)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_sampling_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        generation.Sampling(**bad)


# --- the CLI -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["prompt_ids=[1, 2]"], "load_parameters_path"),
        (["load_parameters_path=/nowhere", "prompt=hi", "prompt_ids=[1]"], "exactly one"),
        (["load_parameters_path=/nowhere"], "exactly one"),
        (["load_parameters_path=/nowhere", "prompt_ids=[1, 99999999]"], "vocab_size"),
        (["load_parameters_path=/nowhere", "prompt_ids=[1]", "top_p=1.5"], "top_p"),
    ],
)
def test_decode_cli_rejects_bad_input_with_exit_2_before_any_compute(overrides, message, capsys):
    from trainer.decode import main

    assert main(["base.yml", "model=qwen3-tiny", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_decode_cli_continues_a_text_prompt_with_the_configured_tokenizer(tmp_path, capsys):
    from trainer.checkpoint import save_parameters
    from trainer.config import load_config
    from trainer.data.tokenizer import Tokenizer
    from trainer.decode import main

    overrides = [
        "model=qwen3-tiny",
        "base_num_decoder_layers=1",
        "base_emb_dim=32",
        "base_mlp_dim=64",
        "head_dim=8",
        "vocab_size=8192",
        f"load_parameters_path={tmp_path / 'p'}",
        "prompt=Hello world",
        "max_decode_length=5",
        "temperature=0.7",
        "top_k=20",
        "decode_seed=3",
    ]
    cfg = load_config("base.yml", overrides)
    params = _params(cfg.model)
    save_parameters(tmp_path / "p", params)
    assert main(["base.yml", *overrides]) == 0
    lines = capsys.readouterr().out.strip().splitlines()

    tokenizer = Tokenizer(cfg.data.tokenizer_path, cfg.data.tokenizer_type)
    want = generation.generate(
        params,
        cfg.model,
        tokenizer.encode("Hello world"),
        5,
        generation.Sampling(temperature=0.7, top_k=20),
        seed=3,
        eos_id=tokenizer.eos_id,
    )[0].tolist()
    want = want[: want.index(tokenizer.eos_id) + 1] if tokenizer.eos_id in want else want
    assert lines[-1] == f"output_ids: {want}"
    assert lines[0] == tokenizer.decode([i for i in want if i != tokenizer.eos_id]).splitlines()[0]


def test_decode_cli_names_a_run_directory_given_as_checkpoint_in_one_line(tmp_path):
    """Run as typed, from the user's directory with a relative path: one line, exit 2, no traceback."""
    import subprocess
    import sys

    (tmp_path / "runs" / "NAME" / "checkpoints" / "7").mkdir(parents=True)
    (tmp_path / "runs" / "NAME" / "checkpoints" / "7" / "commit_success.txt").write_text("ok")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.decode",
            "base.yml",
            "model=qwen3-tiny",
            "load_parameters_path=runs/NAME",
            "prompt_ids=[1, 2]",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("python -m trainer.decode: error: load_parameters_path ")
    assert f"{tmp_path / 'runs' / 'NAME'} is a run directory" in errors[0] and "checkpoints: 7" in errors[0]


def test_decode_cli_names_the_tensor_when_the_model_does_not_match_the_checkpoint(tmp_path, capsys):
    from trainer.checkpoint import save_parameters
    from trainer.decode import main

    small = dataclasses.replace(TINY, vocab_size=64)
    save_parameters(tmp_path / "p", _params(small))
    assert (
        main(
            [
                "base.yml",
                "model=qwen3-tiny",
                "base_num_decoder_layers=2",
                "base_emb_dim=32",
                "head_dim=16",
                "base_mlp_dim=64",
                "vocab_size=97",
                f"load_parameters_path={tmp_path / 'p'}",
                "prompt_ids=[1, 2]",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m trainer.decode: error: ") and "\n" not in err
    assert "embed_tokens is [64, 32] in the checkpoint but [97, 32] in the model config" in err
    assert "model= must be the model the checkpoint was trained with" in err
