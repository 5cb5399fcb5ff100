"""DPO (objective=dpo): TRL's losses, per-row reply log-probabilities, the step's loss and gradient against
an independent autodiff computation, the config's refusals, and pairs kept whole in the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import batch_layout_with_defaults, micro_config

from trainer import model
from trainer.config.errors import ConfigError
from trainer.config.schema import DataConfig, PreferenceConfig
from trainer.data.pipeline import make_train_iterator
from trainer.program import preference, step
from trainer.program.layout import batch_layout

PAIRS = "data/preference_sample/*.arrayrecord"


def _np_log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _trl_loss(kind, beta, eps, pc, pr, rc, rr):
    """TRL DPOTrainer.dpo_loss, written out in numpy."""
    h = (pc - pr) - (rc - rr)
    if kind == "sigmoid":
        return -_np_log_sigmoid(beta * h) * (1 - eps) - _np_log_sigmoid(-beta * h) * eps
    if kind == "hinge":
        return np.maximum(0.0, 1 - beta * h)
    return (h - 1 / (2 * beta)) ** 2


@pytest.mark.parametrize(
    "kind, beta, eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.3, 0.2), ("hinge", 0.5, 0.0), ("ipo", 0.2, 0.0)]
)
def test_each_loss_type_is_trls_formula_and_the_metrics_are_trls(kind, beta, eps):
    rng = np.random.default_rng(0)
    policy, reference = rng.normal(-20, 5, 8), rng.normal(-20, 5, 8)
    tokens = rng.integers(1, 30, 8).astype(np.float32)
    cfg = PreferenceConfig(dpo_beta=beta, dpo_loss_type=kind, dpo_label_smoothing=eps)
    loss, m = preference.preference_sums(jnp.asarray(policy), jnp.asarray(reference), jnp.asarray(tokens), cfg)
    scale = tokens if kind == "ipo" else np.ones(8)  # TRL's IPO averages over each reply's tokens
    p, r = policy / scale, reference / scale
    pc, pr, rc, rr = p[0::2], p[1::2], r[0::2], r[1::2]
    np.testing.assert_allclose(float(loss), _trl_loss(kind, beta, eps, pc, pr, rc, rr).sum(), rtol=1e-5)
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    np.testing.assert_allclose(float(m["rewards/chosen"]), chosen.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["rewards/rejected"]), rejected.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["rewards/margins"]), (chosen - rejected).sum(), rtol=1e-5, atol=1e-5)
    assert float(m["rewards/accuracies"]) == float((chosen > rejected).sum())
    np.testing.assert_allclose(float(m["logps/chosen"]), pc.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["logps/rejected"]), pr.sum(), rtol=1e-5)
    assert float(m["pairs"]) == 4


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo"])
def test_a_pair_without_both_replies_adds_nothing_to_the_loss_its_gradient_or_the_metrics(kind):
    """Padding pairs (an exhausted held-out stream: both rows empty) and a pair whose rejected reply was cut
    entirely (its row has no reply token) count as nothing: the sums equal those of the whole pairs alone."""
    rng = np.random.default_rng(1)
    policy, reference = rng.normal(-20, 5, 8), rng.normal(-20, 5, 8)
    tokens = rng.integers(1, 30, 8).astype(np.float32)
    cfg = PreferenceConfig(dpo_beta=0.2, dpo_loss_type=kind)
    whole = preference.preference_sums(jnp.asarray(policy[:4]), jnp.asarray(reference[:4]), tokens[:4], cfg)
    tokens[4:] = [7, 0, 0, 0]  # pair 2: rejected reply cut; pair 3: padding
    policy[5:], reference[5:] = 0.0, 0.0  # an empty row's reply log-probability sum

    def loss(p):
        return preference.preference_sums(p, jnp.asarray(reference), jnp.asarray(tokens), cfg)

    (total, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(policy))
    np.testing.assert_allclose(float(total), float(whole[0]), rtol=1e-6)
    assert float(metrics["pairs"]) == 2
    for name, value in whole[1].items():
        np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-6, atol=1e-6, err_msg=name)
    assert np.all(np.asarray(grad)[4:] == 0) and np.any(np.asarray(grad)[:4] != 0)


def _cfg(*overrides):
    return micro_config(
        "dtype=float32", "objective=dpo", "dataset_type=arrayrecord", f"grain_train_files={PAIRS}", *overrides
    )


def _pair_batch(cfg, pairs: int, seed: int = 0) -> dict:
    """Pairs of rows sharing a prompt, masked on their (different) replies."""
    rng = np.random.default_rng(seed)
    t, v = cfg.data.max_target_length, cfg.model.vocab_size
    rows = []
    for _ in range(pairs):
        prompt = rng.integers(0, v, 6)
        for _ in range(2):
            reply = rng.integers(0, v, int(rng.integers(3, t - 6)))
            doc = np.concatenate([prompt, reply])
            n = len(doc) - 1
            row = {
                k: np.zeros(t, np.int32) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")
            }
            row["inputs"][:n], row["targets"][:n] = doc[:-1], doc[1:]
            row["positions"][:n], row["segment_ids"][:n] = np.arange(n), 1
            row["loss_mask"][len(prompt) - 1 : n] = 1
            rows.append(row)
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _independent_logps(params, cfg, batch):
    """Per-row reply log-probability sums from the whole logits and log_softmax (no chunks, no custom path)."""
    hidden, _ = model.forward(params, cfg, batch["inputs"], batch["positions"], batch["segment_ids"])
    logits = model.logits_from_hidden(params, cfg, hidden).astype(jnp.float32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch["targets"][..., None], -1)[..., 0]
    return jnp.sum(logp * batch["loss_mask"], axis=1)


@pytest.mark.parametrize("chunk_tokens", [step.LOSS_CHUNK_TOKENS, 8])
def test_sequence_logps_are_the_log_softmax_of_the_targets_in_any_chunking(monkeypatch, chunk_tokens):
    monkeypatch.setattr(step, "LOSS_CHUNK_TOKENS", chunk_tokens)  # 8: four chunks of a 2 x 16 batch
    cfg = _cfg()
    params = model.init_params(cfg.model, jax.random.key(0))
    batch = _pair_batch(cfg, 1)
    got, _ = step.row_logps(params, cfg.model, batch)
    np.testing.assert_allclose(got, _independent_logps(params, cfg.model, batch), rtol=1e-5)


def _moved(params, seed=1):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [p + 0.05 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
    )


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "hinge"])
def test_the_steps_dpo_loss_and_gradient_equal_an_independent_autodiff(monkeypatch, kind):
    monkeypatch.setattr(step, "LOSS_CHUNK_TOKENS", 8)  # the chunked path, several chunks
    cfg = _cfg(f"dpo_loss_type={kind}", "dpo_beta=0.5")
    reference = model.init_params(cfg.model, jax.random.key(0))
    policy = _moved(reference)  # a policy that has moved away from its reference
    batch = _pair_batch(cfg, 4)
    summed = step._summed_grads(cfg.model, 0.0, 2, None, step.model_weights(cfg.model, None), cfg.preference)
    grads, parts = summed((policy, reference), batch, step.UNSHARDED)

    tokens = jnp.asarray(batch["loss_mask"].sum(1), jnp.float32)

    def independent(p):
        pol, ref = _independent_logps(p, cfg.model, batch), _independent_logps(reference, cfg.model, batch)
        if kind == "ipo":
            pol, ref = pol / tokens, ref / tokens
        h = (pol[0::2] - pol[1::2]) - (ref[0::2] - ref[1::2])
        beta = cfg.preference.dpo_beta
        losses = {
            "sigmoid": -jax.nn.log_sigmoid(beta * h),
            "hinge": jax.nn.relu(1 - beta * h),
            "ipo": (h - 1 / (2 * beta)) ** 2,
        }[kind]
        return jnp.mean(losses)

    want_loss, want_grads = jax.value_and_grad(independent)(policy)
    assert float(parts["pairs"]) == 4
    np.testing.assert_allclose(float(parts["ce_sum"]) / 4, float(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(got) / 4, want, rtol=2e-4, atol=1e-6)


def test_the_train_step_reports_trls_metrics_and_does_not_move_the_reference():
    cfg = _cfg()
    reference = model.init_params(cfg.model, jax.random.key(0))
    import optax

    train = step.make_train_step(
        cfg.model, optax.sgd(0.1), z_loss_multiplier=0.0, micro_steps=1, preference=cfg.preference
    )
    state = {"step": jnp.zeros((), jnp.int32), "params": reference, "opt_state": optax.sgd(0.1).init(reference)}
    kept = jax.tree.map(np.asarray, reference)
    new, m = jax.jit(train)(state, _pair_batch(cfg, 2), reference)
    assert float(m["loss"]) == pytest.approx(float(np.log(2.0)), rel=1e-6)  # policy == reference: -log sigmoid(0)
    for name in preference.METRICS:
        assert name in m
    assert float(m["rewards/margins"]) == pytest.approx(0.0, abs=1e-5)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(kept)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(kept)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["use_sft=true"], "use_sft=true means objective=sft, but objective=dpo"),
        (["dataset_type=synthetic"], "objective=dpo trains on records"),
        (["dpo_beta=0"], "dpo_beta=0.0 must be > 0"),
        (["dpo_loss_type=ipo", "dpo_label_smoothing=0.1"], "applies to dpo_loss_type=sigmoid only"),
        (["dpo_loss_type=kto"], "dpo_loss_type"),
    ],
)
def test_the_config_refuses_what_dpo_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)


def test_objective_sft_is_use_sft():
    cfg = micro_config("objective=sft", "dataset_type=arrayrecord")
    assert cfg.data.sft and not cfg.data.dpo
    assert micro_config("use_sft=true", "dataset_type=arrayrecord").data.sft


def _row_blocks(rows: int, micro: int, shards: int) -> list[np.ndarray]:
    """The global row indices each micro-step runs on each batch shard (the step's `_split_micro` of the
    rows each shard holds)."""
    index = np.arange(rows)
    per_shard = index.reshape(shards, rows // shards)
    return [blk for shard in per_shard for blk in shard.reshape(micro, -1)] + [
        blk for m in index.reshape(micro, -1) for blk in m.reshape(shards, -1)
    ]


@pytest.mark.parametrize("active", [4, 3, 2, 1])
@pytest.mark.parametrize("policy", ["keep_global", "scale"])
def test_no_layout_micro_step_or_survivor_mesh_splits_a_pair(active, policy):
    """4 slices of 3 devices, 3 pairs per device: after losing slices (replica-resize), rows 2k and 2k + 1
    stay in one micro-step on one batch shard."""
    for shards_per_slice in (1, 3):
        layout = batch_layout(
            per_device_batch_size=3,
            accumulation_steps=1,
            num_slices=4,
            policy=policy,
            devices_per_slice=3,
            active_slices=active,
            batch_shards=active * shards_per_slice,
            rows_per_example=2,
        )
        assert layout.global_batch_size % 2 == 0
        for block in _row_blocks(layout.global_batch_size, layout.micro_steps, active * shards_per_slice):
            assert len(block) % 2 == 0 and block[0] % 2 == 0


def test_a_batch_that_cannot_hold_whole_pairs_is_refused():
    with pytest.raises(ValueError, match="whole 2-row examples"):
        batch_layout_with_defaults(
            per_device_batch_size=1, devices_per_slice=2, batch_shards=4, rows_per_example=2
        )


def _data(**changes):
    base = dict(
        dataset_type="arrayrecord",
        grain_train_files=PAIRS,
        objective="dpo",
        max_target_length=256,
        grain_worker_count=0,
    )
    return DataConfig(**{**base, **changes})


def test_a_pair_is_rows_2k_and_2k_plus_1_masked_on_its_replies_and_resumes_exactly():
    it = make_train_iterator(_data(), vocab_size=8192, global_batch_size=8)
    batch = next(it)
    for k in range(4):
        chosen, rejected = (batch[key][[2 * k, 2 * k + 1]] for key in ("inputs", "loss_mask"))
        first = int(np.argmax(rejected[0] > 0))  # the reply starts where the mask does
        assert first > 0 and int(np.argmax(rejected[1] > 0)) == first  # the same prompt, then the replies
        np.testing.assert_array_equal(chosen[0][:first], chosen[1][:first])
        assert not np.array_equal(chosen[0], chosen[1])
    state = it.get_state()
    after = next(it)
    again = make_train_iterator(_data(), vocab_size=8192, global_batch_size=8)
    again.set_state(state)
    resumed = next(again)
    for key in after:
        np.testing.assert_array_equal(resumed[key], after[key])
    half = make_train_iterator(_data(), vocab_size=8192, global_batch_size=8, process_index=1, process_count=2)
    np.testing.assert_array_equal(next(half)["inputs"], batch["inputs"][4:])  # whole pairs per process


def test_a_chat_set_is_refused_as_preference_data():
    from trainer.data.errors import DataError

    with pytest.raises(DataError, match="objective=dpo reads preference records"):
        make_train_iterator(
            _data(grain_train_files="data/fc_sample/*.arrayrecord"), vocab_size=8192, global_batch_size=4
        )


class _NoEvents:
    def emit(self, name, **fields):
        pass


def test_the_reference_is_identified_in_checkpoints_and_a_resume_over_another_is_refused(tmp_path):
    """The reference is the frozen initial model, named like a LoRA base: a resume whose reference differs
    (here another init_weights_seed) is refused before compiling, never re-derived from the moved policy."""
    import dataclasses

    from trainer import preflight
    from trainer.checkpoint import compat
    from trainer.checkpoint.local_store import LocalStore
    from trainer.run import lora_base_record

    cfg = _cfg()
    assert cfg.frozen_base and lora_base_record(cfg) == {"init_weights_seed": 0}
    state = {"step": np.int32(3), "params": model.init_params(cfg.model, jax.random.key(0))}
    store = LocalStore(tmp_path, keep=1, events=_NoEvents(), config={}, lora_base=lora_base_record(cfg))
    store.write(3, jax.tree.map(np.asarray, state), {"cursor": 3})
    saved = preflight.local_step(tmp_path, 3, None)
    assert preflight.base_mismatch(cfg, saved) is None
    with pytest.raises(compat.CheckpointMismatch, match="init_weights_seed=0.*init_weights_seed=5"):
        preflight.check_saved_step(_cfg("init_weights_seed=5"), dataclasses.replace(saved, state=None))
    assert lora_base_record(micro_config()) is None  # pretraining holds no frozen model
