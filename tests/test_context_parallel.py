"""Context parallelism (trainer/parallel/context.py, trainer/model/context_attention.py): a step with the
sequence split over the context axis equals the step without it, and each device exchanges the keys and
values of its own batch rows only."""

from __future__ import annotations

import dataclasses
import re
from functools import partial

import jax
import numpy as np
import optax
import pytest
from helpers import fresh_state_on_one_device, micro_config, synthetic_batch

from trainer.config import ConfigError
from trainer.parallel.context import reorder, unzigzag, zigzag_order


def test_zigzag_gives_each_device_one_early_and_one_late_chunk_and_an_equal_share_of_causal_work():
    order = zigzag_order(16, 2)
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    for shards in (2, 4):
        order = zigzag_order(32, shards)
        work = [int(np.sum(part + 1)) for part in np.split(order, shards)]  # keys a causal query sees
        assert len(set(work)) == 1, work
        x = np.arange(2 * 32 * 3).reshape(2, 32, 3)
        np.testing.assert_array_equal(unzigzag(reorder({"x": x}, order)["x"], shards), x)
    assert zigzag_order(8, 1).tolist() == list(range(8))
    with pytest.raises(ValueError, match="multiple of 8"):
        zigzag_order(20, 4)


def _packed(batch: dict) -> dict:
    """The batch with several documents per row, their boundaries crossing the shards' (and ragged
    across rows), positions restarting per document, and padding (segment 0) at the ends."""
    b = {k: np.array(v) for k, v in batch.items()}
    rows, length = b["inputs"].shape
    seg, pos = np.zeros_like(b["segment_ids"]), np.zeros_like(b["positions"])
    for r in range(rows):
        starts = [0, 3 + r, 11, 20 + r % 3]
        for s, (a, z) in enumerate(zip(starts, [*starts[1:], length - 2 - r % 2])):
            seg[r, a:z], pos[r, a:z] = s + 1, np.arange(z - a)
    b["segment_ids"], b["positions"] = seg, pos
    b["loss_mask"] = (seg > 0).astype(b["loss_mask"].dtype)
    return b


