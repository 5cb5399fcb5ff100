"""Run the real CLI (on N virtual CPU devices) and read back what it left: metrics, events, final state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# A micro model: the elastic machinery, not the model, is under test; it compiles in about a second.
MICRO = [
    "model=qwen3-tiny",
    "base_num_decoder_layers=2",
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=16",
    "base_mlp_dim=128",
    "vocab_size=512",
    "max_target_length=32",
    "per_device_batch_size=2",
    "remat_policy=none",
    "enable_tensorboard=false",
    "log_period=1",
]


def cli_env(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def pod_env(server, tmp_path: Path, pod: str, devices: int = 1) -> dict:
    """The CLI's environment on one pod reaching gs:// through `server` (tests/gcs_server.py): its own
    local mirror of remote run directories and its own cache under tmp_path/pod."""
    env = cli_env(devices)
    env.update(server.env)
    env.update({"TRAINER_LOCAL_RUN_ROOT": str(tmp_path / pod), "TRAINER_CACHE_DIR": str(tmp_path / pod / "cache")})
    return env


def pod_mirror(tmp_path: Path, pod: str, run_dir: str) -> Path:
    """The pod's local mirror of a gs:// run directory (trainer/observe/rundir.py): its events and metrics."""
    import re

    return tmp_path / pod / "trainer_runs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", run_dir)


def command(run_root: Path, run_name: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer.train",
        "base.yml",
        *MICRO,
        f"base_output_directory={run_root}",
        f"run_name={run_name}",
        *overrides,
    ]


def run_cli(run_root: Path, run_name: str, *overrides: str, devices: int = 3, timeout: int = 300):
    return subprocess.run(
        command(run_root, run_name, *overrides),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(devices),
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if l.strip()]


def final_by_step(records: list[dict]) -> dict[int, dict]:
    """The last record of each step: replayed steps after a rewind overwrite the lost ones."""
    out = {}
    for r in records:
        out[r["step"]] = r
    return out


def final_params(run_dir: Path) -> dict[str, np.ndarray]:
    """Parameters of the newest committed checkpoint, as flat {path: array} (read with Orbax alone)."""
    import orbax.checkpoint as ocp

    ckpt_root = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpt_root.iterdir() if p.name.isdigit())
    item = ckpt_root / str(steps[-1]) / "state"
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.restore(item)
    import jax

    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree["params"])}


def assert_same_params(run_dir: Path, baseline_dir: Path, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Final parameters equal the baseline's: bitwise by default, else within rtol/atol."""
    a, b = final_params(run_dir), final_params(baseline_dir)
    assert a.keys() == b.keys()
    for k in a:
        if rtol == 0.0 and atol == 0.0:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def assert_same_data_order(run_dir: Path, baseline_dir: Path, steps: int | None = None) -> None:
    """The surviving record of every step saw the baseline's batch (and, given `steps`, all steps ran)."""
    got, base = final_by_step(metrics(run_dir)), final_by_step(metrics(baseline_dir))
    if steps is not None:
        assert sorted(got) == list(range(1, steps + 1))
    assert [got[s]["batch_fingerprint"] for s in sorted(got)] == [
        base[s]["batch_fingerprint"] for s in sorted(got)
    ]


def killed_during(run_dir: Path, pid: int, start: str, end: str, *, key: str = "step") -> dict:
    """The `start` event the killed process `pid` logged without its `end` (same `key` value): proof, from
    the run's own events, that the kill landed inside that phase. Fails when there is none."""
    evs = [e for e in events(run_dir) if e.get("pid") == pid]
    ended = {e.get(key) for e in evs if e["event"] == end}
    open_ = [e for e in evs if e["event"] == start and e.get(key) not in ended]
    assert open_, f"pid {pid} has no {start} without its {end}: the kill did not land inside that phase"
    return open_[-1]


def elastic_args(steps: int, *, checkpoint_period: int = 4) -> list[str]:
    """The overrides of an elastic run on 3 virtual slices that recovers quickly (the fault tests' shared base)."""
    return [
        f"steps={steps}",
        "num_slices=3",
        "elastic_enabled=true",
        f"checkpoint_period={checkpoint_period}",
        "elastic_poll_interval_seconds=0.05",
        "elastic_timeout_seconds=60",
    ]


def checkpoint_state(step_dir: Path) -> dict:
    """The train state a committed checkpoint step holds, restored to host arrays as saved."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(step_dir / "state")
