"""What exists only on a CUDA GPU: the cuDNN attention kernel itself, and XLA's GPU kernels made
deterministic so that a pause-and-resume through the CLI is bitwise. (The snapshot tests that also hold on a
GPU run there from tests/test_pinned_snapshots.py.) Skipped where JAX has no GPU (CI); run them with
`XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest tests/test_gpu.py tests/test_pinned_snapshots.py`
(the CLI runs in subprocesses that need the GPU's memory too)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from cli_harness import assert_same_params, events, metrics, run_cli
from devices import requires_gpu
from test_attention import _assert_matches_reference

from trainer.model import attention


@requires_gpu
def test_the_cudnn_kernel_matches_dot_product_with_packing_forward_and_backward():
    assert jax.default_backend() == "gpu"
    _assert_matches_reference(attention.cudnn_attention, jnp.bfloat16)


STEPS = 12
COMMON = [f"steps={STEPS}", "num_slices=1", "elastic_enabled=true", "checkpoint_period=4"]
COMMON += ["elastic_poll_interval_seconds=0.05", "elastic_timeout_seconds=120"]


@requires_gpu
def test_pause_and_resume_on_a_gpu_replays_to_the_same_parameters_bitwise(tmp_path):
    base = run_cli(tmp_path, "base", *COMMON, devices=1)
    assert base.returncode == 0, base.stderr[-3000:]
    again = run_cli(tmp_path, "again", *COMMON, devices=1)
    assert again.returncode == 0, again.stderr[-3000:]
    # Deterministic run to run: the CLI asks XLA for its deterministic GPU kernels (trainer/backends.py).
    assert_same_params(tmp_path / "again", tmp_path / "base")
    proc = run_cli(
        tmp_path, "pr", *COMMON, "snapshot_period=2", "fault_schedule=step=7,slice=0,down_s=1", devices=1
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "pr"
    assert all(r["mfu"] is not None for r in metrics(run))  # the H100/H200 peak: it ran on the GPU
    attempts = [e for e in events(run) if e["event"] == "attempt_start"]
    # One slice: its host memory, and the snapshot in it, went with it; the replay starts at the checkpoint.
    assert len(attempts) == 2 and attempts[1]["source"] == "checkpoint:4"
    assert sorted({r["step"] for r in metrics(run)}) == list(range(1, STEPS + 1))
    assert_same_params(run, tmp_path / "base")


@requires_gpu
def test_the_cudnn_kernel_runs_at_qwen3_0_6b_attention_shape():
    """2048 tokens, 16 heads of 128 (qwen3-0.6b's attention): the fused kernel compiles and runs."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 2048, 16, 128)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, 2048, 8, 128)), jnp.bfloat16)
    seg = jnp.ones((2, 2048), jnp.int32)
    out = jax.jit(attention.cudnn_attention)(q, kv, kv, seg)
    assert out.shape == q.shape and bool(jnp.isfinite(out.astype(jnp.float32)).all())
