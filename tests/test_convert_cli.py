"""`python -m trainer.convert` as a user types it: from a working directory of their own, relative paths.

Every command runs in a subprocess whose cwd is a fresh temporary directory (not the repository), with
HOME pointing at another one so `~/...` works too. Contract: README's commands work there; every error
a user can fix is one line `python -m trainer.convert: error: ...` naming the input and the fix, exit 2,
no traceback, and nothing written; outputs are checked before any tensor is read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_harness import cli_env
from safetensors import safe_open

from trainer.hf.checkpoints import checkpoint_model_config, load_checkpoint_params
from trainer.hf.logits import InputError, compute_logits, read_input_ids
from trainer.hf.to_trainer import hf_to_trainer

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "hf"
PREFIX = "python -m trainer.convert: error: "


@pytest.fixture
def user(tmp_path):
    """(cwd, home): the user's working directory and home, with a Hugging Face model in ~/Qwen3-0.6B."""
    cwd, home = tmp_path / "work", tmp_path / "home"
    cwd.mkdir()
    shutil.copytree(FIXTURES / "dense_untied_kv1", home / "Qwen3-0.6B")
    return cwd, home


def run(cwd: Path, home: Path, *args: str, module: str = "trainer.convert") -> subprocess.CompletedProcess:
    env = {
        **cli_env(1),
        "HOME": str(home),
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str, prefix: str = PREFIX) -> str:
    """The single error line of a failed run (exit 2, no traceback), checked to contain `fragments`."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(prefix), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def tree(root: Path) -> list[str]:
    """Every path under `root` (hidden staging leftovers included), relative and sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _tensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _training_step_dir(ckpt: Path, step_dir: Path) -> Path:
    """A training checkpoint step dir as the trainer lays it out (commit marker, state/, and the run's
    resolved config in metadata/metadata, no model.yml), holding the params of an hf-to-trainer output."""
    from trainer.config import load_config, to_flat_dict

    cfg = load_config("base.yml", [f"model={ckpt / 'model.yml'}", f"load_parameters_path={ckpt}"])
    shutil.copytree(ckpt, step_dir, ignore=shutil.ignore_patterns("model.yml", "hf_config.json", "tokenizer.json"))
    (step_dir / "metadata").mkdir()
    (step_dir / "metadata" / "metadata").write_text(json.dumps({"config": to_flat_dict(cfg)}))
    return step_dir


def _fake_run(root: Path, committed=(50, 100), partial=()) -> Path:
    """A run directory whose checkpoints/ holds committed steps (marker only) and unfinished ones."""
    ckpts = root / "checkpoints"
    for step in committed:
        (ckpts / str(step)).mkdir(parents=True)
        (ckpts / str(step) / "commit_success.txt").write_text("ok")
    for step in partial:
        (ckpts / str(step) / "state").mkdir(parents=True)
    (root / "metrics.jsonl").write_text("")
    return root


# --- README's commands --------------------------------------------------------------------------------


