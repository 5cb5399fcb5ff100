"""The console for people (trainer/observe/console.py): every event once, as a sentence, no Python reprs;
at a terminal the progress line stays below the log lines; log_format=kv keeps the grep-friendly form."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import time

import pytest

from tests.cli_harness import cli_env, command, run_cli
from trainer.config import ConfigError, load_config
from trainer.logevents import event_extra
from trainer.observe import catalogue, console
from trainer.observe.events import read_events
from trainer.observe.sinks import ProgressSink

SAMPLES = {  # a value of each shape a field can have
    "badput_s": {"startup_compile": 14.7, "checkpoint_save": 0.06, "other": 0},
    "slices": [0, 1],
    "argv": ["base.yml", "steps=6"],
    "costs": {"save_s": 0.9, "restore_s": 1.5},
    "goodput": 0.876,
}


@pytest.fixture(autouse=True)
def _console_restored():
    yield
    console.setup("text", stderr=io.StringIO())  # no handler left on a stream of an ended test


@pytest.mark.parametrize("event", [*catalogue.ALL, *catalogue.LAUNCHER], ids=str)
def test_every_catalogued_event_renders_as_a_sentence_without_reprs(event):
    fields = {f: SAMPLES.get(f, 3 if "step" in f else 1.5 if f.endswith("_s") else f"<{f}>") for f in event.fields}
    for given in (fields, {}):  # the fields it has, or none at all (never raises)
        text = console.describe(event, given)
        assert text and "{'" not in text and "['" not in text and "\n" not in text, text
    kv = " ".join(console.kv_pairs(fields))
    assert "{" not in kv and "[" not in kv, kv


def test_sentences_name_what_happened_in_words():
    assert console.describe(catalogue.GOODPUT, {**SAMPLES, "wall_s": 120.0}) == (
        "goodput 87.6% of 120 s (startup 14.7 s, saves 0.1 s)"
    )
    assert console.describe(catalogue.CHECKPOINT_SAVE_COMMITTED, {"step": 50, "seconds": 0.91, "bytes": 2e6}) == (
        "saved step 50 (0.9 s, 2.0 MB)"
    )
    # no sentence of its own: the name in words and the fields
    assert console.describe(catalogue.SNAPSHOT_STARTED, {"step": 4, "persist": True}) == (
        "snapshot started: step 4, persist True"
    )
    assert console.describe("made_up", {"costs": {"save_s": 0.9}, "slices": [0, 1], "none": None}) == (
        "made up: costs save_s 0.9, slices 0,1, none none"
    )


def _record(event, **fields):
    return logging.LogRecord(
        "t", console.severity(event), __file__, 1, "%s", (console.describe(event, fields),), None
    )


def test_kv_lines_flatten_mappings_and_join_sequences():
    record = _record(catalogue.GOODPUT)
    record.__dict__.update(event_extra(catalogue.GOODPUT, {"goodput": 0.5, **SAMPLES}))
    line = console.KvFormatter().format(record)
    assert "event=goodput goodput=0.876 badput_s.startup_compile=14.7 " in line and "{" not in line, line


def test_bad_log_format_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"log_format='xml' is not one of .*text.*kv.*json"):
        load_config("base.yml", ["log_format=xml"])


def test_json_console_logs_steps_instead_of_redrawing_a_line():
    out, err = io.StringIO(), io.StringIO()
    console.setup("json", stdout=out, stderr=err)
    sink = ProgressSink(total_steps=4, stream=err, period=2)
    for step in (1, 2):
        sink.write({"step": step, "loss": 3.0, "learning_rate": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1,
                    "tokens_per_s": 10.0, "tflops_per_device": 0.0, "mfu": None})  # fmt: skip
    assert err.getvalue() == "" and '"step":2' in out.getvalue() and '"step":1' not in out.getvalue()


def test_the_progress_line_counts_down_to_the_next_save_when_the_period_is_known():
    term = io.StringIO()
    sink = ProgressSink(total_steps=20, stream=term, save_period=5)
    sink.write({"step": 3, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 2.0})
    assert term.getvalue().endswith("ETA 0:00:34  save in 0:00:04")


def test_the_progress_line_takes_the_period_the_planner_chooses_and_no_other_sinks():
    term = io.StringIO()
    sink = ProgressSink(total_steps=20, stream=term)  # checkpoint_period=auto: nothing to count down to yet
    sink.write({"step": 3, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 2.0})
    assert term.getvalue().endswith("ETA 0:00:34")
    sink.on_event({"event": "periods_planned", "checkpoint_period": 8})
    sink.on_event({"event": "checkpoint_save_start", "checkpoint_period": 2})  # not a plan: ignored
    sink.write({"step": 4, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 2.0})
    assert term.getvalue().endswith("ETA 0:00:32  save in 0:00:08")
    other = io.StringIO()  # another sink of the same process starts with no period of its own
    ProgressSink(total_steps=20, stream=other).write(
        {"step": 3, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 2.0}
    )
    assert other.getvalue().endswith("ETA 0:00:34")


# ---- the CLI --------------------------------------------------------------------------------------------


def test_a_run_off_a_terminal_prints_each_event_once_in_words_without_reprs_or_control_codes(tmp_path):
    proc = run_cli(tmp_path, "run", "steps=6", "checkpoint_period=3", devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "{'" not in out and "['" not in out and "\x1b" not in out and "\r" not in out, out
    assert "event=" not in out  # the key=value form is log_format=kv's
    events = read_events(tmp_path / "run" / "events.jsonl")
    for e in events:  # each event's sentence as many times as the event happened
        said = console.describe(e["event"], _fields(e))
        assert proc.stderr.count(said) == sum(console.describe(o["event"], _fields(o)) == said for o in events), (
            said,
            proc.stderr,
        )
    said_by_events = {console.describe(e["event"], _fields(e)) for e in events}
    names = re.compile(r"\b(" + "|".join(map(re.escape, catalogue.NAMES)) + r")\b")
    for line in proc.stderr.splitlines():
        text = re.sub(r"^\d\d:\d\d:\d\d (WARNING |ERROR )?", "", line)
        if text not in said_by_events:  # any other line says no event again, in another form
            assert not names.search(text) and "=[" not in text and "=(" not in text, line
    assert "saved step 6 (" in proc.stderr and "goodput " in proc.stderr
    assert re.search(r"^\d\d:\d\d:\d\d step=6 loss=", proc.stderr, re.M), proc.stderr  # plain metrics lines
    assert proc.stdout.splitlines()[-1].startswith("STATUS: finished")


def _fields(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in ("event", "time", "pid")}


def test_log_format_kv_keeps_the_grep_friendly_lines(tmp_path):
    proc = run_cli(tmp_path, "run", "steps=2", "log_format=kv", devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "event=checkpoint_save_committed step=2 " in proc.stderr
    assert re.search(
        r"event=goodput goodput=\S+ wall_s=\S+ productive_s=\S+ badput_s\.startup_compile=", proc.stderr
    )
    assert "{'" not in proc.stderr and "event=attempt_start attempt=1 slices=0 " in proc.stderr


class Screen:
    """Enough of a terminal to replay the console's bytes: text, \\r, \\n, erase line, cursor up/down."""

    def __init__(self):
        self.rows: list[list[str]] = [[]]
        self.row = self.col = 0

    def feed(self, text: str) -> None:
        for m in re.finditer(r"\x1b\[([0-9;?]*)([A-Za-z])|\r|\n|[^\x1b\r\n]", text):
            token = m.group(0)
            if token == "\r":
                self.col = 0
            elif token == "\n":
                self.row += 1
                self.col = 0
                while len(self.rows) <= self.row:
                    self.rows.append([])
            elif m.group(2) == "K":
                self.rows[self.row] = [] if m.group(1) in ("2",) else self.rows[self.row][: self.col]
            elif m.group(2) == "A":
                self.row = max(self.row - int(m.group(1) or 1), 0)
            elif m.group(2) == "B":
                self.row += int(m.group(1) or 1)
                while len(self.rows) <= self.row:
                    self.rows.append([])
            elif m.group(2):  # colours, cursor visibility: nothing on the screen
                continue
            else:
                line = self.rows[self.row]
                line.extend(" " * (self.col - len(line)))
                line[self.col : self.col + 1] = [token]
                self.col += 1

    def lines(self) -> list[str]:
        return ["".join(r).rstrip() for r in self.rows]


