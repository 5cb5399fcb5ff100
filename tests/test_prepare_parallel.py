"""Data preparation in parallel and resumably (issue 44 item 1): work units fixed by the inputs, shards
byte-identical whatever the worker count, a killed run resumed by rerunning the same command, gs://
inputs and outputs.

The oracle is `one_process`: the single-process writer as it was before work units (every file read
whole, in order, each record to shard index mod num_shards). Every preparation here must write exactly
its bytes, and report its bad records at the same file:line.
"""

from __future__ import annotations

import codecs
import collections
import gzip
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from array_record.python import array_record_module
from helpers import shard_records

from trainer.data import shards
from trainer.data.errors import DataError
from trainer.data.formatting import RecordError
from trainer.data.prepare_units import TEST_DELAY_ENV, tokenize_record
from trainer.data.readers import LineRange, line_starts, read_records
from trainer.data.shards import RUN_FIGURES, prepare
from trainer.data.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]


def write_inputs(root: Path) -> list[str]:
    """A JSONL file worth many small units (a byte-order mark, CRLF and LF lines, blank lines, bad JSON,
    a missing field, bytes that are not UTF-8, chats, non-ASCII text), a plain text file (paragraphs,
    a non-UTF-8 line, no newline at the end), a JSON array and a gzipped JSONL file (read whole)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(160):
        kind = i % 10
        if kind == 3:
            lines.append(b'{"text": "broken')
        elif kind == 5:
            lines.append(json.dumps({"body": i}).encode())
        elif kind == 7:
            lines.append(b'{"text": "caf\xe9 %d"}' % i)
        elif kind == 8:
            lines.append(json.dumps({"messages": [*CHAT, {"role": "user", "content": f"q{i}"}]}).encode())
        elif kind == 9:
            lines.append(b"   ")
        else:
            text = f"document {i}: naïve ✓ " + "word " * (i % 13)
            lines.append(json.dumps({"text": text}, ensure_ascii=False).encode())
    big = root / "big.jsonl"
    big.write_bytes(codecs.BOM_UTF8 + b"\r\n".join(lines[:70]) + b"\r\n" + b"\n".join(lines[70:]) + b"\n")
    paragraphs = []
    for i in range(40):
        body = [f"line {i}.{j} of paragraph {i}" for j in range(i % 4 + 1)]
        if i == 17:
            body[0] = "caf\udce9 is not UTF-8"
        paragraphs.append("\n".join(body))
    text = ("\n\n".join(paragraphs) + "\n\n\nlast words without a newline").encode("utf-8", "surrogateescape")
    notes = root / "notes.txt"
    notes.write_bytes(codecs.BOM_UTF8 + text)
    (root / "array.json").write_text(json.dumps([{"text": "from an array"}, {"body": "no text"}], indent=1))
    (root / "more.jsonl.gz").write_bytes(gzip.compress(b'{"text": "gzipped"}\n{oops\n'))
    return [str(big), str(notes), str(root / "array.json"), str(root / "more.jsonl.gz")]


def one_process(
    files: list[str], out: Path, num_shards: int, tok, text_unit: str
) -> tuple[collections.Counter, list]:
    """The single-process writer before work units: returns the bad records by reason and the first five."""
    out.mkdir(parents=True)
    writers = [
        array_record_module.ArrayRecordWriter(
            str(out / f"data-{i:05d}-of-{num_shards:05d}.arrayrecord"), "group_size:1"
        )
        for i in range(num_shards)
    ]
    n, bad, examples = 0, collections.Counter(), []
    for path in files:
        for where, record in read_records(path, text_unit=text_unit):
            if isinstance(record, dict) and tok is not None:
                try:
                    record = tokenize_record(record, tok)
                except RecordError as e:
                    record = e
            if isinstance(record, RecordError):
                bad[str(record).split(" (")[0]] += 1
                examples.append(f"{where}: {record}")
                continue
            writers[n % num_shards].write(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode())
            n += 1
    for w in writers:
        w.close()
    return bad, examples[:5]


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).glob("*.arrayrecord"))}


def data_info(directory: Path, *drop: str) -> dict:
    """dataset_info.json without the run's figures (and `drop`)."""
    info = json.loads((Path(directory) / "dataset_info.json").read_text())
    return {k: v for k, v in info.items() if k not in (*RUN_FIGURES, *drop)}


