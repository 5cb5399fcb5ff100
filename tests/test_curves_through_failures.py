"""Loss curves through failures, on real text: a run that loses a slice and gets it back, one that goes on
with fewer slices, and one whose process is killed with SIGKILL and restarted have the uninterrupted run's
loss at every step, bit for bit.

The text is real (a few modules of the Python standard library this test runs on, one record per
paragraph, tokenized with the bundled sentencepiece tokenizer by `python -m trainer.data.prepare`) and
read through Grain as a user's data would be, so the data iterator's position is restored from what a
snapshot or a checkpoint saved, not recomputed from a step number as the synthetic stream's is.

The oracle is the uninterrupted run's metrics.jsonl. Every record of every step counts, the ones a rewind
superseded too, compared as the bits of the float each record holds (`float.hex`). Each failure run also
proves from its own events.jsonl that the failure happened as intended, so that none of them can pass by
not failing.

Replica-resize (2 of 3 slices, `elastic_resize_batch_policy=keep_global`) keeps the global batch, the data
order and the bits: every run sets `elastic_resize_bitwise=true`, so the step sums the batch as fixed groups
of rows in one order on 3 slices and on 2 (`trainer/program/step.py`, `ordered_sums`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from cli_harness import cli_env, command, run_cli

from trainer.checkpoint.commit import committed_steps
from trainer.io.jsonl import read_jsonl
from trainer.observe.records import step_rows

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"
# Modules every Python from 3.11 on ships; their text differs between versions, which does not matter: every
# run of one test session reads the same files.
STDLIB_MODULES = ("argparse.py", "calendar.py", "difflib.py", "textwrap.py", "pprint.py", "shlex.py")

STEPS = 16
FAILURE_STEP = 6  # the step a slice fails in: it records no loss then, and is trained after the recovery
KILL_AFTER = 10  # the process is killed once this step's record is written
SLICES = 3
COMMON = [
    f"steps={STEPS}",
    "vocab_size=8192",  # the tokenizer's ids
    "max_target_length=64",
    f"num_slices={SLICES}",
    "elastic_enabled=true",
    "elastic_resize_bitwise=true",
    "checkpoint_period=4",
    "snapshot_period=2",
    "elastic_poll_interval_seconds=0.05",
    "elastic_timeout_seconds=60",
    "dataset_type=arrayrecord",
    f"tokenizer_path={TOKENIZER}",
]


def prepare_real_text(out: Path) -> Path:
    """The standard library modules as ArrayRecord shards of tokenized paragraphs; returns their glob."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    cmd = [sys.executable, "-m", "trainer.data.prepare", "--output-dir", str(out), "--num-shards", "2"]
    cmd += ["--tokenizer", str(TOKENIZER), "--text-unit", "paragraph", "--workers", "1"]
    for name in STDLIB_MODULES:
        cmd += ["--input", str(stdlib / name)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "*.arrayrecord"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return f"grain_train_files={prepare_real_text(tmp_path_factory.mktemp('text') / 'stdlib')}"


@pytest.fixture(scope="module")
def clean(corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clean")
    proc = run_cli(root, "clean", *COMMON, corpus)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "clean"


def _steps(run_dir: Path) -> list[dict]:
    return step_rows(read_jsonl(run_dir / "metrics.jsonl"))


def _events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


def loss_bits(run_dir: Path) -> dict[int, set[str]]:
    """The bits of every loss recorded for each step (a step trained again after a rewind has several)."""
    out: dict[int, set[str]] = {}
    for r in _steps(run_dir):
        out.setdefault(r["step"], set()).add(float(r["loss"]).hex())
    return out


def assert_same_losses(run_dir: Path, clean: Path, steps=range(1, STEPS + 1)) -> None:
    """Every record of each of `steps` holds the clean run's loss, bit for bit; every step was trained."""
    got, want = loss_bits(run_dir), loss_bits(clean)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert all(len(want[s]) == 1 for s in want), "the clean run recorded each step once"
    differ = {s: (sorted(got[s]), *want[s]) for s in steps if got[s] != want[s]}
    assert not differ, f"steps whose loss differs from the uninterrupted run's (got, clean): {differ}"


def test_the_clean_run_learns_the_real_text(clean):
    losses = [r["loss"] for r in _steps(clean)]
    assert len(losses) == STEPS and len({r["pid"] for r in _steps(clean)}) == 1
    assert not _events(clean, "slice_killed") and len(_events(clean, "attempt_start")) == 1
    assert sum(losses[-4:]) < sum(losses[:4]) - 0.5, losses


def test_a_slice_lost_and_back_pauses_resumes_and_keeps_every_loss_bit_for_bit(clean, corpus, tmp_path):
    fault = f"fault_schedule=step={FAILURE_STEP},slice=1,down_s=1"
    proc = run_cli(tmp_path, "pause", *COMMON, corpus, fault)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "pause"
    killed = _events(run, "slice_killed")
    assert [(e["slice"], e["step"]) for e in killed] == [(1, FAILURE_STEP)]
    attempts = _events(run, "attempt_start")
    assert [a["slices"] for a in attempts] == [[0, 1, 2], [0, 1, 2]], "paused until slice 1 was back"
    assert attempts[1]["source"] == f"snapshot:{FAILURE_STEP - 2}"
    assert len({r["pid"] for r in _steps(run)}) == 1, "recovered in the same process"
    assert_same_losses(run, clean)


@pytest.fixture(scope="module")
def resized(corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resize")
    fault = f"fault_schedule=step={FAILURE_STEP},slice=2,down_steps=3"
    proc = run_cli(root, "resize", *COMMON, corpus, "elastic_min_slice_count=2", fault)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "resize"


def test_a_slice_lost_resizes_onto_two_slices_with_the_global_batch_and_data_order_kept(resized, clean):
    attempts = _events(resized, "attempt_start")
    assert [a["slices"] for a in attempts] == [[0, 1, 2], [0, 1], [0, 1, 2]], "resized, then grew back"
    assert {a["global_batch_size"] for a in attempts} == {2 * SLICES}, "keep_global"
    on_two = sorted({r["step"] for r in _steps(resized) if r["devices"] == 2})
    assert on_two and on_two[0] < FAILURE_STEP + 2, on_two
    fingerprints = {(r["step"], r["batch_fingerprint"]) for r in _steps(resized)}
    assert fingerprints == {(r["step"], r["batch_fingerprint"]) for r in _steps(clean)}


def test_a_slice_lost_resizes_and_keeps_every_loss_bit_for_bit(resized, clean):
    assert_same_losses(resized, clean)


def _kill_after_step(root: Path, name: str, step: int, *overrides: str) -> int:
    """Start the run; once step `step`'s record is written, SIGKILL it with its Grain worker (its process
    group, as a lost pod or container takes every process in it). Returns the killed trainer's pid."""
    run_dir = root / name
    proc = subprocess.Popen(
        command(root, name, *overrides),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(3),
        start_new_session=True,  # its own process group: the kill reaches the data worker too
    )
    try:
        deadline = time.time() + 300  # a hang guard, not a speed claim
        while time.time() < deadline and proc.poll() is None:
            if any(r["step"] >= step for r in _steps(run_dir)):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        _, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    ended = f"the run ended before step {step} (exit {proc.returncode}): {stderr[-2000:]}"
    assert proc.returncode == -signal.SIGKILL, ended
    return proc.pid


def test_a_process_killed_with_sigkill_and_restarted_keeps_every_loss_bit_for_bit(clean, corpus, tmp_path):
    killed_pid = _kill_after_step(tmp_path, "kill", KILL_AFTER, *COMMON, corpus)
    run = tmp_path / "kill"
    newest = committed_steps(run / "checkpoints")[-1]
    reached = max(r["step"] for r in _steps(run))
    assert not _events(run, "finish") and newest < reached
    proc = run_cli(tmp_path, "kill", *COMMON, corpus)  # the same command, as a JobSet restarts it
    assert proc.returncode == 0, proc.stderr[-3000:]
    [resumed] = _events(run, "restart_resumed")
    assert (resumed["source"], resumed["start_step"]) == (f"checkpoint:{newest}", newest)
    assert resumed["last_step"] == reached and resumed["steps_lost"] == reached - newest > 0
    pids = [r["pid"] for r in _steps(run)]
    assert pids[0] == killed_pid and len(set(pids)) == 2, "steps from both processes"
    assert_same_losses(run, clean)
