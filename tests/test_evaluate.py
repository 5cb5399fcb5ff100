"""The lm-eval adapter's model side, without lm-eval or torch: batches of fixed shapes, continuation
log-likelihoods and greedy flags equal to the model's own forward (rows padded, sharded over a mesh,
contexts cut from the left as lm-eval's Hugging Face backend cuts them), rolling windows that add up,
greedy generation of prompts of mixed lengths equal to decoding each alone, and the stop rules.
(Equality with lm-eval's Hugging Face backend on an exported checkpoint: tests/test_evaluate_interop.py.)"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import model as qwen3
from trainer.config.schema import MeshConfig, ModelConfig
from trainer.evaluate.batching import batch_rows, by_length, length_bucket, score_batch, score_row
from trainer.evaluate.greedy import Generator, prefill_chunks
from trainer.evaluate.placement import eval_mesh, row_shards
from trainer.evaluate.scoring import Scorer
from trainer.evaluate.stops import StopRule
from trainer.model import generation
from trainer.parallel.rules import tree_shardings

TINY = ModelConfig(
    base_num_decoder_layers=2,
    base_emb_dim=32,
    base_num_query_heads=4,
    base_num_kv_heads=2,
    head_dim=16,
    base_mlp_dim=64,
    vocab_size=97,
    rope_max_timescale=10_000.0,
    logits_via_embedding=False,
    dtype="float32",
    weight_dtype="float32",
    remat_policy="none",
)
RULES = MeshConfig().logical_axis_rules


@pytest.fixture(scope="module")
def params():
    return jax.jit(partial(qwen3.init_params, TINY))(jax.random.key(0))


@partial(jax.jit, static_argnums=1)
def _log_probs(params, cfg, tokens):
    """float32 log-softmax [1, T, V] of one unpadded sequence [1, T]: the reference."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = qwen3.forward(params, cfg, tokens, positions, jnp.ones_like(tokens))
    return jax.nn.log_softmax(qwen3.logits_from_hidden(params, cfg, hidden), axis=-1)


def _reference(params, context, continuation, max_length):
    """(sum of the continuation's log-probs, all argmax) from one unpadded forward, cut as HF cuts."""
    whole = (context + continuation)[-(max_length + 1) :]
    logp = np.asarray(_log_probs(params, TINY, jnp.asarray([whole[:-1]])))[0]
    rows = range(len(whole) - 1 - len(continuation), len(whole) - 1)
    total = sum(float(logp[i, whole[i + 1]]) for i in rows)
    return total, all(int(np.argmax(logp[i])) == whole[i + 1] for i in rows)


def _scorer(params, devices, rows, max_length):
    mesh = eval_mesh(MeshConfig(), devices)
    shardings = tree_shardings(qwen3.param_logical_axes(TINY), qwen3.abstract_params(TINY), mesh, RULES)
    placed = jax.device_put(params, shardings)
    return Scorer(placed, TINY, mesh=mesh, rules=RULES, rows=batch_rows(rows, row_shards(mesh, RULES)),
                  max_length=max_length)  # fmt: skip


def _greedy_continuation(params, context, n):
    """The model's own argmax continuation of `context`, n tokens (so its is_greedy must be True)."""
    return generation.generate(params, TINY, context, n)[0].tolist()


# --- batches of fixed shapes --------------------------------------------------------------------------


def test_rows_have_power_of_two_lengths_from_sixteen_and_batches_a_multiple_of_the_batch_shards():
    assert [length_bucket(n) for n in (1, 16, 17, 32, 33, 100)] == [16, 16, 32, 32, 64, 128]
    assert [batch_rows(b, 4) for b in (1, 4, 5, 8)] == [4, 4, 8, 8]
    with pytest.raises(ValueError):
        length_bucket(0)


def test_a_row_is_cut_from_the_left_to_max_length_plus_one_tokens_as_the_hf_backend_cuts_it():
    inputs, targets, scored = score_row([1, 2, 3, 4, 5], [6, 7], max_length=4)
    assert (inputs, targets, scored) == ([3, 4, 5, 6], [4, 5, 6, 7], 2)
    assert score_row([1], [2], max_length=8) == ([1], [2], 1)
    with pytest.raises(ValueError, match="longer than max_length"):
        score_row([1], [2, 3, 4], max_length=2)


def test_a_batch_is_right_padded_with_segment_zero_and_scores_only_each_rows_continuation():
    batch = score_batch([score_row([5, 6, 7], [8, 9], 64), score_row([3], [4], 64)], n_rows=4)
    assert batch.tokens.shape == batch.scored.shape == (4, 16)
    np.testing.assert_array_equal(batch.tokens[0, :5], [5, 6, 7, 8, 0])
    np.testing.assert_array_equal(batch.segment_ids[:, :5], [[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0] * 5, [0] * 5])
    np.testing.assert_array_equal(np.flatnonzero(batch.scored[0]), [2, 3])  # targets 8 and 9
    np.testing.assert_array_equal(np.flatnonzero(batch.scored[1]), [0])
    assert not batch.scored[2:].any()


def test_requests_run_longest_first_like_the_hf_backend():
    assert by_length([[1], [1, 2, 3], [2, 2], [1, 2]]) == [1, 3, 2, 0]


# --- scores -------------------------------------------------------------------------------------------