def quiet(**kw) -> dict:
    return {"progress_stream": io.StringIO(), **kw}


@pytest.mark.parametrize("text_unit, tokenized", [("line", True), ("paragraph", False)])
def test_one_and_four_workers_write_the_bytes_one_process_writes(tmp_path, text_unit, tokenized):
    files = write_inputs(tmp_path / "in")
    tok = Tokenizer(TOKENIZER) if tokenized else None
    bad, examples = one_process(files, tmp_path / "reference", 3, tok, text_unit)
    runs = {
        "1 worker": prepare(
            files, tmp_path / "w1", 3, tokenizer=tok, text_unit=text_unit, **quiet(workers=1, unit_bytes=256)
        ),
        "4 workers": prepare(
            files, tmp_path / "w4", 3, tokenizer=tok, text_unit=text_unit, **quiet(workers=4, unit_bytes=256)
        ),
        "whole files": prepare(
            files, tmp_path / "whole", 3, tokenizer=tok, text_unit=text_unit, **quiet(workers=2)
        ),
    }
    split = runs["1 worker"].units
    assert split >= 20 and runs["whole files"].units == len(files)  # big.jsonl (and notes.txt by line) cut up
    assert runs["4 workers"].workers == 4 and runs["1 worker"].workers == 1
    reference = shard_bytes(tmp_path / "reference")
    assert len(reference) == 3 and all(reference.values())
    for name, summary in runs.items():
        out = tmp_path / {"1 worker": "w1", "4 workers": "w4", "whole files": "whole"}[name]
        assert shard_bytes(out) == reference, name
        assert summary.bad == bad and list(summary.bad) == list(bad), name  # counts, in first-seen order
        assert summary.bad_examples == examples, name  # the same file:line
        assert (summary.tokens is not None) == tokenized
    assert data_info(tmp_path / "w1") == data_info(tmp_path / "w4")
    assert data_info(tmp_path / "w1", "units") == data_info(tmp_path / "whole", "units")
    last = examples[-1].removeprefix(f"{files[0]}:")
    assert int(last.split(":")[0]) > 10  # the first five bad records reach past the first ranges of big.jsonl
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work directory left


