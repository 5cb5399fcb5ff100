"""scripts/launch_local.py runs its trainers where the caller stands, like `python -m trainer.train` would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli_harness import MICRO

from trainer.io.jsonl import read_jsonl

REPO = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 300  # only catches a hang


def test_a_relative_config_and_the_default_output_directory_are_the_callers(tmp_path):
    run_name = f"launcher-cwd-{tmp_path.name}"  # unique, so a stray run in the checkout cannot be mistaken
    (tmp_path / "my.yml").write_text(f"run_name: {run_name}\nsteps: 2\nenable_checkpointing: false\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "launch_local.py"), "--num-processes=1", "--", "my.yml", *MICRO],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / run_name
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert not (REPO / "runs" / run_name).exists(), "outputs must not land inside the checkout"
