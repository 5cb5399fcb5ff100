"""Append-only logs survive a process killed mid-write: a torn last line never stops a resume or a reader."""

import json
import random
import subprocess
import sys

import pytest
from cli_harness import cli_env, command

from trainer.io.jsonl import LineCounter, open_append, parse_lines, read_jsonl, read_jsonl_ends, repair_tail

RECORDS = [
    {"step": 1, "loss": 2.5, "note": "é"},
    {"step": 2, "loss": 2.25},
    {"event": "x", "nested": {"a": [1, 2]}},
]


def _text() -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in RECORDS).encode()


@pytest.mark.parametrize("cut", range(1, len(json.dumps(RECORDS[-1], ensure_ascii=False).encode()) + 1))
def test_every_cut_of_the_last_line_is_skipped_by_readers_and_removed_before_the_next_append(tmp_path, cut):
    data = _text()[:-cut]  # the last record torn `cut` bytes before its end (its newline included)
    path = tmp_path / "m.jsonl"
    path.write_bytes(data)
    complete = RECORDS if cut == 1 else RECORDS[:-1]  # cut == 1 only loses the newline
    assert read_jsonl(path) == complete
    with open_append(path) as f:
        f.write(json.dumps({"step": 3}) + "\n")
    assert read_jsonl(path) == [*complete, {"step": 3}]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_a_corrupt_line_in_the_middle_is_skipped_and_counted(caplog):
    assert parse_lines('{"a": 1}\n{"b": \n[1, 2]\n{"c": 3}\n', source="x") == [{"a": 1}, {"c": 3}]
    (record,) = [r for r in caplog.records if getattr(r, "trainer_event", None) == "jsonl_skipped"]
    assert record.trainer_fields == {"file": "x", "lines": 2} and "skipped 2 torn or corrupt lines" in caplog.text


def test_repair_leaves_a_clean_file_alone(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(_text())
    assert repair_tail(path) == 0 and path.read_bytes() == _text()


def test_reading_the_ends_of_a_long_log_keeps_whole_lines_of_its_start_and_its_recent_past(tmp_path):
    path = tmp_path / "events.jsonl"
    rows = [{"event": "e", "i": i, "pad": "x" * (i % 7)} for i in range(2000)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ends = read_jsonl_ends(path, head_bytes=1000, tail_bytes=3000)
    head = [r for r in ends if r["i"] < 1000]
    tail = [r for r in ends if r["i"] >= 1000]
    assert head == rows[: len(head)] and tail == rows[-len(tail) :]  # whole records, in order, none twice
    assert 10 < len(head) < 40 and 50 < len(tail) < 150
    assert read_jsonl_ends(path, head_bytes=1 << 20, tail_bytes=1) == rows  # small enough: the whole file
    assert read_jsonl_ends(tmp_path / "missing.jsonl", head_bytes=10, tail_bytes=10) == []


def test_a_line_counter_reads_only_what_was_appended_and_waits_for_a_line_being_written(tmp_path):
    path = tmp_path / "events.jsonl"
    count = LineCounter(path, lambda r: r.get("event") == "down")
    assert count() == 0  # no file yet
    path.write_text('{"event": "down"}\n{"event": "up"}\n{"event": "do')
    assert count() == 1
    with open(path, "a") as f:
        f.write('wn"}\n{"event": "down"}\n')
    assert count() == 3 and count.offset == path.stat().st_size


@pytest.mark.slow
def test_a_resume_and_the_report_work_after_the_logs_were_cut_at_random_offsets(tmp_path):
    rng = random.Random(7)
    first = subprocess.run(
        command(tmp_path, "torn", "steps=2"), capture_output=True, text=True, env=cli_env(1), timeout=300
    )
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "torn"
    for name in ("metrics.jsonl", "events.jsonl"):
        data = (run_dir / name).read_bytes()
        last = data.rstrip(b"\n").rfind(b"\n") + 1
        (run_dir / name).write_bytes(data[: rng.randrange(last + 1, len(data) - 1)])
    for steps in (3, 4):
        resumed = subprocess.run(
            command(tmp_path, "torn", f"steps={steps}"),
            capture_output=True,
            text=True,
            env=cli_env(1),
            timeout=300,
        )
        assert resumed.returncode == 0 and f"STATUS: finished step={steps}" in resumed.stdout, resumed.stderr[
            -3000:
        ]
    steps_seen = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps_seen[-2:] == [3, 4] and all(
        json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()
    )
    assert [e["event"] for e in read_jsonl(run_dir / "events.jsonl")].count("finish") >= 2
    report = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(run_dir), "-o", str(tmp_path / "r.png")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-3000:]
