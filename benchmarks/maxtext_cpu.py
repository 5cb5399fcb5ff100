"""MaxText's own trainer on the same CPU devices, model and batch as a run of this trainer.

Used by train_throughput.py (`--maxtext-python`): the interpreter given has MaxText installed (MaxText
0.2.5 needs Python >= 3.12; install notes in benchmarks/compile_vs_maxtext.py's docstring) and should have
the jax of the interpreter running the benchmark, so one compiler builds both steps. The model keys of
this trainer's configs are MaxText's names, so the model passes over as it is resolved here; MaxText
trains on its synthetic data, without checkpoints, with the devices as one fsdp axis (this trainer's
default mesh on one slice). Its step time is MaxText's own `perf/step_time_seconds` per step, from the
metrics file it writes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from records import REPO, package_versions

sys.path.insert(0, str(REPO))
from trainer.config.schema import ARCHITECTURE_KEYS, FAMILY_KEYS  # noqa: E402

# This trainer's model keys that MaxText reads under the same name and meaning (the family keys are ours).
SHARED_MODEL_KEYS = (
    *(k for k in ARCHITECTURE_KEYS if k not in FAMILY_KEYS),
    "dtype",
    "weight_dtype",
    "scan_layers",
    "remat_policy",
)


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def maxtext_overrides(model, *, max_target_length: int, per_device_batch_size: int, steps: int, devices: int):
    """MaxText key=value arguments for this trainer's resolved (dense Qwen3) `model` config and run shape."""
    if model.num_experts > 1 or model.model_family != "qwen3" or model.rope_scaling != "none":
        raise SystemExit("--maxtext-python compares dense Qwen3 models only (MaxText's decoder_block=qwen3)")
    attention = "dot_product" if model.attention == "autoselected" else model.attention  # CPU: dot_product
    return [
        "decoder_block=qwen3",
        "mlp_activations=[silu,linear]",
        "normalize_embedding_logits=false",  # Qwen3's tied logits (MaxText's configs/models/qwen3-*.yml)
        *(f"{k}={_value(getattr(model, k))}" for k in SHARED_MODEL_KEYS),
        f"attention={attention}",
        f"max_target_length={max_target_length}",
        f"per_device_batch_size={per_device_batch_size}",
        f"steps={steps}",
        f"ici_fsdp_parallelism={devices}",
        "hardware=cpu",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        "skip_jax_distributed_system=true",
        "enable_tensorboard=false",
    ]


def run_maxtext(
    python: str, overrides: list[str], devices: int, workdir: Path, env: Mapping[str, str] | None = None
) -> list[float]:
    """Step times (seconds, in step order) of one MaxText training run, in environment `env` (default: this
    process's) plus what MaxText needs on CPU."""
    code = "import maxtext, os; print(os.path.dirname(maxtext.__file__))"
    root = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    env = dict(os.environ if env is None else env, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    cmd = [
        python,
        "-m",
        "maxtext.trainers.pre_train.train",
        f"{root}/configs/base.yml",
        "run_name=bench",
        f"base_output_directory={workdir}",
        f"metrics_file={metrics}",
        *overrides,
    ]
    proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"MaxText failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["perf/step_time_seconds"] for r in rows if "perf/step_time_seconds" in r]


def maxtext_version(python: str) -> str:
    version, jax_version = package_versions(python, "maxtext", "jax")
    return f"MaxText {version} (jax {jax_version})"


def median_after(times: list[float], skip: int) -> float:
    steady = times[skip:] or times
    return statistics.median(steady)
