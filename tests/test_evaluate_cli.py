"""`python -m trainer.evaluate`'s input errors, which need neither lm-eval nor torch: each exits 2 with one
line `python -m trainer.evaluate: error: ...` naming the bad input and the fix, before the model is read.
(The errors that need lm-eval, an unknown task included, and the evaluation itself:
tests/test_evaluate_interop.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from eval_checkpoint import TOKENIZER, write_checkpoint

from trainer.evaluate.cli import main
from trainer.evaluate.source import checkpoint_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A params-only checkpoint with its model.yml (as hf-to-trainer writes one) and the fixture tokenizer."""
    root = tmp_path_factory.mktemp("ckpt") / "ckpt"
    return write_checkpoint(root, tokenizer_path=str(TOKENIZER), tokenizer_type="huggingface")


def _error(capsys, *argv) -> str:
    code = main([*map(str, argv)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("python -m trainer.evaluate: error: ")
    return err[-1]


def test_a_path_that_does_not_exist_or_holds_no_checkpoint_is_named(tmp_path, capsys):
    missing = _error(capsys, tmp_path / "nope", "--tasks", "arc_easy")
    assert f"{tmp_path / 'nope'} does not exist" in missing
    (tmp_path / "empty").mkdir()
    empty = _error(capsys, tmp_path / "empty", "--tasks", "arc_easy")
    assert f"{tmp_path / 'empty'} is not a checkpoint" in empty and "<run>/checkpoints/<step>" in empty


def test_a_run_directory_without_a_committed_checkpoint_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "10").mkdir(parents=True)  # a save that never finished: no commit marker
    (run / "metrics.jsonl").write_text("")
    line = _error(capsys, run, "--tasks", "arc_easy")
    assert f"{run} is a run directory without a committed checkpoint yet" in line


def test_a_run_directory_means_its_newest_committed_checkpoint(tmp_path):
    run = tmp_path / "run"
    for step, committed in ((50, True), (100, True), (150, False)):
        (run / "checkpoints" / str(step)).mkdir(parents=True)
        if committed:
            (run / "checkpoints" / str(step) / "commit_success.txt").write_text("ok")
    assert checkpoint_dir(run) == run / "checkpoints" / "100"
    assert checkpoint_dir(run / "checkpoints" / "50") == run / "checkpoints" / "50"


def test_without_lm_eval_the_error_names_the_eval_extra(checkpoint, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    line = _error(capsys, checkpoint, "--tasks", "arc_easy")
    assert "lm-eval (lm_eval) is not installed" in line and "pip install 'elastic-trainer[eval]'" in line


def test_an_existing_output_is_refused_without_overwrite(checkpoint, tmp_path, capsys):
    out = tmp_path / "results.json"
    out.write_text("{}")
    line = _error(capsys, checkpoint, "--tasks", "arc_easy", "--output", out)
    assert str(out) in line and "--overwrite" in line
    assert out.read_text() == "{}"


def test_an_empty_task_list_is_refused(checkpoint, capsys):
    assert "--tasks is empty" in _error(capsys, checkpoint, "--tasks", " , ")


def test_a_checkpoint_whose_config_does_not_fit_its_params_names_the_tensor(checkpoint, capsys):
    line = _error(capsys, checkpoint, "--tasks", "arc_easy", "--model", "qwen3-tiny")
    assert "does not match the model config" in line and "embed_tokens" in line


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
        (["--max-length", "1"], "--max-length 1 must be >= 2"),
        (["--dtype", "float16"], "--dtype 'float16' is not one of float32, bfloat16"),
    ],
)
def test_numbers_and_dtypes_out_of_range_are_refused_before_the_checkpoint_is_read(tmp_path, capsys, flags, says):
    assert says in _error(capsys, tmp_path / "not-read", "--tasks", "arc_easy", *flags)
