"""Data preparation: converting inputs to ArrayRecord, tokenizer training, the function-calling generator."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import shard_records

from trainer.config.schema import DataConfig
from trainer.data.batch import fingerprint
from trainer.data.errors import DataError
from trainer.data.formatting import RecordError
from trainer.data.grain_pipeline import make_arrayrecord_iterator
from trainer.data.prepare import main as prepare_main
from trainer.data.readers import check_inputs, read_records
from trainer.data.shards import prepare
from trainer.data.tokenizer import CHAT_TOKENS, EOS, PAD, Tokenizer, train_sentencepiece

REPO = Path(__file__).resolve().parents[1]
BUNDLED_TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_data_round_trips_text_chats_and_plain_text_and_counts_bad_records(tmp_path, capsys):
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text(
        "\n".join(
            [
                json.dumps({"text": "first document"}),
                json.dumps({"messages": CHAT}),
                "{not json",
                json.dumps({"body": "wrong field"}),
                json.dumps({"text": "   "}),
                json.dumps({"messages": [{"role": "user", "content": 3}]}),
                json.dumps(["a", "list"]),
                json.dumps({"text": "second document"}),
            ]
        )
        + "\n"
    )
    txt = tmp_path / "book.txt"
    txt.write_text("Paragraph one,\nstill one.\n\nParagraph two.\n\n\n")
    code = prepare_main(
        ["--input", str(jsonl), "--input", str(txt), "--output-dir", str(tmp_path / "out"), "--num-shards", "2"]
    )
    out = capsys.readouterr().out
    assert code == 0
    records = shard_records(tmp_path / "out")
    assert sorted(map(json.dumps, records)) == sorted(
        map(
            json.dumps,
            [
                {"text": "first document"},
                {"messages": CHAT},
                {"text": "second document"},
                {"text": "Paragraph one,\nstill one."},
                {"text": "Paragraph two."},
            ],
        )
    )
    assert "5 written, 5 bad" in out
    assert "invalid JSON" in out and "missing field 'text' or 'messages'" in out and "mixed.jsonl:3" in out
    info = json.loads((tmp_path / "out" / "dataset_info.json").read_text())
    assert info["records"] == 5 and sum(info["bad"].values()) == 5 and len(info["shards"]) == 2


def test_fewer_records_than_shards_leaves_no_empty_shard(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "only one"}) + "\n")
    summary = prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", 4, progress_stream=io.StringIO())
    assert summary.shards == ["data-00000-of-00001.arrayrecord"]


def test_prepare_data_refuses_to_mix_with_existing_shards(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x y"}) + "\n")
    prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", 1, progress_stream=io.StringIO())
    with pytest.raises(DataError, match="--overwrite"):
        prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", 1, progress_stream=io.StringIO())


def test_prepare_data_cli_exits_2_on_a_glob_matching_nothing_or_no_usable_record(tmp_path, capsys):
    assert prepare_main(["--input", str(tmp_path / "*.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "matches no file" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    assert prepare_main(["--input", str(tmp_path / "bad.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "no usable record" in capsys.readouterr().err


def results(path: Path, **kw) -> list[tuple[str, object]]:
    """read_records as (line, record dict or 'bad: <reason>') with the file name dropped."""
    return [
        (where.rsplit(":", 1)[-1], f"bad: {r}" if isinstance(r, RecordError) else r)
        for where, r in read_records(str(path), **kw)
    ]


def test_json_files_hold_an_array_an_object_or_json_lines_with_errors_at_their_line(tmp_path):
    array = tmp_path / "a.json"
    array.write_bytes(b'\xef\xbb\xbf[\n {"text": "one"},\n {"text": "caf\xe9"},\n\n {"text": "three"}\n]\n')
    got = results(array)
    assert got[0] == ("2", {"text": "one"}) and got[2] == ("5", {"text": "three"}) and len(got) == 3
    assert got[1][0] == "3" and got[1][1].startswith("bad: not UTF-8 text (byte 0xe9 at line 3")
    broken = tmp_path / "b.json"
    broken.write_text('[{"text": "kept"},\n {"text": "cut" \n {"text": "lost"}]')
    assert results(broken) == [
        ("1", {"text": "kept"}),
        ("3", "bad: invalid JSON (Expecting ',' delimiter); the rest of the array is unreadable"),
    ]
    broken.write_text('[{"text": "kept"}\n {"text": "lost"}]')
    assert results(broken) == [
        ("1", {"text": "kept"}),
        (
            "2",
            (
                "bad: invalid JSON (expected ',' or ']' after an array element); the rest of the "
                "array is unreadable"
            ),
        ),
    ]
    (tmp_path / "c.json").write_text('{\n  "text": "pretty"\n}\n')
    assert results(tmp_path / "c.json") == [("1", {"text": "pretty"})]
    (tmp_path / "d.json").write_text('{"text": "line one"}\n{broken\n')
    assert results(tmp_path / "d.json") == [
        ("1", {"text": "line one"}),
        ("2", "bad: invalid JSON (Expecting property name enclosed in double quotes)"),
    ]
    (tmp_path / "e.json").write_text("[]")
    assert results(tmp_path / "e.json") == []


def test_plain_text_units_with_a_non_utf8_line_are_one_bad_record_at_that_line(tmp_path):
    path = tmp_path / "notes"  # no extension: plain text
    path.write_bytes(b"first para\r\nstill first\r\n\r\nsecond caf\xe9\nsecond again\n\nthird\n")
    got = results(path)
    assert got[0] == ("1", {"text": "first para\nstill first"}) and got[2] == ("7", {"text": "third"})
    assert got[1][0] == "4" and got[1][1].startswith("bad: not UTF-8 text (byte 0xe9 at column 11)")
    assert results(path, text_unit="line")[3:] == [("5", {"text": "second again"}), ("7", {"text": "third"})]
    assert results(path, text_unit="file") == [("4", got[1][1])]


def test_unreadable_inputs_fail_before_any_work(tmp_path):
    (tmp_path / "x.jsonl.gz").write_bytes(b"not gzip")
    (tmp_path / "y.parquet.gz").write_bytes(b"")
    (tmp_path / "z.bin").write_bytes(b"\x00\x01")
    for name, why in (
        ("x.jsonl.gz", "not a readable gzip file"),
        ("y.parquet.gz", "decompress it first"),
        ("z.bin", "binary data"),
    ):
        with pytest.raises(DataError, match=why):
            check_inputs([str(tmp_path / name)])


def test_a_failed_overwrite_keeps_the_old_output(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "old"}) + "\n")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", 1, progress_stream=io.StringIO())
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(DataError, match="no usable record"):
        prepare([str(tmp_path / "bad.jsonl")], tmp_path / "out", 1, overwrite=True, progress_stream=io.StringIO())
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "bad.jsonl", "out"]


def test_parquet_needs_pyarrow_or_round_trips(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "t.parquet").write_bytes(b"PAR1")
        with pytest.raises(DataError, match="pip install pyarrow"):
            prepare([str(tmp_path / "t.parquet")], tmp_path / "out", 1, progress_stream=io.StringIO())
        return
    pq.write_table(pa.table({"text": ["a parquet row", None]}), tmp_path / "t.parquet")
    summary = prepare([str(tmp_path / "t.parquet")], tmp_path / "out", 1, progress_stream=io.StringIO())
    assert summary.records == 1 and sum(summary.bad.values()) == 1


def test_pretokenized_shards_give_the_same_batches_as_raw_ones(tmp_path):
    records = [{"messages": CHAT}, {"text": "plain text one"}] * 3 + [{"messages": CHAT[::-1]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = Tokenizer(BUNDLED_TOKENIZER)
    raw = prepare([str(tmp_path / "in.jsonl")], tmp_path / "raw", 2, progress_stream=io.StringIO())
    pre = prepare([str(tmp_path / "in.jsonl")], tmp_path / "pre", 2, tokenizer=tok, progress_stream=io.StringIO())
    assert raw.tokens is None and pre.tokens > 20
    assert "input_ids" in shard_records(tmp_path / "pre")[0]

    def run(directory):
        cfg = DataConfig(
            dataset_type="arrayrecord",
            grain_train_files=f"{directory}/*.arrayrecord",
            tokenizer_path=str(BUNDLED_TOKENIZER),
            max_target_length=24,
            grain_worker_count=0,
        )
        it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=2)
        return [fingerprint(next(it)) for _ in range(4)]

    assert run(tmp_path / "raw") == run(tmp_path / "pre")

    other = train_sentencepiece(
        ["some other text for another tokenizer"] * 50, tmp_path / "other.model", vocab_size=300
    )
    cfg = DataConfig(
        dataset_type="arrayrecord",
        grain_train_files=f"{tmp_path}/pre/*.arrayrecord",
        tokenizer_path=str(other),
        grain_worker_count=0,
    )
    with pytest.raises(DataError, match="pre-tokenized with another tokenizer"):
        make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=2)


def test_tokenizer_training_reserves_the_chat_special_tokens(tmp_path, capsys):
    fc = load_script("make_function_calling_data")
    (tmp_path / "fc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fc.generate(150, seed=3)))
    trainer = load_script("train_tokenizer")
    model = tmp_path / "tok.model"
    assert (
        trainer.main(["--input", str(tmp_path / "fc.jsonl"), "--output", str(model), "--vocab-size", "600"]) == 0
    )
    tok = Tokenizer(model)
    assert tok.vocab_size == 600
    assert [tok.token_id(t) for t in CHAT_TOKENS] == [3, 4, 2, 0]
    assert tok.eos_id == tok.token_id(EOS) and tok.pad_id == tok.token_id(PAD)
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "x"}\n</tool_call><|im_end|>\n'
    ids = tok.encode(text)
    assert ids[0] == tok.im_start_id and tok.im_end_id in ids and tok.decode(ids) == text
    assert tok.encode("héllo ✓ 😀") and tok.decode(tok.encode("héllo ✓ 😀")) == "héllo ✓ 😀"  # byte fallback


def test_bundled_tokenizer_has_the_chat_tokens_and_fits_qwen3_tiny():
    tok = Tokenizer(BUNDLED_TOKENIZER)
    assert tok.vocab_size <= 32768
    assert None not in (tok.im_start_id, tok.im_end_id, tok.eos_id, tok.pad_id)


def test_function_calling_generator_is_deterministic_varied_and_consistent():
    fc = load_script("make_function_calling_data")
    for tool in fc.TOOLS:
        for ask in tool.asks:
            assert all(fc.mentions(ask, p) for p in tool.required), (tool.name, ask)
    data = list(fc.generate(300, seed=0))
    assert data == list(fc.generate(300, seed=0))
    assert data != list(fc.generate(300, seed=1))
    called, users = set(), set()
    for record in data:
        messages = record["messages"]
        declared = {
            json.loads(line)["name"]: json.loads(line)["parameters"]
            for line in messages[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
        }
        for m in messages:
            if m["role"] == "user":
                users.add(m["content"])
            if m["role"] == "assistant" and m["content"].startswith("<tool_call>"):
                call = json.loads(m["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
                schema = declared[call["name"]]
                assert set(schema["required"]) <= set(call["arguments"]) <= set(schema["properties"])
                called.add(call["name"])
    assert len(called) >= 20 and len(users) > 250
    kinds = [sum(m["role"] == "tool" for m in r["messages"]) for r in data]
    assert {0, 1, 2} <= set(kinds)
    assert np.mean([len(json.dumps(r)) for r in data]) < 2000