def test_readme_commands_work_with_relative_paths_and_home_from_the_users_directory(user):
    """hf-to-trainer from ~/..., trainer-to-hf of runs/NAME/checkpoints/1000, logits and decode of
    ckpt/..., all relative to a working directory that is not the repository."""
    cwd, home = user
    expected = dict(np.load(FIXTURES / "dense_untied_kv1" / "expected.npz"))

    proc = run(cwd, home, "hf-to-trainer", "--hf-dir", "~/Qwen3-0.6B", "--output-dir", "ckpt/qwen3-0.6b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = cwd / "ckpt" / "qwen3-0.6b"
    assert f"wrote {ckpt}:" in proc.stdout
    assert {"commit_success.txt", "model.yml", "hf_config.json", "state"} <= {p.name for p in ckpt.iterdir()}
    assert tree(cwd / "ckpt") == sorted(["qwen3-0.6b", *(f"qwen3-0.6b/{p}" for p in tree(ckpt))])  # no leftovers

    _training_step_dir(ckpt, cwd / "runs" / "NAME" / "checkpoints" / "1000")
    proc = run(
        cwd,
        home,
        "trainer-to-hf",
        "--checkpoint",
        "runs/NAME/checkpoints/1000",
        "--output-dir",
        "hf_out",
        "--dtype",
        "bfloat16",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"wrote {cwd / 'hf_out'}"
    assert json.loads((cwd / "hf_out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    exported = _tensors(cwd / "hf_out" / "model.safetensors")
    for key, value in _tensors(FIXTURES / "dense_untied_kv1" / "model.safetensors").items():
        np.testing.assert_array_equal(exported[key], value.astype(exported[key].dtype), err_msg=key)

    np.save(cwd / "ids.npy", expected["input_ids"])
    proc = run(
        cwd, home, "logits", "--checkpoint", "ckpt/qwen3-0.6b", "--input-ids", "ids.npy", "--output", "logits.npy"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"wrote {cwd / 'logits.npy'}"
    assert np.abs(np.load(cwd / "logits.npy") - expected["logits"]).max() <= 1e-4

    proc = run(
        cwd,
        home,
        "base.yml",
        "model=ckpt/qwen3-0.6b/model.yml",
        "load_parameters_path=ckpt/qwen3-0.6b",
        f"prompt_ids={expected['prompt_ids'].tolist()}",
        f"max_decode_length={len(expected['greedy_ids'])}",
        module="trainer.decode",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"output_ids: {expected['greedy_ids'].tolist()}"


# --- trainer-to-hf: where the checkpoint is -------------------------------------------------------------


@pytest.mark.parametrize(
    "checkpoint,fragments",
    [
        (
            "runs/NAME",
            [
                "is a run directory",
                "point --checkpoint at",
                "runs/NAME/checkpoints/<step>",
                "committed steps in",
                ": 50, 100",
            ],
        ),
        ("runs/NAME/checkpoints", ["checkpoints directory", "runs/NAME/checkpoints/<step>", ": 50, 100"]),
        ("runs/NAME/checkpoints/1000", ["runs/NAME/checkpoints/1000 does not exist", ": 50, 100"]),
        ("runs/NAME/checkpoints/150", ["not a committed checkpoint", "commit_success.txt", ": 50, 100"]),
        ("nowhere/ckpt", ["nowhere/ckpt does not exist"]),
    ],
)
def test_trainer_to_hf_says_what_the_checkpoint_path_is_and_where_the_steps_are(user, checkpoint, fragments):
    cwd, home = user
    _fake_run(cwd / "runs" / "NAME", partial=[150])
    proc = run(cwd, home, "trainer-to-hf", "--checkpoint", checkpoint, "--output-dir", "hf_out")
    line = one_line_error(proc, *fragments)
    assert "cannot tell the model config" not in line
    assert not (cwd / "hf_out").exists()


def test_a_run_without_a_committed_checkpoint_says_so(user):
    cwd, home = user
    _fake_run(cwd / "runs" / "fresh", committed=[], partial=[10])
    one_line_error(
        run(cwd, home, "trainer-to-hf", "--checkpoint", "runs/fresh", "--output-dir", "o"),
        "is a run directory",
        "no committed checkpoint yet",
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """dense_tied through hf-to-trainer (in-process, once): 160 x 48 embeddings."""
    return hf_to_trainer(FIXTURES / "dense_tied", tmp_path_factory.mktemp("conv") / "ckpt")


def test_a_model_of_another_size_names_the_tensor_and_both_shapes(user, converted):
    cwd, home = user
    proc = run(
        cwd,
        home,
        "trainer-to-hf",
        "--checkpoint",
        str(converted),
        "--output-dir",
        "hf_out",
        "--model",
        "qwen3-tiny",
    )
    line = one_line_error(
        proc,
        "does not match the model config",
        "embed_tokens",
        "[160, 48]",
        "[32768, 256]",
        "--model must be the model the checkpoint was trained with",
    )
    assert "strict" not in line
    assert not (cwd / "hf_out").exists()


# --- hf-to-trainer: broken downloads ----------------------------------------------------------------------


def _not_json(d: Path):
    (d / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"],')


def _missing_key(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))


def _wrong_type(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = "two"
    (d / "config.json").write_text(json.dumps(cfg))


def _truncated(d: Path):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) * 3 // 4])


def _bad_index(d: Path):
    (d / "model.safetensors.index.json").write_text("<html>rate limited</html>")


@pytest.mark.parametrize(
    "damage,fragments",
    [
        (_not_json, ["Qwen3-0.6B/config.json is not valid JSON"]),
        (_missing_key, ["Qwen3-0.6B/config.json has no 'hidden_size'"]),
        (_wrong_type, ["Qwen3-0.6B/config.json: num_hidden_layers='two' must be a positive integer"]),
        (
            _truncated,
            ["Qwen3-0.6B/model.safetensors is not a readable safetensors file", "truncated", "download it again"],
        ),
        (_bad_index, ["Qwen3-0.6B/model.safetensors.index.json is not a valid safetensors index"]),
    ],
)
def test_a_broken_hf_directory_is_one_line_naming_the_file_and_nothing_is_written(user, damage, fragments):
    cwd, home = user
    damage(home / "Qwen3-0.6B")
    proc = run(cwd, home, "hf-to-trainer", "--hf-dir", "~/Qwen3-0.6B", "--output-dir", "ckpt/q")
    one_line_error(proc, *fragments)
    assert tree(cwd) == []


def test_a_missing_hf_dir_is_named(user):
    cwd, home = user
    one_line_error(
        run(cwd, home, "hf-to-trainer", "--hf-dir", "Qwen3", "--output-dir", "o"),
        f"--hf-dir {cwd / 'Qwen3'} does not exist",
    )


# --- the output: checked first, replaced only when complete ------------------------------------------------


def test_an_existing_output_is_refused_before_any_input_is_read_and_left_untouched(user):
    """The input is broken too (a truncated safetensors): the error is about the output, so the output
    was checked first, before reading any tensor."""
    cwd, home = user
    _truncated(home / "Qwen3-0.6B")
    (cwd / "ckpt").mkdir()
    (cwd / "ckpt" / "keep.txt").write_text("mine")
    proc = run(cwd, home, "hf-to-trainer", "--hf-dir", "~/Qwen3-0.6B", "--output-dir", "ckpt")
    one_line_error(proc, f"{cwd / 'ckpt'} already exists", "pass --overwrite")
    assert tree(cwd) == ["ckpt", "ckpt/keep.txt"] and (cwd / "ckpt" / "keep.txt").read_text() == "mine"


def test_overwrite_replaces_the_output_only_with_a_complete_one(user):
    cwd, home = user
    (cwd / "ckpt").mkdir()
    (cwd / "ckpt" / "old.txt").write_text("old")
    _truncated(home / "Qwen3-0.6B")
    one_line_error(
        run(cwd, home, "hf-to-trainer", "--hf-dir", "~/Qwen3-0.6B", "--output-dir", "ckpt", "--overwrite"),
        "truncated",
    )
    assert tree(cwd) == ["ckpt", "ckpt/old.txt"]  # a failed run leaves the old output as it was

    shutil.copyfile(FIXTURES / "dense_untied_kv1" / "model.safetensors", home / "Qwen3-0.6B" / "model.safetensors")
    proc = run(cwd, home, "hf-to-trainer", "--hf-dir", "~/Qwen3-0.6B", "--output-dir", "ckpt", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (cwd / "ckpt" / "old.txt").exists() and (cwd / "ckpt" / "commit_success.txt").exists()
    assert [p.name for p in cwd.iterdir()] == ["ckpt"]  # no staging or old copies beside it


def test_an_output_under_a_file_is_refused_up_front(user):
    cwd, home = user
    (cwd / "notes").write_text("a file")
    one_line_error(
        run(cwd, home, "hf-to-trainer", "--hf-dir", "~/Qwen3-0.6B", "--output-dir", "notes/ckpt"),
        f"{cwd / 'notes'} is a file, not a directory",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only directory")
def test_an_unwritable_output_directory_is_refused_up_front(user):
    cwd, home = user
    (cwd / "ro").mkdir()
    (cwd / "ro").chmod(0o555)
    try:
        one_line_error(
            run(cwd, home, "hf-to-trainer", "--hf-dir", "~/Qwen3-0.6B", "--output-dir", "ro/ckpt"),
            "is not writable",
        )
    finally:
        (cwd / "ro").chmod(0o755)


def test_the_output_may_not_replace_the_input(user):
    cwd, home = user
    one_line_error(
        run(cwd, home, "hf-to-trainer", "--hf-dir", "~/Qwen3-0.6B", "--output-dir", "~/Qwen3-0.6B", "--overwrite"),
        "would replace the input",
    )
    assert (home / "Qwen3-0.6B" / "model.safetensors").exists()


# --- logits: the ids ----------------------------------------------------------------------------------------


def test_logits_reads_a_text_file_of_ids_the_same_as_the_npy(user, converted):
    cwd, home = user
    ids = np.load(FIXTURES / "dense_tied" / "expected.npz")["input_ids"]
    (cwd / "ids.txt").write_text(
        "\n".join(
            ", ".join(map(str, row)) if i % 2 else " ".join(map(str, row)) for i, row in enumerate(ids.tolist())
        )
        + "\n"
    )
    proc = run(
        cwd, home, "logits", "--checkpoint", str(converted), "--input-ids", "ids.txt", "--output", "out/l.npy"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = checkpoint_model_config(converted)
    want = compute_logits(load_checkpoint_params(converted, cfg), cfg, ids)
    np.testing.assert_allclose(np.load(cwd / "out" / "l.npy"), want, atol=1e-6)


BAD_IDS = [
    ("ids.txt", "", ["ids.txt is empty"]),
    ("ids.txt", "1 2 3\n4 five 6\n", ["ids.txt line 2: 'five' is not an integer token id"]),
    ("ids.txt", "1 2 3\n4 5\n", ["ids.txt line 2 has 2 ids but line 1 has 3"]),
    ("ids.txt", "\x00\xff\xfe", ["neither a .npy file nor text"]),
    ("ids.npy", "1 2 3", ["ids.npy is not a .npy file"]),
    ("ids.npy", np.zeros((2, 0), np.int32), ["ids.npy is empty"]),
    ("ids.npy", np.ones((1, 3), np.float32), ["must be integers", "float32"]),
    ("ids.npy", np.zeros((1, 2, 3), np.int32), ["must be integers [batch, seq] or [seq]", "[1, 2, 3]"]),
    ("ids.npy", np.array([{"a": 1}], dtype=object), ["not a readable .npy array"]),
]


def _write_ids(path: Path, content) -> None:
    if isinstance(content, str):
        path.write_bytes(content.encode("latin-1"))
    else:
        np.save(path, content, allow_pickle=True)


@pytest.mark.parametrize("name,content,fragments", BAD_IDS)
def test_unusable_ids_files_are_named_with_what_is_wrong(tmp_path, name, content, fragments):
    _write_ids(tmp_path / name, content)
    with pytest.raises(InputError) as err:
        read_input_ids(tmp_path / name)
    assert f"--input-ids {tmp_path / name}" in str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    "name,content,fragments",
    [
        BAD_IDS[0],  # empty: was a ZeroDivisionError
        BAD_IDS[1],  # text: was a numpy pickle traceback
        BAD_IDS[-1],  # a pickled .npy is never unpickled
        ("ids.npy", np.array([[1, 2, 999]]), ["must be in [0, 160)", "999"]),  # checked before loading params
    ],
)
def test_logits_refuses_unusable_ids_in_one_line(user, converted, name, content, fragments):
    cwd, home = user
    _write_ids(cwd / name, content)
    proc = run(cwd, home, "logits", "--checkpoint", str(converted), "--input-ids", name, "--output", "l.npy")
    one_line_error(proc, f"--input-ids {cwd / name}", *fragments)
    assert not (cwd / "l.npy").exists()


@pytest.mark.parametrize(
    "text,want",
    [
        ("5 6 7\n", [[5, 6, 7]]),
        ("1,2,3\n4, 5, 6\n\n", [[1, 2, 3], [4, 5, 6]]),
        ("  8\t9 \r\n10 11\n", [[8, 9], [10, 11]]),
    ],
)
def test_text_ids_are_whitespace_or_comma_separated_one_sequence_per_line(tmp_path, text, want):
    (tmp_path / "ids").write_text(text)
    np.testing.assert_array_equal(read_input_ids(tmp_path / "ids"), want)


def test_empty_ids_are_refused_even_when_passed_in_memory(converted):
    cfg = checkpoint_model_config(converted)
    with pytest.raises(InputError, match="empty"):
        compute_logits({}, cfg, np.zeros((1, 0), np.int32))
