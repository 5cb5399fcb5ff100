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