def test_at_a_terminal_log_lines_never_break_the_progress_line(tmp_path):
    argv = command(tmp_path, "run", "steps=6", "checkpoint_period=2")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the trainer on the pseudo-terminal
        os.execve(argv[0], argv, cli_env(1))
    raw, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        raw += chunk
    _, status = os.waitpid(pid, 0)
    text = raw.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text[-3000:]
    screen = Screen()
    screen.feed(text)
    lines = [l for l in screen.lines() if l.strip()]
    progress = re.compile(r"^step \d+/6  loss \S+  \S+ tokens/s  ETA \d+:\d\d:\d\d(  save in \d+:\d\d:\d\d)?$")
    logged = re.compile(r"^(\d\d:\d\d:\d\d| {8}) (INFO|WARNING|ERROR) ")
    assert any(progress.match(l) for l in lines), lines  # the live line was drawn (and its last text stays)
    assert re.search(r"step 1/6  loss .* save in \d+:\d\d:\d\d", text), text  # counting down to step 2's save
    for line in lines:
        if re.search(r"step \d+/6  loss", line):
            assert progress.match(line), f"the progress line was broken: {line!r}"
        assert not re.search(r"\S.*\b(INFO|WARNING|ERROR) ", line) or logged.match(line), (
            f"a log line not at column 0 of its own line: {line!r}"
        )
    saved = [l for l in lines if "saved step 2 (" in l]
    assert len(saved) == 1 and logged.match(saved[0]), lines
    assert lines[-1].startswith("STATUS: finished"), lines
