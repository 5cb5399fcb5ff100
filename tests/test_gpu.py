"""On a CUDA GPU: the cuDNN attention kernel itself, pinned-host snapshots in real host memory, and bitwise
pause-and-resume through the CLI. Skipped where JAX has no GPU (CI); run them on a GPU machine with
`XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest tests/test_gpu.py` (the CLI runs in subprocesses
that need the GPU's memory too)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_harness import assert_same_params, events, metrics, run_cli
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_attention import _assert_matches_reference
from test_pinned_snapshots import Events, numpy_conversions  # noqa: F401 (fixture)

from trainer.elastic.pinned_snapshots import PINNED, PinnedSnapshots
from trainer.model import attention


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = pytest.mark.skipif(not _gpus(), reason="needs a CUDA GPU")


def test_the_cudnn_kernel_matches_dot_product_with_packing_forward_and_backward():
    assert jax.default_backend() == "gpu"
    _assert_matches_reference(attention.cudnn_attention, jnp.bfloat16)


def test_a_pinned_snapshot_lives_in_host_memory_and_restores_without_numpy(numpy_conversions):  # noqa: F811
    mesh = jax.make_mesh((1, 1), ("data", "fsdp"), devices=_gpus()[:1])
    big = jnp.arange(64 * 1024 * 1024, dtype=jnp.float32).reshape(8192, 8192)  # 256 MiB: a real transfer
    state = {
        "w": jax.device_put(big, NamedSharding(mesh, P("fsdp"))),
        "step": jax.device_put(jnp.int32(3), NamedSharding(mesh, P())),
    }
    expected = {"w": np.asarray(state["w"]), "step": 3}
    numpy_conversions.clear()
    events = Events()
    snaps = PinnedSnapshots(events)
    snaps.take(3, state, {"cursor": 1}, block=True)
    state = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)  # the step donates
    taken = events.named("snapshot_taken")[0]
    assert taken["memory"] == PINNED and taken["host_bytes"] == 0
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored, data_state = snaps.load(abstract)
    assert numpy_conversions == []
    assert data_state == {"cursor": 1}
    assert restored["w"].sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(restored["w"]), expected["w"])
    assert int(restored["step"]) == 3


def test_a_numpy_snapshot_copies_through_pinned_host_memory_and_survives_the_next_donation():
    """The snapshots of several processes: each shard leaves the GPU by a pinned-host copy (no second copy
    of the state in GPU memory), and the step that donates the state right after cannot touch it."""
    from trainer.elastic import snapshot
    from trainer.elastic.snapshot import HostSnapshots

    mesh = jax.make_mesh((1, 1), ("data", "fsdp"), devices=_gpus()[:1])
    w = jax.device_put(
        jnp.arange(64 * 1024 * 1024, dtype=jnp.float32).reshape(8192, 8192), NamedSharding(mesh, P())
    )
    state = {"w": w}
    expected = np.asarray(w)
    assert [c.sharding.memory_kind for _, c in snapshot._distinct_shards(w)] == ["pinned_host"]
    snaps = HostSnapshots(Events())
    snaps.take(5, state, {}, block=False)
    jax.jit(lambda s: jax.tree.map(lambda x: x * 0, s), donate_argnums=0)(state)
    assert snaps.newest_step() == 5
    np.testing.assert_array_equal(snaps.latest.state["w"], expected)


STEPS = 12
COMMON = [f"steps={STEPS}", "num_slices=1", "elastic_enabled=true", "checkpoint_period=4"]
COMMON += ["elastic_poll_interval_seconds=0.05", "elastic_timeout_seconds=120"]


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


@pytest.mark.parametrize("implementation", ["cudnn", "xla"])
def test_the_cudnn_kernel_is_jitted_for_a_long_sequence(implementation):
    """2048 tokens, 16 heads of 128 (qwen3-0.6b's attention): compiles and runs, fused or not."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 2048, 16, 128)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, 2048, 8, 128)), jnp.bfloat16)
    seg = jnp.ones((2, 2048), jnp.int32)
    out = jax.jit(partial(attention.cudnn_attention, implementation=implementation))(q, kv, kv, seg)
    assert out.shape == q.shape and bool(jnp.isfinite(out.astype(jnp.float32)).all())