def test_scores_equal_one_unpadded_forward_per_request_on_a_two_device_mesh(params):
    greedy = _greedy_continuation(params, [3, 1, 4, 1, 5], 4)
    requests = [
        ([3, 1, 4, 1, 5], greedy),  # the model's own argmax continuation: is_greedy
        ([3, 1, 4, 1, 5], [9, 2, 6]),
        ([7], [8]),
        (list(range(1, 40)), [11, 12]),  # cut from the left: 41 tokens, max_length 24
        ([2, 7, 1, 8], [2, 8, 1, 8, 2, 8]),
    ]
    scorer = _scorer(params, jax.devices()[:2], rows=2, max_length=24)
    got = scorer.score(requests)
    for (context, continuation), (logprob, is_greedy) in zip(requests, got):
        want, want_greedy = _reference(params, context, continuation, 24)
        assert logprob == pytest.approx(want, rel=1e-5, abs=1e-4)
        assert is_greedy == want_greedy
    assert [g for _, g in got] == [True, False, False, False, False]


def test_scores_do_not_depend_on_the_batch_size_or_the_other_rows(params):
    requests = [([1, 2, 3], [4]), ([5] * 20, [6, 7]), ([9, 9], [1, 2, 3])]
    one = _scorer(params, jax.devices()[:1], rows=1, max_length=32).score(requests)
    many = _scorer(params, jax.devices()[:2], rows=4, max_length=32).score(requests)
    for (a, ga), (b, gb) in zip(one, many):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-5) and ga == gb


def test_rolling_windows_of_a_long_document_add_up_to_each_token_given_its_window(params):
    """A document of 20 tokens in lm-eval's disjoint rolling windows of max_length 8 after a prefix token
    (lm_eval.utils.get_rolling_token_windows + make_disjoint_window give exactly these): every token is
    scored once, given at most max_length tokens before it, and the windows' scores add up."""
    doc, prefix, max_length = [(7 * i) % 90 + 3 for i in range(20)], 0, 8
    windows = [([prefix], doc[:8]), (doc[7:8], doc[8:16]), (doc[11:16], doc[16:20])]
    scores = _scorer(params, jax.devices()[:1], rows=2, max_length=max_length).score(windows)
    want = [_reference(params, ctx, cont, max_length)[0] for ctx, cont in windows]
    assert [s for s, _ in scores] == pytest.approx(want, rel=1e-5)
    assert sum(s for s, _ in scores) == pytest.approx(sum(want), rel=1e-5)
    assert [t for _, cont in windows for t in cont] == doc


# --- greedy generation ----------------------------------------------------------------------------------


def test_prefill_chunks_are_the_powers_of_two_of_the_length():
    assert prefill_chunks(13) == [8, 4, 1] and prefill_chunks(16) == [16] and prefill_chunks(1) == [1]


def test_prompts_of_mixed_lengths_decode_as_each_prompt_alone(params):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [12, 13, 14, 15], [1, 2]]
    gen = Generator(params, generation.for_inference(TINY), rows=4)
    got = gen.generate(prompts, 6, done=lambda tokens: False)
    for prompt, tokens in zip(prompts, got):
        assert tokens == generation.generate(params, TINY, prompt, 6)[0].tolist()


def test_a_row_stops_when_done_says_so_and_the_others_go_on(params):
    prompts = [[5, 6, 7], [20, 21]]
    full = [generation.generate(params, TINY, p, 5)[0].tolist() for p in prompts]
    assert full[1][:2] != full[0][:2]
    gen = Generator(params, generation.for_inference(TINY), rows=3)  # one padding row
    got = gen.generate(prompts, 5, done=lambda tokens: tokens == full[0][:2])
    assert got == [full[0][:2], full[1]]


# --- stop rules ----------------------------------------------------------------------------------------

VOCAB = {1: "Hello", 2: " world", 3: ".", 4: "\n", 0: "<eos>", 9: "<|im_end|>"}


def _shown(ids):
    return "".join(VOCAB[i] for i in ids)


def _visible(ids):
    return "".join(VOCAB[i] for i in ids if i not in (0, 9))


def test_a_continuation_is_done_at_its_eos_or_a_stop_sequence_in_its_text_with_special_tokens_shown():
    rule = StopRule(("\n", "<|im_end|>", ""), eos_id=0)
    assert not rule.done([1, 2], _shown)
    assert rule.done([1, 2, 4], _shown) and rule.done([1, 9], _shown) and rule.done([1, 0], _shown)


def test_the_answer_drops_special_tokens_and_is_cut_before_the_first_stop_sequence():
    rule = StopRule((".", "\n", ""), eos_id=0)
    assert rule.text([1, 2, 3, 2, 4], _visible) == "Hello world"
    assert rule.text([1, 4, 2, 3], _visible) == "Hello"  # each stop in turn: the first occurrence wins
    assert rule.text([1, 9, 2, 0, 3], _visible) == "Hello world"  # nothing after the EOS
    assert StopRule((), eos_id=None).text([1, 2, 0], _visible) == "Hello world"


def test_the_eval_mesh_keeps_the_runs_axes_where_they_fit_and_else_uses_one_fsdp_axis():
    devices = jax.devices()[:4]
    tensor = dataclasses.replace(MeshConfig(), ici_fsdp_parallelism=-1, ici_tensor_parallelism=2)
    assert dict(eval_mesh(tensor, devices).shape) == {"data": 1, "fsdp": 2, "context": 1, "tensor": 2, "expert": 1}
    too_big = dataclasses.replace(MeshConfig(), num_slices=4, ici_fsdp_parallelism=1, ici_tensor_parallelism=8)
    assert dict(eval_mesh(too_big, devices).shape) == {
        "data": 1,
        "fsdp": 4,
        "context": 1,
        "tensor": 1,
        "expert": 1,
    }
    assert row_shards(eval_mesh(tensor, devices), RULES) == 2
