"""Preference data (issue 45): the generator, the preparation tool's checks of preference records, and the
bundled sample data/preference_sample, which the commands in data/README.md reproduce."""

from __future__ import annotations

import collections
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest
from helpers import shard_records

from trainer.data.errors import DataError
from trainer.data.preference_records import PreferenceRecordError, check_preference
from trainer.data.prepare import main as prepare_main
from trainer.data.readers import read_records
from trainer.data.shards import prepare
from trainer.data.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "preference_sample"
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"
# The commands data/README.md documents for the sample (the test below runs their equivalent).
GENERATE = (
    "python scripts/make_preference_data.py --num-examples 320 --seed 0 --output /tmp/preference_sample.jsonl"
)
PREPARE = (
    "python scripts/prepare_data.py --input /tmp/preference_sample.jsonl --output-dir data/preference_sample "
    "--num-shards 2 --prefix pref --overwrite"
)
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
GOOD = {"role": "assistant", "content": "4"}
BAD = {"role": "assistant", "content": "5"}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reply(record: dict, field: str) -> str:
    return "".join(m["content"] for m in record[field])


def corruption(rejected: str, chosen: str) -> str:
    """What kind of wrong reply `rejected` is next to `chosen`."""
    if not rejected.startswith("<tool_call>\n"):
        return "text instead of a call" if chosen.startswith("<tool_call>") else "misquoted answer"
    body = rejected.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return "malformed call"
    if "arguments" not in call:
        return "malformed call"
    if not chosen.startswith("<tool_call>"):
        return "call instead of a text reply"
    right = json.loads(chosen.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    if call["name"] != right["name"]:
        return "wrong function"
    if set(call["arguments"]) < set(right["arguments"]):
        return "missing argument"
    return "wrong argument"


def test_generator_is_deterministic_and_every_pair_differs_in_a_learnable_way():
    pref = load_script("make_preference_data")
    data = list(pref.generate(300, seed=0))
    assert data == list(pref.generate(300, seed=0))
    assert data != list(pref.generate(300, seed=1))
    kinds = collections.Counter()
    for record in data:
        assert check_preference(record) == record  # conversational, valid as the preparation tool reads it
        assert set(record) == {"prompt", "chosen", "rejected"}
        assert record["prompt"][0]["role"] == "system" and record["prompt"][-1]["role"] in ("user", "tool")
        chosen, rejected = reply(record, "chosen"), reply(record, "rejected")
        assert chosen != rejected
        if chosen.startswith("<tool_call>"):  # the chosen call is one the system message declares
            name = json.loads(chosen.split("\n")[1])["name"]
            assert f'"name": "{name}"' in record["prompt"][0]["content"]
        kinds[corruption(rejected, chosen)] += 1
    assert len(kinds) == 7, kinds  # every corruption occurs
    assert min(kinds.values()) >= 10, kinds


def test_check_preference_accepts_both_formats_and_names_what_is_wrong():
    assert check_preference({"prompt": PROMPT, "chosen": [GOOD], "rejected": [BAD], "extra": 1}) == {
        "prompt": PROMPT,
        "chosen": [GOOD],
        "rejected": [BAD],
    }
    assert check_preference({"prompt": "2+2=", "chosen": "4", "rejected": "5"}) == {
        "prompt": "2+2=",
        "chosen": "4",
        "rejected": "5",
    }
    cases = {
        "missing field 'prompt'; put the conversation before the replies in 'prompt'": {
            "chosen": [*PROMPT, GOOD],
            "rejected": [*PROMPT, BAD],
        },
        "missing field 'rejected'": {"prompt": PROMPT, "chosen": [GOOD]},
        "the fields mix formats (prompt is a list, chosen is a str, rejected is a list)": {
            "prompt": PROMPT,
            "chosen": "4",
            "rejected": [BAD],
        },
        "chosen[0].role is 'user', not 'assistant'; move that message into 'prompt'": {
            "prompt": PROMPT,
            "chosen": [{"role": "user", "content": "4"}],
            "rejected": [BAD],
        },
        "field 'rejected' is empty": {"prompt": "2+2=", "chosen": "4", "rejected": " "},
        "field 'chosen' is a dict, not a string or a list of messages": {
            "prompt": PROMPT,
            "chosen": GOOD,
            "rejected": [BAD],
        },
        "rejected[0].content must be a string": {
            "prompt": PROMPT,
            "chosen": [GOOD],
            "rejected": [{"role": "assistant", "content": 5}],
        },
    }
    for message, record in cases.items():
        with pytest.raises(PreferenceRecordError, match="bad preference record") as e:
            check_preference(record)
        assert message in str(e.value) and "all three strings (standard)" in str(e.value)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_preparation_writes_pairs_through_and_refuses_a_bad_one_at_its_line(tmp_path, capsys):
    pairs = [
        {"prompt": PROMPT, "chosen": [GOOD], "rejected": [BAD]},
        {"prompt": "2+2=", "chosen": " 4", "rejected": " 5"},
    ]
    good = write_jsonl(tmp_path / "good.jsonl", pairs)
    out = tmp_path / "out"
    args = ["--input", str(good), "--output-dir", str(out), "--tokenizer", str(TOKENIZER)]
    assert prepare_main(args) == 0
    assert shard_records(out) == pairs  # untokenized, even with --tokenizer
    report = capsys.readouterr().out
    assert "records: 2 written, 0 bad" in report
    assert int(report.split("tokens:")[1].split()[0].replace(",", "")) > 10

    bad = write_jsonl(
        tmp_path / "bad.jsonl", [pairs[0], "", {"prompt": PROMPT, "chosen": [GOOD, BAD], "rejected": "5"}]
    )
    assert prepare_main(["--input", str(bad), "--output-dir", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"prepare_data.py: error: {bad}:3: bad preference record: the fields mix formats")
    assert err.endswith("fix that record or remove it from the input") and "\n" not in err
    assert not (tmp_path / "o2").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    mixed = write_jsonl(tmp_path / "mixed.jsonl", [pairs[1], {"messages": [*PROMPT, GOOD]}])
    assert prepare_main(["--input", str(mixed), "--output-dir", str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert (
        f"mix preference records (the first at {mixed}:1) with text or chat records (the first at {mixed}:2)"
        in err
    )
    assert not (tmp_path / "o3").exists()


def test_a_bad_pair_deep_in_a_split_file_is_refused_at_its_line_whatever_the_workers(tmp_path):
    pref = load_script("make_preference_data")
    lines = [json.dumps(r) for r in pref.generate(60, seed=3)]
    lines[47] = json.dumps({"prompt": PROMPT, "chosen": [GOOD]})
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    for workers in (1, 3):
        with pytest.raises(
            DataError, match=rf"^{re.escape(str(path))}:48: bad preference record: missing field 'rejected'"
        ):
            prepare(
                [str(path)],
                tmp_path / f"o{workers}",
                2,
                workers=workers,
                unit_bytes=4096,
                progress_stream=io.StringIO(),
            )


def test_bundled_sample_is_what_the_documented_commands_write(tmp_path):
    readme = (REPO / "data" / "README.md").read_text()
    assert GENERATE in readme and PREPARE in readme
    pref = load_script("make_preference_data")
    jsonl = write_jsonl(tmp_path / "preference_sample.jsonl", list(pref.generate(320, seed=0)))
    summary = prepare([str(jsonl)], tmp_path / "out", 2, prefix="pref", progress_stream=io.StringIO())
    assert shard_records(tmp_path / "out") == shard_records(SAMPLE)
    info = json.loads((SAMPLE / "dataset_info.json").read_text())
    assert info["records"] == summary.records == 320 and info["shards"] == summary.shards
    assert sorted(p.name for p in SAMPLE.iterdir()) == ["dataset_info.json", *summary.shards]
    where, first = next(read_records(str(SAMPLE / summary.shards[0])))
    assert set(first) == {"prompt", "chosen", "rejected"}


def test_bundled_sample_is_small_and_fits_the_bundled_tokenizer():
    assert sum(p.stat().st_size for p in SAMPLE.iterdir()) < 450_000
    tok = Tokenizer(TOKENIZER)
    records = shard_records(SAMPLE)
    assert len(records) == 320 and all(reply(r, "chosen") != reply(r, "rejected") for r in records)
    unknown = tok.token_id("<unk>")
    assert not [r for r in records[:20] if unknown in tok.encode(reply(r, "chosen") + reply(r, "rejected"))]


def test_a_tokenizer_trains_on_preference_pairs(tmp_path):
    pref = load_script("make_preference_data")
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [*pref.generate(60, seed=2), {"prompt": "a", "chosen": "b", "rejected": "c"}]
    )
    model = tmp_path / "tok.model"
    assert (
        load_script("train_tokenizer").main(["--input", str(pairs), "--output", str(model), "--vocab-size", "400"])
        == 0
    )
    tok = Tokenizer(model)
    assert tok.vocab_size == 400 and tok.im_start_id is not None


def test_parquet_preference_pairs_round_trip(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # optional: without it Parquet is refused (test_prepare_data.py checks how)
        return

    pairs = [{"prompt": PROMPT, "chosen": [GOOD], "rejected": [BAD]}] * 2
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "p.parquet")
    summary = prepare([str(tmp_path / "p.parquet")], tmp_path / "out", 1, progress_stream=io.StringIO())
    assert summary.records == 2 and shard_records(tmp_path / "out") == pairs
