"""log_format=json: every line a run writes is a JSON object with its severity (Cloud Logging's names), INFO
on stdout and WARNING on stderr, carrying the event's fields and the run's identity; the STATUS line stays."""

from __future__ import annotations

import io
import json
import logging

from tests.cli_harness import run_cli
from trainer.observe import console


def _parsed(stream: str) -> list[dict]:
    lines = [l for l in stream.splitlines() if l.strip() and not l.startswith("STATUS: ")]
    out = []
    for line in lines:
        obj = json.loads(line)  # every line but STATUS is one JSON object
        assert isinstance(obj, dict) and obj["severity"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), line
        out.append(obj)
    return out


def test_a_json_run_writes_only_json_lines_info_on_stdout_warnings_on_stderr(tmp_path):
    proc = run_cli(
        tmp_path,
        "run",
        "steps=6",
        "log_format=json",
        "fault_schedule=step=3,nan=1",
        "nan_policy=skip_step",
        devices=1,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("STATUS: finished step=6")
    out, err = _parsed(proc.stdout), _parsed(proc.stderr)
    assert {o["severity"] for o in out} == {"INFO"} and {o["severity"] for o in err} == {"WARNING"}
    (nonfinite,) = [o for o in err if o.get("event") == "nonfinite_step"]
    assert (
        nonfinite["step"] == 3 and nonfinite["policy"] == "skip_step" and nonfinite["message"].startswith("step 3")
    )
    (saved,) = [o for o in out if o.get("event") == "checkpoint_save_committed"]
    assert saved["step"] == 6 and saved["message"].startswith("saved step 6 (")
    assert saved["run_name"] == "run" and saved["process_index"] == 0 and saved["attempt"] == 1
    assert isinstance(saved["pid"], int) and saved["time"].endswith("Z")
    (goodput,) = [o for o in out if o.get("event") == "goodput"]
    assert isinstance(goodput["badput_s"], dict) and goodput["badput_s"]["startup_compile"] > 0
    assert any(o["message"].startswith("run_dir=") for o in out)


def test_a_bad_log_format_exits_2_naming_the_choices(tmp_path):
    proc = run_cli(tmp_path, "run", "steps=1", "log_format=xml", devices=1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "log_format='xml' is not one of" in proc.stderr and proc.stdout.strip() == "STATUS: config_error"


def test_json_severity_names_and_values_json_has_no_name_for():
    out, err = io.StringIO(), io.StringIO()
    console.setup("json", stdout=out, stderr=err)
    try:
        log = logging.getLogger("t.json")
        log.info("a", extra={console.FIELDS: {"loss": float("nan")}})
        log.critical("b")
    finally:
        console.setup("text", stderr=io.StringIO())
    (info,), (crit,) = _parsed(out.getvalue()), _parsed(err.getvalue())
    assert info["severity"] == "INFO" and info["loss"] == "nan" and crit["severity"] == "CRITICAL"


def test_log_lines_of_every_layer_carry_their_event_sentence_kv_and_json(tmp_path):
    """A module below the event log (here a JSONL file's torn last line, trainer.io) logs an event the
    same three ways: a sentence (text), `event=NAME key=value` (kv), fields as JSON keys (json)."""
    from trainer.io.jsonl import repair_tail

    shown = {}
    for fmt in console.FORMATS:
        path = tmp_path / f"{fmt}.jsonl"
        path.write_bytes(b'{"step": 1}\n{"step": 2, "lo')
        err = io.StringIO()
        console.setup(fmt, stdout=io.StringIO(), stderr=err)
        try:
            assert repair_tail(path) > 0
        finally:
            console.setup("text")
        shown[fmt] = err.getvalue().strip().splitlines()[-1]
    assert "removed a torn last line" in shown["text"] and "event=" not in shown["text"]
    assert "event=jsonl_torn_tail_removed file=" in shown["kv"] and " bytes=" in shown["kv"]
    obj = json.loads(shown["json"])
    assert obj["event"] == "jsonl_torn_tail_removed" and obj["severity"] == "WARNING"
    assert obj["file"].endswith("json.jsonl") and obj["bytes"] > 0 and obj["message"].startswith("removed a torn")


def test_a_hangs_stacks_are_one_json_object_and_kept_in_the_run_directory(tmp_path):
    from trainer.process.watchdog import Hang
    from trainer.process_root import _dump_stacks

    err = io.StringIO()
    console.setup("json", stdout=io.StringIO(), stderr=err)
    try:
        path = _dump_stacks(Hang(phase="steps", step=7, seconds=5.2, timeout_s=5.0), tmp_path / "hangs" / "1.txt")
    finally:
        console.setup("text")
    (line,) = err.getvalue().strip().splitlines()  # the whole dump is one line: one log entry
    obj = json.loads(line)
    assert obj["event"] == "hang_stacks" and obj["severity"] == "ERROR" and obj["step"] == 7
    assert (
        obj["path"] == str(path)
        and "thread 0x" in obj["message"].lower()
        and "test_a_hangs_stacks" in obj["message"]
    )
    assert "test_a_hangs_stacks" in path.read_text()


def test_no_log_call_in_the_trainer_writes_key_value_text_of_its_own():
    """`event=` lines are the kv format's to write, from an event's fields (trainer.logevents): a message
    that spells them out shows as raw key=value text to a person and as an unstructured string in JSON."""
    import ast
    from pathlib import Path

    found = []
    for path in (Path(__file__).resolve().parents[1] / "trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                first = node.args[0]
                if (
                    isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                    and first.value.startswith("event=")
                ):
                    found.append(f"{path.name}:{node.lineno}")
    assert not found, f"log calls that write event= text themselves: {found}"