def test_preference_pairs_are_written_through_byte_identically_whatever_the_workers(tmp_path):
    """Preference records (conversational JSONL cut into many units, standard pairs in a JSON array) pass
    through untokenized even with a tokenizer; the shards are one process's bytes for 1 and 4 workers, and
    lines that are not JSON are still counted, not fatal."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_preference_data

    lines = [json.dumps(r, ensure_ascii=False) for r in make_preference_data.generate(80, seed=5)]
    lines[33], lines[61] = '{"prompt": "cut sh', ""
    (tmp_path / "in").mkdir()
    conversational = tmp_path / "in" / "pairs.jsonl"
    conversational.write_text("\n".join(lines) + "\n", encoding="utf-8")
    standard = tmp_path / "in" / "standard.json"
    standard.write_text(
        json.dumps([{"prompt": f"{i} + {i} =", "chosen": f" {2 * i}", "rejected": " 7"} for i in range(9)])
    )
    files = [str(conversational), str(standard)]
    tok = Tokenizer(TOKENIZER)
    bad, examples = one_process(files, tmp_path / "reference", 2, tok, "paragraph")
    reference = shard_bytes(tmp_path / "reference")
    one = prepare(files, tmp_path / "w1", 2, tokenizer=tok, **quiet(workers=1, unit_bytes=4096))
    four = prepare(files, tmp_path / "w4", 2, tokenizer=tok, **quiet(workers=4, unit_bytes=4096))
    assert one.units >= 8 and four.workers == 4
    for out, summary in ((tmp_path / "w1", one), (tmp_path / "w4", four)):
        assert shard_bytes(out) == reference
        assert summary.records == 78 + 9 and summary.bad == bad == {"invalid JSON": 1}
        assert summary.bad_examples == examples and examples[0].startswith(f"{conversational}:34: invalid JSON")
    assert one.tokens == four.tokens > 87 * 100
    records = [json.loads(line) for line in lines if line.startswith('{"prompt": [')]
    assert sorted(map(json.dumps, shard_records(tmp_path / "w4"))) == sorted(
        map(json.dumps, records + json.loads(standard.read_text()))
    )


def test_ranges_at_line_starts_read_like_the_whole_file(tmp_path):
    path = tmp_path / "f.jsonl"
    body = [json.dumps({"text": f"r{i}" * (i % 5 + 1)}) for i in range(12)]
    body[4], body[7] = "", "{bad"
    path.write_bytes(codecs.BOM_UTF8 + "\r\n".join(body).encode() + b"\n\n" + b'{"text": "no newline"}')
    whole = [(w.rsplit(":", 1)[1], r if isinstance(r, dict) else str(r)) for w, r in read_records(str(path))]
    size = path.stat().st_size
    for range_bytes in [*range(1, 40), 57, 100, size - 1, size, size + 5]:
        bounds = line_starts(str(path), size, range_bytes)
        assert bounds[0] == 0 and bounds[-1] == size and bounds == sorted(set(bounds))
        got, before = [], 0
        for a, b in zip(bounds, bounds[1:]):
            lines = LineRange(str(path), a, b)
            got += [(str(before + n), r if isinstance(r, dict) else str(r)) for n, r in lines.records()]
            before += lines.lines
        assert got == whole, range_bytes


def test_a_preparation_stopped_after_merging_or_publishing_resumes_and_a_changed_command_starts_afresh(
    tmp_path, monkeypatch
):
    files = write_inputs(tmp_path / "in")
    out, kw = tmp_path / "out", quiet(workers=1, unit_bytes=256)
    first = prepare(files, tmp_path / "first", 2, **kw)

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    def stop_at_the_sixth_unit(*args):
        for i, unit_summary in enumerate(run_units(*args)):
            if i == 5:
                raise KeyboardInterrupt
            yield unit_summary

    run_units = shards.run_units
    with monkeypatch.context() as m:  # stopped midway: six units complete (the sixth as it is handed over)
        m.setattr(shards, "run_units", stop_at_the_sixth_unit)
        with pytest.raises(KeyboardInterrupt):
            prepare(files, out, 2, **kw)
    other_units = prepare(files, out, 2, **{**kw, "unit_bytes": 512})  # another unit size: other units
    assert other_units.units_resumed == 0 and shard_bytes(out) == shard_bytes(tmp_path / "first")
    shutil.rmtree(out)
    resumed = prepare(files, out, 2, **kw)
    assert resumed.units_resumed == 6 and shard_bytes(out) == shard_bytes(tmp_path / "first")
    shutil.rmtree(out)

    with monkeypatch.context() as m:  # stopped once the shards are built, before they are published
        m.setattr(shards, "publish", stop)
        with pytest.raises(KeyboardInterrupt):
            prepare(files, out, 2, **kw)
    assert not out.exists()
    [work] = [p for p in tmp_path.iterdir() if p.name.startswith(".out.prepare-")]
    again = prepare(files, out, 2, **kw)
    assert again.units_resumed == again.units == first.units and shard_bytes(out) == shard_bytes(
        tmp_path / "first"
    )
    assert not work.exists()

    with monkeypatch.context() as m:  # stopped after publishing, before removing the work directory
        m.setattr(shards, "remove_work_dir", stop)
        with pytest.raises(KeyboardInterrupt):
            prepare(files, out, 2, overwrite=True, **kw)
    assert work.exists() and shard_bytes(out) == shard_bytes(tmp_path / "first")
    assert prepare(files, out, 2, overwrite=True, **kw).units_resumed == first.units
    assert not work.exists()

    def second_run(*args):  # the same command again, while the first one runs
        with pytest.raises(DataError, match="another preparation of the same inputs"):
            prepare(files, out, 2, overwrite=True, **kw)
        assert (work / "shards").is_dir()  # the refused run removed nothing of the running one's work
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(shards, "publish", second_run)
        with pytest.raises(KeyboardInterrupt):
            prepare(files, out, 2, overwrite=True, **kw)
    assert work.exists()
    Path(files[0]).write_bytes(Path(files[0]).read_bytes() + b'{"text": "one more"}\n')  # another input
    changed = prepare(files, out, 2, overwrite=True, **kw)
    assert changed.units_resumed == 0 and changed.records == first.records + 1
    assert work.exists()  # the old command's work is another directory, left as it was
    assert prepare(files, out, 3, overwrite=True, **kw).units_resumed == 0


def test_a_preparation_killed_midway_and_rerun_gives_the_shards_of_an_uninterrupted_one(tmp_path):
    files = write_inputs(tmp_path / "in")
    cmd = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--num-shards", "3", "--workers", "2"]
    cmd += ["--unit-size", "300", "--tokenizer", str(TOKENIZER), "--text-unit", "line"]
    for f in files:
        cmd += ["--input", f]
    with open(tmp_path / "killed.log", "wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--output-dir", "out"],
            cwd=tmp_path,
            env={**os.environ, TEST_DELAY_ENV: "0.3"},  # every unit waits 0.3 s: the kill lands midway
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while len(done := list(tmp_path.glob(".out.prepare-*/units/u*.json"))) < 4:
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()
            assert time.monotonic() < deadline, "no unit completed in 2 minutes"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (tmp_path / "out").exists()  # nothing published: no half-written shard anywhere a glob looks
    rerun = subprocess.run(
        [*cmd, "--output-dir", "out"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr
    total, resumed = map(
        int, re.search(r"units: +(\d+) \((\d+) completed by an earlier run", rerun.stdout).groups()
    )
    assert len(done) <= resumed < total, (len(done), resumed, total)  # it skipped the units done before the kill
    fresh = subprocess.run(
        [*cmd, "--output-dir", "fresh"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert fresh.returncode == 0, fresh.stderr
    assert "completed by an earlier run" not in fresh.stdout and "tokens/s per core (2 workers)" in fresh.stdout
    assert (
        shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "fresh")
        and len(shard_bytes(tmp_path / "out")) == 3
    )
    assert data_info(tmp_path / "out") == data_info(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "killed.log") == ["fresh", "in", "out"]


def test_gs_inputs_and_output(gcs_server, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "cache"))  # where a gs:// output is built
    files = write_inputs(tmp_path / "in")
    tok = Tokenizer(TOKENIZER)
    kw = {"tokenizer": tok, "text_unit": "line", **quiet(unit_bytes=256)}
    local = prepare(files, tmp_path / "local", 3, workers=1, **kw)
    bucket = gcs_server.new_bucket("prepare")
    remote = []
    for f in files:
        gcs_server.write(bucket, f"raw/{Path(f).name}", Path(f).read_bytes())
        remote.append(f"gs://{bucket}/raw/{Path(f).name}")
    gcs_server.write(bucket, "out/data-00003-of-00004.arrayrecord", b"an older, bigger output")
    gcs_server.write(bucket, "out/dataset_info.json", b"{}")
    with gcs_server.applied():
        with pytest.raises(DataError, match="already holds 1 .arrayrecord shards"):
            prepare(remote, f"gs://{bucket}/out", 3, workers=2, **kw)
        summary = prepare(remote, f"gs://{bucket}/out", 3, workers=2, overwrite=True, **kw)
    assert summary.units == local.units and summary.workers == 2
    assert [
        e.replace(f"gs://{bucket}/raw", str(tmp_path / "in")) for e in summary.bad_examples
    ] == local.bad_examples
    names = gcs_server.names(bucket, "out/")
    assert names == [f"out/{n}" for n in [*local.shards, "dataset_info.json"]]  # the old shard deleted
    assert {n: gcs_server.read(bucket, f"out/{n}") for n in local.shards} == shard_bytes(tmp_path / "local")
    info = json.loads(gcs_server.read(bucket, "out/dataset_info.json"))
    assert info["inputs"] == remote and {k: v for k, v in info.items() if k not in (*RUN_FIGURES, "inputs")} == (
        data_info(tmp_path / "local", "inputs")
    )
    assert not list((tmp_path / "cache" / "prepare").iterdir())  # the local work directory removed


def test_workers_import_no_jax():
    """A spawned worker imports the module that started it: the CLI's, and what the units need."""
    code = (
        "import sys, trainer.data.prepare, trainer.data.prepare_units; "
        "jax = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib'))); "
        "print(jax); sys.exit(bool(jax))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
