"""scripts/prepare_data.py and scripts/train_tokenizer.py run as a user types them (issue 19).

Each test runs the script in a fresh working directory with relative paths and checks the exit code,
the one-line error and what is left on disk: a failed run never destroys an old output and never
leaves a new file or folder behind.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import shard_records

REPO = Path(__file__).resolve().parents[1]
PREPARE = "prepare_data.py"
TRAIN = "train_tokenizer.py"


def run(cwd: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, prog: str, *needles: str) -> str:
    """Exit 2, no traceback, and the error is one line `<prog>: error: ...` holding every needle."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(errors) == 1, proc.stderr
    assert proc.stderr.rstrip().endswith(errors[0]), proc.stderr  # nothing after it
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under `root` (hidden ones included) with the hash of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def jsonl(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


# -- prepare_data.py ------------------------------------------------------------------------------------


def test_failed_overwrite_keeps_the_old_shards_and_info_byte_identical(tmp_path):
    (tmp_path / "good.jsonl").write_text(jsonl({"text": "old one"}, {"text": "old two"}))
    assert (
        run(tmp_path, PREPARE, "--input", "good.jsonl", "--output-dir", "out", "--num-shards", "2").returncode == 0
    )
    before = snapshot(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"body": "no text field"}\n{oops\n')
    after_input = {**before, **{k: v for k, v in snapshot(tmp_path).items() if k == "bad.jsonl"}}

    proc = run(tmp_path, PREPARE, "--input", "bad.jsonl", "--output-dir", "out", "--overwrite")
    assert_one_line_error(proc, PREPARE, "no usable record", "bad.jsonl:1", "missing field 'text'")
    assert snapshot(tmp_path) == after_input  # old shards + dataset_info.json untouched, no staging left

    (tmp_path / "new.jsonl").write_text(jsonl({"text": "new"}))
    assert run(tmp_path, PREPARE, "--input", "new.jsonl", "--output-dir", "out", "--overwrite").returncode == 0
    assert shard_records(tmp_path / "out") == [{"text": "new"}]
    info = json.loads((tmp_path / "out" / "dataset_info.json").read_text())
    assert info["records"] == 1 and info["shards"] == sorted(
        p.name for p in (tmp_path / "out").glob("*.arrayrecord")
    )


def test_existing_output_needs_overwrite_and_foreign_files_are_never_replaced(tmp_path):
    (tmp_path / "a.jsonl").write_text(jsonl({"text": "a"}))
    assert run(tmp_path, PREPARE, "--input", "a.jsonl", "--output-dir", "out").returncode == 0
    assert_one_line_error(
        run(tmp_path, PREPARE, "--input", "a.jsonl", "--output-dir", "out"),
        PREPARE,
        "already holds 1 .arrayrecord shards",
        "--overwrite",
    )
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("keep me")
    before = snapshot(tmp_path)
    proc = run(tmp_path, PREPARE, "--input", "a.jsonl", "--output-dir", "mine", "--overwrite")
    assert_one_line_error(proc, PREPARE, "holds files this tool did not write (notes.md)")
    assert snapshot(tmp_path) == before
    (tmp_path / "empty").mkdir()
    assert run(tmp_path, PREPARE, "--input", "a.jsonl", "--output-dir", "empty").returncode == 0


def test_a_non_utf8_byte_is_a_bad_record_with_file_and_line(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n{"text": "also fine"}\n')
    proc = run(tmp_path, PREPARE, "--input", "in.jsonl", "--output-dir", "out")
    assert proc.returncode == 0, proc.stderr
    assert "2 written, 1 bad" in proc.stdout and "not UTF-8 text" in proc.stdout
    assert re.search(r"in\.jsonl:2: not UTF-8 text \(byte 0xe9", proc.stdout), proc.stdout
    assert shard_records(tmp_path / "out") == [{"text": "fine"}, {"text": "also fine"}]


def test_an_input_without_usable_record_leaves_nothing_so_the_rerun_is_not_refused(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    before = snapshot(tmp_path)
    proc = run(tmp_path, PREPARE, "--input", "in.jsonl", "--output-dir", "data/mine")
    assert_one_line_error(proc, PREPARE, "no usable record", "in.jsonl:1", "not UTF-8 text")
    assert snapshot(tmp_path) == before  # no empty shard, no data/ folder
    (tmp_path / "in.jsonl").write_text(jsonl({"text": "café"}))
    proc = run(tmp_path, PREPARE, "--input", "in.jsonl", "--output-dir", "data/mine")
    assert proc.returncode == 0, proc.stderr
    assert shard_records(tmp_path / "data" / "mine") == [{"text": "café"}]


def test_any_text_file_is_plain_text_and_json_arrays_are_records(tmp_path):
    files = {
        "guide.rst": "Title\n=====\n\nBody.\n",
        "page.html": "<p>hi</p>\n",
        "tool.py": "def f():\n    pass\n",
        "NOTES": "no extension\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(b"gzipped text\n"))
    proc = run(
        tmp_path,
        PREPARE,
        "--input",
        "guide.rst,page.html,tool.py,NOTES,notes.txt.gz",
        "--output-dir",
        "text",
        "--text-unit",
        "file",
    )
    assert proc.returncode == 0, proc.stderr
    assert [r["text"] for r in shard_records(tmp_path / "text")] == [
        "Title\n=====\n\nBody.\n",
        "<p>hi</p>\n",
        "def f():\n    pass\n",
        "no extension\n",
        "gzipped text\n",
    ]

    (tmp_path / "array.json").write_text(
        json.dumps([{"text": "one"}, {"messages": [{"role": "user", "content": "hi"}]}, {"body": "x"}], indent=1)
    )
    (tmp_path / "object.json").write_text(json.dumps({"text": "single"}, indent=2))
    (tmp_path / "lines.json").write_text(jsonl({"text": "jsonl named .json"}))
    proc = run(tmp_path, PREPARE, "--input", "*.json", "--output-dir", "json")
    assert proc.returncode == 0, proc.stderr
    assert shard_records(tmp_path / "json") == [
        {"text": "one"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"text": "jsonl named .json"},
        {"text": "single"},
    ]
    assert "4 written, 1 bad" in proc.stdout and "array.json:13: missing field 'text'" in proc.stdout


@pytest.mark.parametrize(
    "content, why",
    [
        (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "binary data (a NUL byte"),
        (bytes(range(128, 256)) * 20, "not UTF-8 text ("),
    ],
)
def test_a_binary_file_is_refused_before_any_work(tmp_path, content, why):
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "image.png").write_bytes(content)
    before = snapshot(tmp_path)
    for script, out in ((PREPARE, ["--output-dir", "out"]), (TRAIN, ["--output", "tok/x.model"])):
        proc = run(tmp_path, script, "--input", "a.txt", "--input", "image.png", *out)
        assert_one_line_error(proc, script, "image.png", why, "drop it from --input")
        assert snapshot(tmp_path) == before


def test_bad_globs_and_arguments_are_one_line_errors(tmp_path):
    assert_one_line_error(
        run(tmp_path, PREPARE, "--input", "raw/*.jsonl", "--output-dir", "out"),
        PREPARE,
        "'raw/*.jsonl' matches no file",
        str(tmp_path / "raw"),
    )
    (tmp_path / "raw").mkdir()
    assert_one_line_error(
        run(tmp_path, TRAIN, "--input", "raw", "--output", "t.model"), TRAIN, "is a directory", "raw/*"
    )
    (tmp_path / "raw" / "a.jsonl").write_text(jsonl({"text": "a"}))
    assert_one_line_error(
        run(tmp_path, PREPARE, "--input", "raw/*", "--output-dir", "o", "--num-shards", "0"),
        PREPARE,
        "--num-shards=0",
    )
    assert_one_line_error(
        run(tmp_path, PREPARE, "--input", "raw/*", "--output-dir", "o", "--tokenizer", "no.model"),
        PREPARE,
        "no.model",
        "not found",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


@pytest.mark.parametrize("script", [PREPARE, TRAIN])
def test_help_says_formats_fields_exit_codes_and_outputs(tmp_path, script):
    proc = run(tmp_path, script, "--help")
    assert proc.returncode == 0
    text = proc.stdout
    for needle in (
        ".jsonl",
        ".json",
        ".parquet",
        ".arrayrecord",
        "plain UTF-8 text",
        ".rst",
        ".gz",
        "--text-field",
        "--messages-field",
        '"text"',
        '"messages"',
        "exit codes",
        "0  success",
        "2  bad input",
        f"{script}: error:",
        "--overwrite",
        "a failed run",
    ):
        assert needle in text, needle
    assert ("dataset_info.json" in text) if script == PREPARE else (".model file" in text)
    if script == PREPARE:
        for needle in ("--workers", "--unit-size", "gs://", "byte-identical", "rerun the same command", "kill -9"):
            assert needle in text, needle


def test_prepare_data_in_parallel_reports_tokens_per_second_and_the_line_of_a_bad_record(tmp_path):
    lines = [json.dumps({"text": f"record {i} " + "word " * (i % 7)}).encode() for i in range(200)]
    lines[149] = b'{"text": "caf\xe9"}'
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    tokenizer = REPO / "data" / "tokenizer" / "fc_sp8k.model"
    args = ["--input", "in.jsonl", "--output-dir", "out", "--num-shards", "2", "--tokenizer", str(tokenizer)]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.data.prepare", *args, "--workers", "2", "--unit-size", "1K"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "199 written, 1 bad" in proc.stdout
    assert re.search(r"in\.jsonl:150: not UTF-8 text \(byte 0xe9", proc.stdout), proc.stdout  # in a later unit
    assert re.search(r"speed: +[\d,]+ tokens/s, [\d,]+ tokens/s per core \(2 workers\), [\d.]+ s", proc.stdout)
    info = json.loads((tmp_path / "out" / "dataset_info.json").read_text())
    assert info["units"] > 5 and info["workers"] == 2 and info["tokens_per_s"] > 0 and info["seconds"] > 0
    assert info["tokens_per_s_per_core"] == pytest.approx(info["tokens_per_s"] / 2, rel=1e-3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]


# -- train_tokenizer.py ---------------------------------------------------------------------------------


def chats(n: int) -> str:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    return jsonl(
        *(
            {
                "messages": [
                    {"role": "user", "content": " ".join(words[i % 12 :] + words[: i % 12])},
                    {"role": "assistant", "content": f"answer {i}: " + " ".join(words[::-1])},
                ]
            }
            for i in range(n)
        )
    )


def test_train_tokenizer_says_how_many_records_lacked_the_text_field(tmp_path):
    (tmp_path / "a.jsonl").write_text(jsonl(*({"body": f"text {i}"} for i in range(5))))
    before = snapshot(tmp_path)
    proc = run(tmp_path, TRAIN, "--input", "a.jsonl", "--output", "tok/mine.model")
    line = assert_one_line_error(
        proc,
        TRAIN,
        "no usable record",
        "5 x missing field 'text' or 'messages'",
        "a.jsonl:1",
        "fields: body",
        "--text-field",
    )
    assert "sentencepiece" not in line
    assert snapshot(tmp_path) == before  # no tok/ folder, no model
    proc = run(
        tmp_path,
        TRAIN,
        "--input",
        "a.jsonl",
        "--output",
        "tok/mine.model",
        "--text-field",
        "body",
        "--vocab-size",
        "280",
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "tok" / "mine.model").is_file()


def test_train_tokenizer_suggests_a_vocab_size_that_works(tmp_path):
    (tmp_path / "chats.jsonl").write_text(chats(40) + jsonl({"body": "skipped"}))
    proc = run(tmp_path, TRAIN, "--input", "chats.jsonl", "--output", "tok.model")  # default 8192: too many
    line = assert_one_line_error(
        proc,
        TRAIN,
        "--vocab-size 8192 is more than the training text can fill",
        "1 record(s) skipped",
        "chats.jsonl:41",
    )
    assert "smaller" not in line and "use more data" not in line
    most = int(re.search(r"pass --vocab-size (\d+)", line)[1])
    proc = run(tmp_path, TRAIN, "--input", "chats.jsonl", "--output", "tok.model", "--vocab-size", "100")
    line = assert_one_line_error(proc, TRAIN, "--vocab-size 100 is too small")
    least = int(re.search(r"pass --vocab-size (\d+) or more", line)[1])
    assert least < most
    assert not any(tmp_path.glob("*.model")) and not any(tmp_path.glob(".*"))
    for size in (least, most):
        proc = run(
            tmp_path, TRAIN, "--input", "chats.jsonl", "--output", f"tok-{size}.model", "--vocab-size", str(size)
        )
        assert proc.returncode == 0, proc.stderr
        assert f"vocab {size}" in proc.stdout and "skipped 1 record(s)" in proc.stdout


def test_train_tokenizer_refuses_an_existing_output_without_overwrite(tmp_path):
    (tmp_path / "chats.jsonl").write_text(chats(40))
    (tmp_path / "tok.model").write_bytes(b"an older model")
    proc = run(tmp_path, TRAIN, "--input", "chats.jsonl", "--output", "tok.model", "--vocab-size", "300")
    assert_one_line_error(proc, TRAIN, "tok.model already exists", "--overwrite")
    assert (tmp_path / "tok.model").read_bytes() == b"an older model"
    proc = run(
        tmp_path, TRAIN, "--input", "chats.jsonl", "--output", "tok.model", "--vocab-size", "100", "--overwrite"
    )  # fails: the old model stays
    assert_one_line_error(proc, TRAIN, "too small")
    assert (tmp_path / "tok.model").read_bytes() == b"an older model"
    proc = run(
        tmp_path, TRAIN, "--input", "chats.jsonl", "--output", "tok.model", "--vocab-size", "300", "--overwrite"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "tok.model").read_bytes() != b"an older model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "tok.model"]
    (tmp_path / "models").mkdir()
    proc = run(tmp_path, TRAIN, "--input", "chats.jsonl", "--output", "models", "--overwrite")
    assert_one_line_error(proc, TRAIN, "is a directory", "models/mine.model")
    assert (tmp_path / "models").is_dir()


def test_train_tokenizer_skips_non_utf8_records_and_reads_any_text_file(tmp_path):
    (tmp_path / "chats.jsonl").write_bytes(chats(30).encode() + b'{"text": "caf\xe9"}\n')
    (tmp_path / "guide.rst").write_text("Some reStructuredText\n=====================\n\nA paragraph.\n")
    (tmp_path / "more.json").write_text(json.dumps([{"text": "from a JSON array"}]))
    proc = run(
        tmp_path,
        TRAIN,
        "--input",
        "chats.jsonl,guide.rst,more.json",
        "--output",
        "tok.model",
        "--vocab-size",
        "320",
    )
    assert proc.returncode == 0, proc.stderr
    assert "trained on 33 records" in proc.stdout
    assert re.search(r"skipped 1 record\(s\): 1 x not UTF-8 text; first: \S*chats\.jsonl:31: ", proc.stdout)

    (tmp_path / "latin.txt").write_bytes(b"caf\xe9\n")
    before = snapshot(tmp_path)
    proc = run(tmp_path, TRAIN, "--input", "latin.txt", "--output", "new/tok.model")
    assert_one_line_error(proc, TRAIN, "no usable record", "latin.txt:1: not UTF-8 text")
    assert snapshot(tmp_path) == before
