"""The `attention` implementations agree with dot_product: causal mask, packing's segment ids (and padding
segment 0), GQA, forward and backward, in float32 and bfloat16, alone, through the model and on a mesh.

Tolerances (max abs difference, inputs ~N(0,1), outputs and gradients of order 1-5):
- float32: 2e-5 (outputs) and 5e-5 (gradients): only summation order differs.
- bfloat16: 3e-2 (outputs) and 6e-2 (gradients): a few bf16 ulps at magnitude ~4; flash rounds the
  unnormalised tile probabilities to bf16 where dot_product rounds the normalised ones.
splash runs in Pallas interpret mode (the TPU kernel's own code, executed by XLA on CPU); cudnn_flash's
wrapper runs through `jax.nn.dot_product_attention(implementation="xla")` here (the cuDNN kernel itself
needs a GPU, and on CPU the wrapper refuses with a message naming the fix).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_harness import metrics, run_cli
from helpers import micro_config, replace, synthetic_batch
from jax.sharding import NamedSharding

from trainer import model as qwen3
from trainer.model import attention
from trainer.parallel.activations import ActivationSharding
from trainer.parallel.mesh import build_mesh
from trainer.parallel.rules import logical_to_spec, tree_shardings
from trainer.program.step import loss_sums

TOL = {jnp.float32: (2e-5, 5e-5), jnp.bfloat16: (3e-2, 6e-2)}  # (outputs, gradients)
N_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _qkv(t: int, dtype, b: int = 2, seed: int = 0):
    """q/k/v, two packed rows (three documents and a padded tail; one whole document), a cotangent."""
    rng = np.random.default_rng(seed)  # numpy: no eager JAX ops to compile
    q, cot = (rng.standard_normal((b, t, N_HEADS, HEAD_DIM), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, KV_HEADS, HEAD_DIM), np.float32) for _ in range(2))
    cut = [t // 3, t // 3 + t // 4, t - t // 6]
    row0 = np.zeros(t, np.int32)
    row0[: cut[0]], row0[cut[0] : cut[1]], row0[cut[1] : cut[2]] = 1, 2, 3  # then padding (0)
    seg = jnp.asarray(np.stack([row0] + [np.ones(t, np.int32)] * (b - 1)))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, seg, jnp.asarray(cot)


def _reference(q, k, v, seg):
    return attention.grouped_attention(q, k, v, attention.segment_mask(seg), k.shape[2])


def _out_and_grads(fn, q, k, v, seg, cot):
    def objective(q, k, v):
        return jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * cot)

    out = jax.jit(fn)(q, k, v, seg)
    return out, jax.jit(jax.grad(objective, argnums=(0, 1, 2)))(q, k, v)


@functools.cache
def _reference_out_and_grads(t: int, dtype):
    return _out_and_grads(_reference, *_qkv(t, dtype))


def _assert_matches_reference(fn, dtype, t: int = 256):
    q, k, v, seg, cot = _qkv(t, dtype)
    out, grads = _out_and_grads(fn, q, k, v, seg, cot)
    ref_out, ref_grads = _reference_out_and_grads(t, dtype)
    out_tol, grad_tol = TOL[dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=out_tol, rtol=0)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype and g.shape == r.shape
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(r, np.float32), atol=grad_tol, rtol=0, err_msg=f"d{name}"
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_flash_matches_dot_product_over_several_blocks_and_a_padded_tail(dtype):
    # 256 tokens in 96x64 tiles: padded to 384 (3 query blocks, 6 key blocks); causal skipping in both passes.
    _assert_matches_reference(partial(attention.flash_attention, block_q=96, block_kv=64), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_cudnn_flash_wrapper_matches_dot_product_through_xla(dtype):
    _assert_matches_reference(partial(attention.cudnn_attention, implementation="xla"), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_splash_kernel_in_pallas_interpret_mode_matches_dot_product(dtype):
    # Tiles of 128: two query and two key blocks, the upper-right one skipped by the causal mask.
    splash = partial(attention.splash_attention, block_q=128, block_kv=128, interpret=True)
    _assert_matches_reference(splash, dtype)


def test_accelerator_kernels_refuse_cpu_with_the_fix():
    q, k, v, seg, _ = _qkv(128, jnp.bfloat16)
    with pytest.raises(ValueError, match="cudnn_flash needs a CUDA GPU.*attention=flash"):
        attention.AttentionKernel("cudnn_flash")(q, k, v, seg)
    with pytest.raises(ValueError, match="splash is a TPU kernel.*attention=flash"):
        attention.AttentionKernel("splash")(q, k, v, seg)


def test_splash_needs_a_sequence_and_tiles_in_whole_128_lanes():
    with pytest.raises(ValueError, match="multiple of 128.*got 200"):
        attention.splash_kernel(200, N_HEADS, interpret=True)
    with pytest.raises(ValueError, match="sa_block_q=192 and sa_block_kv=512.*multiples of 128"):
        attention.splash_kernel(1024, N_HEADS, block_q=192, interpret=True)


def test_splash_traces_with_abstract_inputs_for_ahead_of_time_compiles():
    q, k, v, seg, _ = _qkv(256, jnp.bfloat16, b=1)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, seg)]
    lowered = jax.jit(partial(attention.splash_attention, interpret=True)).trace(*abstract).lower()
    assert lowered.out_info.shape == q.shape


def test_autoselected_picks_the_fused_kernel_of_each_backend():
    pick = partial(attention.resolve, "autoselected", head_dim=128, dtype="bfloat16")
    assert pick(backend="tpu", seq_len=4096) == "splash"
    assert pick(backend="tpu", seq_len=1000) == "flash"  # splash tiles are whole 128-lane blocks
    assert pick(backend="gpu", seq_len=4096) == "cudnn_flash"
    assert attention.resolve("autoselected", backend="gpu", seq_len=4096, head_dim=128, dtype="float32") == "flash"
    assert pick(backend="cpu", seq_len=attention.CPU_FLASH_MIN_LENGTH) == "flash"
    assert pick(backend="cpu", seq_len=attention.CPU_FLASH_MIN_LENGTH - 1) == "dot_product"
    assert attention.resolve("splash", backend="cpu", seq_len=100, head_dim=64, dtype="float32") == "splash"


# ---------------------------------------------------------------------------------------------------
# Through the model and on a mesh.


def _model_loss_and_grads(cfg, devices):
    """Mean token loss and its param gradients of one synthetic global batch of 8 rows on `devices`
    (the same computation the train step differentiates, QK-norm and RoPE included)."""
    mesh = build_mesh(cfg.mesh, [devices])
    rules = cfg.mesh.logical_axis_rules
    params = qwen3.init_params(cfg.model, jax.random.key(0))
    shardings = tree_shardings(qwen3.param_logical_axes(cfg.model), qwen3.abstract_params(cfg.model), mesh, rules)
    params = jax.device_put(params, shardings)
    seq = cfg.data.max_target_length
    batch_sh = NamedSharding(mesh, logical_to_spec(("activation_batch", None), (8, seq), mesh, rules))
    # Synthetic rows pack several documents and end in padding: segment ids 1, 2, ... then 0.
    batch = {key: jax.device_put(val, batch_sh) for key, val in synthetic_batch(cfg, rows=8).items()}

    def objective(p, b):
        total, parts = loss_sums(p, cfg.model, 0.0, b, shard=ActivationSharding(mesh, rules))
        return total / parts["tokens"]

    loss, grads = jax.jit(jax.value_and_grad(objective))(params, batch)
    return float(loss), jax.device_get(grads)


def test_model_with_flash_on_a_mesh_matches_dot_product_on_one_device():
    """Through QK-norm and RoPE, with 3 tiles per sequence, batch over fsdp=2 and heads over tensor=2."""
    base = micro_config("dtype=float32", "max_target_length=48", "sa_block_q=16", "sa_block_kv=16")
    ref_loss, ref_grads = _model_loss_and_grads(replace(base, "model", attention="dot_product"), jax.devices()[:1])
    cfg = replace(base, "model", attention="flash")
    cfg = replace(cfg, "mesh", ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
    loss, grads = _model_loss_and_grads(cfg, jax.devices()[:4])
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_splash_runs_per_shard_on_a_mesh():
    cfg = micro_config("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    mesh = build_mesh(cfg.mesh, [jax.devices()])
    shard = ActivationSharding(mesh, cfg.mesh.logical_axis_rules)
    q, k, v, seg, _ = _qkv(128, jnp.float32, b=4)
    splash = partial(attention.splash_attention, shard=shard, block_q=128, block_kv=128, interpret=True)
    out = jax.jit(splash)(q, k, v, seg)
    assert not out.sharding.is_fully_replicated
    np.testing.assert_allclose(out, _reference(q, k, v, seg), atol=TOL[jnp.float32][0], rtol=0)


def test_autoselected_logs_its_choice_once_per_trace(caplog):
    cfg = dataclasses.replace(micro_config().model, attention="autoselected")
    tokens = jnp.zeros((1, 16), jnp.int32)
    params = qwen3.init_params(cfg, jax.random.key(0))
    with caplog.at_level(logging.INFO, logger="trainer.model.transformer"):
        jax.jit(partial(qwen3.forward, cfg=cfg)).trace(
            params, inputs=tokens, positions=tokens, segment_ids=tokens + 1
        )
    lines = [r.getMessage() for r in caplog.records if "attention=autoselected" in r.getMessage()]
    assert lines == [f"attention=autoselected -> dot_product (backend {jax.default_backend()}, sequence 16)"]


def test_cli_trains_with_flash_on_two_devices_and_refuses_a_splash_length_before_compiling(tmp_path):
    proc = run_cli(tmp_path, "flash", "steps=2", "attention=flash", "sa_block_q=16", "sa_block_kv=16", devices=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("STATUS: finished step=2")
    assert [r["step"] for r in metrics(tmp_path / "flash")] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in metrics(tmp_path / "flash"))

    bad = run_cli(tmp_path, "splash", "attention=splash", "max_target_length=200", devices=1)
    assert bad.returncode == 2
    assert "attention=splash needs max_target_length=200" in bad.stderr + bad.stdout
    assert not (tmp_path / "splash").exists()
