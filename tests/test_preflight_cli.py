"""A resumed run whose config does not fit its saved step is refused before compiling (the real CLI on the
micro model, one device; `trainer.preflight`, `trainer.checkpoint.compat`). Runs on Python 3.11 and 3.12.

- Against the persistent tier: exit 2, the differing leaves, the keys that explain them and the ways
  forward; nothing in the run directory changes, and the original command then resumes.
- Against the local tier too (a run that saved to it only): an architecture or parameter-dtype change
  exits 2 the same way, naming the key and its saved value, and changes nothing on either tier.
- weight_dtype is the dtype of the saved arrays (params and optimizer state): a change is refused.
  dtype is the activation / matmul dtype, in no saved array: a change resumes, on either tier.
- The check reads the stored layout without starting a JAX backend (a process of a multi-process job
  runs it before it joins the job).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_harness import MICRO, cli_env, command, events, final_params, run_cli

pytestmark = pytest.mark.slow

FIRST = ["steps=6", "checkpoint_period=3", "num_slices=1"]
LONGER = ["steps=9", "checkpoint_period=3", "num_slices=1"]
# The local tier only (no persistent checkpoint), at paths relative to the working directory.
LOCAL = [
    "local_checkpoint_directory=node",
    "local_checkpoint_period=2",
    "enable_checkpointing=false",
    "num_slices=1",
]


def _status(proc) -> str:
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _starts(run: Path) -> list[dict]:
    return [e for e in events(run) if e["event"] == "attempt_start"]


def _assert_refused_before_compiling(proc) -> None:
    assert proc.returncode == 2 and _status(proc) == "STATUS: input_error", proc.stderr[-3000:]
    assert "compiled the train step" not in proc.stderr and " loss=" not in proc.stderr, "no compile, no step"


def _cli_in(cwd: Path, *overrides: str):
    """The CLI run from `cwd` on run `runs/r`: relative base and local-tier directories."""
    return subprocess.run(
        command(Path("runs"), "r", *overrides),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(1),
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 6 steps with checkpoints 3 and 6, copied fresh for each test."""
    root = tmp_path_factory.mktemp("safety")
    proc = run_cli(root, "r", *FIRST, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "r"


@pytest.fixture
def run(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "r")
    return tmp_path / "r"


@pytest.fixture(scope="module")
def local_only(tmp_path_factory):
    """A run of 5 steps whose only saved steps are local-tier steps 2 and 4 (`node/r/`), in a working
    directory copied fresh for each test."""
    root = tmp_path_factory.mktemp("local")
    proc = _cli_in(root, "steps=5", *LOCAL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (root / "node" / "r").iterdir()) == ["2", "4"]
    assert not (root / "runs" / "r" / "checkpoints").exists(), "no persistent step: the local tier alone"
    return root


@pytest.fixture
def local_run(local_only, tmp_path):
    shutil.copytree(local_only, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_a_config_change_of_the_train_state_exits_2_before_compiling_and_the_original_resumes(run):
    before = _listing(run)
    proc = run_cli(run.parent, "r", *LONGER, "gradient_clipping_threshold=0", devices=1)

    assert proc.returncode == 2 and _status(proc) == "STATUS: input_error", proc.stderr[-3000:]
    message = proc.stderr
    assert "gradient_clipping_threshold (checkpoint 1.0, now 0.0)" in message
    assert "opt_state:" in message and "leaves only in the checkpoint" in message
    assert f"load_parameters_path={run / 'checkpoints' / '6'}" in message and "run_name=" in message
    assert _listing(run) == before, "nothing in the run directory changed, not even its logs"

    again = run_cli(run.parent, "r", *LONGER, devices=1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _starts(run)[-1]["source"] == "checkpoint:6" and _starts(run)[-1]["start_step"] == 6


def test_the_preflight_of_a_resumed_run_leaves_jaxs_backends_alone(run):
    """A process of a multi-process job checks the saved steps before it joins the job, which must come
    before JAX creates any backend: the check reads the stored layout without Orbax's metadata API."""
    import sys

    script = (
        "from jax._src import xla_bridge\n"
        "from trainer import preflight\n"
        "from trainer.config.loader import load_config\n"
        f"cfg = load_config('base.yml', {list(MICRO + LONGER)!r})\n"
        f"checked = preflight.check(cfg, __import__('etils').epath.Path({str(run / 'checkpoints')!r}))\n"
        "assert checked.resume_step == 6, checked\n"
        "print('backends initialised:', xla_bridge.backends_are_initialized())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(1), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backends initialised: False" in proc.stdout


def test_a_weight_dtype_change_exits_2_before_compiling_naming_the_key(run):
    before = _listing(run)
    proc = run_cli(run.parent, "r", *LONGER, "weight_dtype=bfloat16", devices=1)

    _assert_refused_before_compiling(proc)
    message = proc.stderr
    assert f"cannot resume from {run / 'checkpoints' / '6'}:" in message
    assert "params/embed_tokens float32[512, 64] in the checkpoint, bfloat16[512, 64] in this config" in message
    assert "weight_dtype (checkpoint 'float32', now 'bfloat16')" in message
    assert "resume it with the checkpoint's values (weight_dtype=float32)" in message
    assert _listing(run) == before, "nothing in the run directory changed, not even its logs"


def test_a_compute_dtype_change_resumes_from_the_checkpoint_with_its_parameter_dtype(run):
    proc = run_cli(run.parent, "r", *LONGER, "dtype=float32", devices=1)

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _starts(run)[-1]["source"] == "checkpoint:6" and _starts(run)[-1]["start_step"] == 6
    assert _status(proc).startswith("STATUS: finished step=9 trained=3")
    assert {str(a.dtype) for a in final_params(run).values()} == {"float32"}


@pytest.mark.parametrize(
    "change, key, fix",
    [
        (
            "base_num_decoder_layers=3",
            "base_num_decoder_layers (checkpoint 2, now 3)",
            "base_num_decoder_layers=2",
        ),
        ("weight_dtype=bfloat16", "weight_dtype (checkpoint 'float32', now 'bfloat16')", "weight_dtype=float32"),
    ],
    ids=["layers", "weight_dtype"],
)
def test_a_local_tier_step_that_does_not_fit_the_config_exits_2_before_compiling(local_run, change, key, fix):
    run, tier = local_run / "runs" / "r", local_run / "node" / "r"
    before = (_listing(run), _listing(tier))
    proc = _cli_in(local_run, "steps=7", *LOCAL, change)

    _assert_refused_before_compiling(proc)
    message = proc.stderr
    assert f"cannot resume from {tier / '4'} (local checkpoint tier):" in message
    assert "params:" in message and "in the checkpoint" in message
    assert f"config keys that explain it: {key}" in message
    assert f"resume it with the checkpoint's values ({fix})" in message and "run_name=" in message
    assert (_listing(run), _listing(tier)) == before, "nothing changed, in the run directory or the local tier"


def test_a_compute_dtype_change_resumes_from_the_local_tier_with_its_parameter_dtype(local_run):
    proc = _cli_in(local_run, "steps=7", *LOCAL, "dtype=float32")

    assert proc.returncode == 0, proc.stderr[-3000:]
    run = local_run / "runs" / "r"
    assert _starts(run)[-1]["source"] == "local:4" and _starts(run)[-1]["start_step"] == 4
    assert _status(proc).startswith("STATUS: finished step=7 trained=3")
    manifest = json.loads((local_run / "node" / "r" / "6" / "manifest.json").read_text())
    assert {leaf["dtype"] for leaf in manifest["leaves"] if leaf["path"].startswith("['params']")} == {"float32"}