def _step(cfg, batch, *, context: int, strategy: str = "all_gather", data: int = 1, micro_steps: int = 2):
    """(new params, metrics, compiled text) of one SGD step on 4 devices: data x fsdp x context. The
    rate is large (1e3) so that the update, not the old params, sets the new params' rounding."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.parallel.activations import ActivationSharding
    from trainer.parallel.mesh import build_mesh
    from trainer.program.step import make_train_step

    mesh_cfg = dataclasses.replace(
        cfg.mesh, ici_data_parallelism=data, ici_fsdp_parallelism=-1, ici_context_parallelism=context
    )
    mesh = build_mesh(mesh_cfg, [jax.devices()[:4]])
    _, state = fresh_state_on_one_device(cfg)
    rows = P(("data", "fsdp"))
    step = make_train_step(
        cfg.model,
        optax.sgd(1e3),
        z_loss_multiplier=cfg.optim.z_loss_multiplier,
        micro_steps=micro_steps,
        batch_spec=rows,
        shard=ActivationSharding(mesh, mesh_cfg.logical_axis_rules, context_strategy=strategy),
    )
    replicated = NamedSharding(mesh, P())
    state = jax.device_put({**state, "opt_state": optax.sgd(1e3).init(state["params"])}, replicated)
    compiled = jax.jit(step).lower(state, jax.device_put(batch, NamedSharding(mesh, rows))).compile()
    new, metrics = jax.device_get(compiled(state, jax.device_put(batch, NamedSharding(mesh, rows))))
    return new["params"], metrics, compiled.as_text()


KV_MOVES = ("all-gather", "collective-permute")
_MOE = ("num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "load_balance_loss_weight=0.01")


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention, context, strategy, data, extra",
    [
        # Each kernel with each strategy, both axis sizes, with and without data replicas.
        ("dot_product", 2, "all_gather", 2, ()),
        ("dot_product", 4, "ring", 1, ()),
        ("flash", 2, "ring", 2, ("remat_policy=full",)),
        # Tokens over capacity are dropped by their place in the sequence, not in the shards' order.
        ("flash", 4, "all_gather", 1, (*_MOE, "moe_capacity_factor=0.5")),
    ],
)
def test_a_step_with_the_sequence_split_equals_the_step_without(attention, context, strategy, data, extra):
    """Loss and gradients (fp32, two accumulated micro-steps, packed documents crossing the shard
        boundaries) equal the unsplit step's on the same data-parallel layout within 1e-5 (each parameter's
    update within 1e-5 of its norm); the split is real
        (the compiled step moves keys and values across the context axis the strategy's way)."""
    cfg = micro_config(
        "max_target_length=32",
        f"attention={attention}",
        "sa_block_q=4",
        "sa_block_kv=4",
        "z_loss_multiplier=1e-4",
        *extra,
    )
    batch = _packed(synthetic_batch(cfg, rows=8))
    ref, m_ref, _ = _step(cfg, batch, context=1, data=data)
    got, m_got, text = _step(cfg, batch, context=context, strategy=strategy, data=data)
    assert ("collective-permute" if strategy == "ring" else "all-gather") in text
    for key in ("loss", "z_loss", "aux_loss", "tokens", "grad_norm"):
        assert float(m_got[key]) == pytest.approx(float(m_ref[key]), rel=1e-5, abs=1e-7), key
    start = fresh_state_on_one_device(cfg)[1]["params"]
    for a, b, p in zip(jax.tree.leaves(got), jax.tree.leaves(ref), jax.tree.leaves(start)):
        mine, theirs = np.asarray(a) - np.asarray(p), np.asarray(b) - np.asarray(p)  # the updates
        assert np.linalg.norm(mine - theirs) <= 1e-5 * np.linalg.norm(theirs)


@pytest.mark.parametrize("strategy, moves", [("all_gather", "all-gather"), ("ring", "collective-permute")])
def test_each_device_moves_the_keys_and_values_of_its_own_batch_rows_only(strategy, moves):
    """fsdp 2 x context 2, 8 rows: each device holds 4 rows, and the compiled step's all-gathers (ring:
    collective-permutes) of keys and values [B, T, kv_heads, head_dim] carry those 4 rows, never all 8."""
    from trainer.aot.hlo import collectives

    cfg = micro_config("max_target_length=40", "attention=dot_product")  # T 40, 20 per shard: no model dim
    batch = _packed(synthetic_batch(cfg, rows=8))
    *_, text = _step(cfg, batch, context=2, strategy=strategy, data=1, micro_steps=1)
    found = collectives(text, devices_per_slice=4, num_slices=1)
    kv = re.compile(r"\[(\d+),(?:20|40),2,16\]")  # keys or values: 2 kv heads of 16
    rows = [(c.kind, int(m.group(1))) for c in found if c.kind in KV_MOVES for m in kv.finditer(c.shape)]
    assert moves in {kind for kind, _ in rows}, [c.shape for c in found]
    assert {n for _, n in rows} == {4}, rows


def test_autoselected_picks_a_kernel_that_runs_on_a_split_sequence():
    from trainer.model import attention

    pick = partial(attention.resolve, "autoselected", head_dim=128, dtype="bfloat16", seq_len=4096)
    assert (pick(backend="tpu"), pick(backend="gpu")) == ("splash", "cudnn_flash")
    assert pick(backend="tpu", context=2) == pick(backend="gpu", context=2) == "flash"
    assert pick(backend="cpu", context=2, seq_len=512) == "dot_product"


def test_config_validation_names_the_length_and_the_kernels_context_parallelism_needs():
    from trainer.config import load_config

    with pytest.raises(ConfigError, match="max_target_length=100 is not a multiple of 8"):
        load_config("base.yml", ["model=qwen3-tiny", "ici_context_parallelism=4", "max_target_length=100"])
    with pytest.raises(ConfigError, match="attention=splash does not run under context parallelism"):
        load_config("base.yml", ["model=qwen3-tiny", "ici_context_parallelism=2", "attention=splash"])
    with pytest.raises(ConfigError, match="context_parallel_strategy"):
        load_config("base.yml", ["model=qwen3-tiny", "context_parallel_strategy=ringg"])


@pytest.mark.slow
def test_per_device_activation_memory_falls_with_the_context_axis():
    """The compiled step's temporary memory per device (flash, 2048 tokens) with the sequence split 4
    ways is well under half the unsplit step's: activations are split, only flash's tiles are not."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.parallel.activations import ActivationSharding
    from trainer.parallel.mesh import build_mesh
    from trainer.program.step import make_train_step

    cfg = micro_config("max_target_length=2048", "attention=flash", "sa_block_q=256", "sa_block_kv=256")
    _, state = fresh_state_on_one_device(cfg)
    state = {**state, "opt_state": optax.sgd(1.0).init(state["params"])}
    temp = {}
    for context in (1, 4):
        mesh_cfg = dataclasses.replace(cfg.mesh, ici_fsdp_parallelism=1, ici_context_parallelism=context)
        mesh = build_mesh(mesh_cfg, [jax.devices()[:context]])
        step = make_train_step(
            cfg.model,
            optax.sgd(1.0),
            z_loss_multiplier=0.0,
            micro_steps=1,
            batch_spec=P(),
            shard=ActivationSharding(mesh, mesh_cfg.logical_axis_rules),
        )
        whole = NamedSharding(mesh, P())
        abstract = jax.tree.map(lambda x, s=whole: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state)
        names = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
        batch = {k: jax.ShapeDtypeStruct((2, 2048), jnp.int32, sharding=whole) for k in names}
        temp[context] = jax.jit(step).lower(abstract, batch).compile().memory_analysis().temp_size_in_bytes
    assert temp[4] < 0.5 * temp[1], temp


def test_the_train_state_is_split_over_the_context_axis_as_over_fsdp():
    """Params and optimizer state are sharded over the context axis too (the `embed` rule), so a chip's
    share of the state falls with the context axis as activations do, rather than every context chip
    holding the whole fsdp shard."""
    from trainer.parallel.mesh import build_mesh
    from trainer.program.state import state_shardings

    cfg = micro_config("max_target_length=2048")
    per_device = {}
    for context in (1, 4):
        mesh_cfg = dataclasses.replace(cfg.mesh, ici_fsdp_parallelism=1, ici_context_parallelism=context)
        mesh = build_mesh(mesh_cfg, [jax.devices()[:context]])
        shardings, abstract = state_shardings(cfg.model, mesh_cfg.logical_axis_rules, mesh, optax.adamw(1e-3))
        per_device[context] = sum(
            int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
            for s, a in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract), strict=True)
        )
    assert per_device[4] < 0.3 * per_device[1], per_device


@pytest.mark.slow
def test_the_cli_trains_with_context_parallelism_and_its_losses_equal_the_run_without(tmp_path):
    """The issue's command at a CI-sized length: a tiny model, 512 tokens split 4 ways with flash."""
    from cli_harness import metrics, run_cli

    args = ("max_target_length=512", "attention=flash", "sa_block_q=64", "sa_block_kv=64", "steps=2")
    losses = {}
    for context in (1, 4):
        proc = run_cli(
            tmp_path, f"cp{context}", f"ici_context_parallelism={context}", *args, devices=4, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[context] = [r["loss"] for r in metrics(tmp_path / f"cp{context}")]
    assert len(losses[4]) == 2 and np.allclose(losses[4], losses[1], rtol=1e-5, atol=0), losses
    bad = run_cli(tmp_path, "odd", "ici_context_parallelism=4", "max_target_length=500", devices=4)
    assert bad.returncode == 2 and "multiple of 8" in bad.stderr, bad.stderr[-2000:]


def test_the_cli_trains_one_sequence_per_context_group_with_a_fractional_per_device_batch_size(tmp_path):
    """per_device_batch_size=0.5 on 4 devices with the sequence split 2 ways: 2 sequences per step, one on
    each context group of 2 chips (the batch is split over fsdp=2 only)."""
    from cli_harness import events, metrics, run_cli

    args = ("ici_context_parallelism=2", "per_device_batch_size=0.5", "steps=2")
    proc = run_cli(tmp_path, "half", *args, devices=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["global_batch_size"] for r in metrics(tmp_path / "half")] == [2, 2]
    start = next(e for e in events(tmp_path / "half") if e["event"] == "attempt_start")
    assert (start["global_batch_size"], start["micro_steps"]) == (2, 1)


def test_the_cli_refuses_a_fraction_finer_than_a_context_group_with_exit_2_before_compiling(tmp_path):
    from cli_harness import run_cli

    proc = run_cli(tmp_path, "bad", "ici_context_parallelism=2", "per_device_batch_size=0.25", devices=4)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "per_device_batch_size=0.25 x 4 devices per slice is 1 sequence, which does not split over the slice's "
        "2 batch shards (data x fsdp x expert): use a multiple of 0.5 (1 sequence per device group of 2)"
    ) in proc.stderr
    assert "compiled the train step" not in proc.stderr
