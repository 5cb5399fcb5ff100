"""Soak: the default elastic command, with no period keys, on the default model, as a user runs it.

snapshot_period is auto: the trainer measures its step and snapshot costs during a warm-up and plans the
period (trainer.plan.auto); a slice lost at step 30 must cost at most 5 steps.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_harness import cli_env


@pytest.mark.soak
def test_the_default_elastic_command_loses_at_most_five_steps_to_a_slice_lost_at_step_30(tmp_path):
    cmd = [
        sys.executable, "-m", "trainer.train", "base.yml", "elastic_enabled=true", "num_slices=2", "steps=40",
        "fault_schedule=step=30,slice=1,down_s=1", "base_output_directory=out", "run_name=auto",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env(2), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "out" / "auto" / "events.jsonl").read_text().splitlines()]
    planned = [e for e in events if e["event"] == "periods_planned" and e["step"] < 30]
    assert planned, "the period is planned before the failure"
    retry = [e for e in events if e["event"] == "attempt_start"][1]
    assert retry["source"].startswith("snapshot:") and retry["steps_rewound"] <= 5, (retry, planned[-1])
