"""Environment shared by the multi-process targets (jobset-gpu and slurm): JAX's fault-tolerance settings and
the XLA flags that bound a collective stuck on a dead peer."""

from __future__ import annotations

from scripts.deploy.params import DeployParams

GPU_FT_XLA_FLAGS = (
    # From JAX's fault-tolerance guide: do not abort the process on an NCCL error, and use
    # non-blocking, asynchronously executed communicators so failed collectives can be aborted.
    "--xla_gpu_nccl_terminate_on_error=false",
    "--xla_gpu_nccl_async_execution=true",
    "--xla_gpu_nccl_blocking_communicators=false",
)
GPU_FT_ENV = (
    # Abort in-flight collectives when the coordination service reports a dead peer (JAX FT guide).
    ("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "1"),
    # The FT guide's recipe runs on the TFRT GPU client.
    ("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "1"),
)


def xla_flags(p: DeployParams) -> list[str]:
    t = p.collective_timeout_seconds
    if p.platform == "gpu":
        # Bounds a stuck NCCL rendezvous; a dead peer is detected by the heartbeat and its collectives
        # aborted (XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE), not by this timeout.
        flags = [*GPU_FT_XLA_FLAGS, f"--xla_gpu_nccl_termination_timeout_seconds={t}"]
    else:
        # gloo: without a bound a survivor waiting on a dead peer's recv hangs for 30 min (the default).
        # The in-process rendezvous terminate timeout (default 40 s) must stay above it.
        flags = [
            f"--xla_cpu_collective_timeout_seconds={t}",
            f"--xla_cpu_collective_call_terminate_timeout_seconds={t + 60}",
        ]
    return flags + list(p.extra_xla_flags)


def multiprocess_env(p: DeployParams) -> list[tuple[str, str]]:
    """Environment every process of a multi-process run gets (the per-process ids are set by the launcher)."""
    env = [
        ("JAX_NUM_PROCESSES", str(p.num_processes)),
        ("NODES_PER_SLICE", str(p.nodes_per_slice)),
        # Read by JAX when it is imported, so it is in effect before jax.distributed.initialize.
        ("JAX_ENABLE_RECOVERABILITY", "true"),
        # For the trainer's jax.distributed.initialize(heartbeat_timeout_seconds=...).
        ("JAX_HEARTBEAT_TIMEOUT_SECONDS", str(p.heartbeat_timeout_seconds)),
        ("JAX_PLATFORMS", "cuda" if p.platform == "gpu" else "cpu"),
        ("XLA_FLAGS", " ".join(xla_flags(p))),
    ]
    if p.platform == "gpu":
        env += list(GPU_FT_ENV)
    if p.cache_dir:
        env.append(("JAX_COMPILATION_CACHE_DIR", p.cache_dir))
    return env
