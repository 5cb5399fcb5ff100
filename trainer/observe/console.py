"""What a run shows on its console: log lines and events as sentences, `key=value` lines or JSON objects.

`setup(log_format)` installs one root logging handler for the whole process (`log_format`, a config key):

- `text` (the default): each event once, as the sentence `describe` gives it; warnings and errors marked.
  At a terminal the lines go through one `rich` Console, and `status_line()` is a live line kept below
  them (`trainer.observe.sinks.ProgressSink` draws the progress there), never written through. Not at a
  terminal (a pipe, a file, CI): plain lines, no control codes.
- `kv`: `event=NAME key=value ...` lines, grep-friendly (the form events.jsonl's readers know).
- `json`: one JSON object per line (`severity` in Cloud Logging's names, `message`, `time`, `logger`, the
  event's name and fields, the run's identity: `run_name`, `process_index`, `pid`, `attempt`). INFO and
  below on stdout, WARNING and above on stderr.

`EventLog.emit` logs each event with `trainer.logevents.event_extra(name, fields)`, as any module may log
one; these handlers read it from the record.
Values are rendered without Python reprs: a list as `a,b`, a mapping flattened to `key.sub=value` (kv) or
to words (text). The final `STATUS:` line is not a log record: it stays as `print_status` writes it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from trainer.logevents import EVENT, FIELDS
from trainer.observe import catalogue as ev

FORMATS = ("text", "kv", "json")

# Events a person should not miss: logged as WARNING (the rest INFO).
WARNINGS = frozenset(
    {
        ev.CHECKPOINT_SAVE_FAILED,
        ev.CHECKPOINT_SAVE_FENCED,
        ev.CHECKPOINT_RESTORE_FAILED,
        ev.CHECKPOINT_SET_ASIDE,
        ev.LOCAL_CHECKPOINT_SAVE_FAILED,
        ev.LOCAL_CHECKPOINT_SKIPPED,
        ev.SNAPSHOT_SKIPPED,
        ev.NONFINITE_STEP,
        ev.SLICE_KILLED,
        ev.HOST_STALLED,
        ev.HANG_INJECTED,
        ev.NAN_INJECTED,
        ev.SPIKE_INJECTED,
        ev.FAULT_INJECTED,
        ev.SDC_INJECTED,
        ev.SLICE_DOWN_DETECTED,
        ev.ROLLBACK,
        ev.LOSS_SPIKE_ROLLBACK,
        ev.SDC_DETECTED,
        ev.SDC_QUARANTINED,
        ev.SLOW_STEP,
        ev.WANDB_UNAVAILABLE,
        ev.LOAD_PATH_UNUSED,
        ev.CHECKPOINT_PARTIAL_REMOVED,
        ev.CHECKPOINT_FOREIGN_STEP,
    }
)
ERRORS = frozenset({ev.FATAL_ERROR, ev.HANG_DETECTED, ev.WAIT_TIMEOUT, ev.SDC_PERSISTS})


def severity(event: str) -> int:
    """The logging level an event is logged at."""
    return logging.ERROR if event in ERRORS else logging.WARNING if event in WARNINGS else logging.INFO


# ---- values, without Python reprs ---------------------------------------------------------------------------


def _value(v: Any) -> str:
    if isinstance(v, float):
        return format(v, ".6g")
    if isinstance(v, (list, tuple, set, frozenset)):
        return ",".join(_value(x) for x in v)
    if isinstance(v, Mapping):
        return ", ".join(f"{k} {_value(x)}" for k, x in v.items())
    return "none" if v is None else str(v)


def _s(v: Any) -> str:
    """Seconds as `0.9 s`."""
    return "? s" if not isinstance(v, (int, float)) else f"{v:.1f} s" if v < 100 else f"{v:.0f} s"


def _bytes(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "? B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(v) < 1000 or unit == "TB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return ""


def kv_pairs(fields: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`key=value` words: a mapping flattened to `key.sub=value`, a sequence as `a,b`."""
    out = []
    for k, v in fields.items():
        if isinstance(v, Mapping) and v:
            out += kv_pairs(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={_value(v) if not isinstance(v, str) else v}")
    return out


# ---- the sentences --------------------------------------------------------------------------------------

_BADPUT_WORDS = {
    "startup_compile": "startup",
    "checkpoint_save": "saves",
    "restore": "restores",
    "wasted_progress": "lost steps",
    "waiting_for_slices": "waiting for slices",
    "eval": "eval",
    "sdc_check": "SDC checks",
    "rollback": "rollbacks",
    "hang": "hangs",
    "other": "other",
}


def _goodput(f: Mapping[str, Any]) -> str:
    g = f.get("goodput")
    head = "goodput unknown" if g is None else f"goodput {100 * g:.1f}%"
    badput = f.get("badput_s") or {}
    parts = [f"{_BADPUT_WORDS.get(k, k)} {_s(v)}" for k, v in badput.items() if isinstance(v, (int, float)) and v]
    return f"{head} of {_s(f.get('wall_s'))}" + (f" ({', '.join(parts)})" if parts else "")


SENTENCES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    ev.START: lambda f: (
        f"started run {f['run_name']} ({f['model']}, {f['steps']} steps, "
        + ("new run)" if f.get("resume_step") is None else f"resuming from step {f['resume_step']})")
    ),
    ev.LEASE_ACQUIRED: lambda f: (
        f"holding the run directory (lease generation {f['generation']})"
        + (f", taken over from {f['previous_owner']}" if f.get("taken_over") else "")
    ),
    ev.LOAD_PATH_UNUSED: lambda f: (
        f"{f['key']}={f['path']} is not read: the run resumes from step {f['resume_step']}"
    ),
    ev.GOODPUT: _goodput,
    ev.FINISH: lambda f: (
        f"process ended: {f['status']} (exit code {f['exit_code']})"
        + (f" at step {f['step']}" if f.get("step") is not None else "")
        + (f": {f['error']}" if f.get("error") else "")
    ),
    ev.COMPILE_DONE: lambda f: f"compiled the train step for {f['devices']} device(s) in {_s(f['seconds'])}",
    ev.COMPILE_AHEAD: lambda f: f"compiled ahead for {f['devices']} device(s) in {_s(f['seconds'])}",
    ev.COMPILE_CACHED: lambda f: f"reusing the steps compiled for {f['devices']} device(s)",
    ev.RESTORE_START: lambda f: "building the train state",
    ev.RESTORE_END: lambda f: f"train state ready from {f['source']} in {_s(f['seconds'])} ({_bytes(f['bytes'])})",
    ev.CHECKPOINT_SAVE_START: lambda f: f"saving step {f['step']}",
    ev.CHECKPOINT_SAVE_BLOCKED: lambda f: f"the save of step {f['step']} held training for {_s(f['seconds'])}",
    ev.CHECKPOINT_SAVE_COMMITTED: lambda f: f"saved step {f['step']} ({_s(f['seconds'])}, {_bytes(f['bytes'])})",
    ev.CHECKPOINT_SAVE_FAILED: lambda f: f"the save of step {f['step']} failed: {f['error']}",
    ev.CHECKPOINT_SAVE_FENCED: lambda f: f"the save of step {f['step']} was refused: {f['error']}",
    ev.CHECKPOINT_RESTORE_START: lambda f: f"restoring step {f['step']}",
    ev.CHECKPOINT_RESTORE_DONE: lambda f: f"restored step {f['step']} ({_s(f['seconds'])}, {_bytes(f['bytes'])})",
    ev.CHECKPOINT_RESTORE_FAILED: lambda f: f"the restore of step {f['step']} failed: {f['error']}",
    ev.TARGET_EVAL_LOSS_REACHED: lambda f: (
        f"eval loss {_value(f['eval_loss'])} reached the target at step {f['step']}"
    ),
    ev.PREEMPTED: lambda f: f"stop requested: saved step {f['step']} and stopping",
    ev.NONFINITE_STEP: lambda f: (
        f"step {f['step']} was not finite (loss {_value(f['loss'])}); nan_policy {f['policy']}"
    ),
    ev.ATTEMPT_START: lambda f: (
        f"attempt {f['attempt']} trains from step {f['start_step']} on slice(s) "
        f"{_value(f['slices'])} (from {f['source']}, global batch {f['global_batch_size']})"
    ),
    ev.RESTART_RESUMED: lambda f: (
        f"resumed at step {f['start_step']} from {f['source']} "
        f"(had trained to {f['last_step']}, {f['steps_lost']} steps lost)"
    ),
    ev.SLICE_DOWN_DETECTED: lambda f: (
        f"attempt {f['attempt']} lost slice(s) after step {f['last_step']}: {f['error']}"
    ),
    ev.FATAL_ERROR: lambda f: f"fatal error: {f['error']}",
    ev.HANG_DETECTED: lambda f: (
        f"no progress in {f['phase']} for {_s(f['seconds'])} after step {f['step']}: "
        "exiting 75 (rerun the same command)"
    ),
    ev.ROLLBACK: lambda f: f"rolling back from step {f['step']}" + (f" ({f['cause']})" if f.get("cause") else ""),
    ev.ELASTIC_SUMMARY: lambda f: (
        f"{f['failures']} failure(s), {f['steps_lost']} steps lost, {_s(f['downtime_s'])} down"
    ),
    ev.SLOW_STEP: lambda f: f"step {f['step']} took {_s(f['step_time_s'])}, {_value(f['factor'])}x the median",
    ev.WANDB_UNAVAILABLE: lambda f: (
        f"W&B unavailable during {f['during']}: {f['error']}; training goes on without it (metrics.jsonl and "
        "TensorBoard have every row; a later start of this run logs to W&B again)"
    ),
    ev.CONTROL_REQUEST: lambda f: (
        f"control request {f['action']!r} accepted"
        if f["accepted"]
        else f"control request {f['action']!r} refused ({f['status']}): {f['reason']}"
    ),
    ev.CONTROL_APPLIED: lambda f: f"control: {f['action']} (requested over the control endpoint)",
    ev.PERIODS_PLANNED: lambda f: (
        f"planned periods at step {f['step']}: snapshot {f['snapshot_period']}, "
        f"local {f['local_checkpoint_period']}, checkpoint {f['checkpoint_period']} ({f['mode']})"
    ),
}


def describe(event: str, fields: Mapping[str, Any]) -> str:
    """The sentence a person reads for an event: its own (SENTENCES), else its name (spaces for
    underscores) and its fields as `key value` words; never raises on missing fields."""
    words = SENTENCES.get(event)
    if words is not None:
        try:
            return words(fields)
        except (KeyError, TypeError, ValueError):
            pass
    pairs = [f"{k} {_value(v)}" for k, v in fields.items()]
    return str(event).replace("_", " ") + (": " + ", ".join(pairs) if pairs else "")


# ---- the run's identity (json) and the live line ----------------------------------------------------------

_identity: dict[str, Any] = {}
_format = "text"


def current_format() -> str:
    """The log_format the console was last set up with."""
    return _format


def identify(**fields: Any) -> None:
    """The run's identity, added to every JSON line: run_name, process_index (set once they are known)."""
    _identity.update(fields)


class StatusLine:
    """The live line below the log lines at a terminal (`text` format): `update(text)` redraws it."""

    def __init__(self, live):
        self._live = live
        self._lock = threading.Lock()

    def update(self, text: str) -> None:
        from rich.text import Text

        with self._lock:
            self._live.update(Text(text, style="bold"), refresh=True)

    def stop(self) -> None:
        with self._lock:
            self._live.stop()


_status: StatusLine | None = None


def status_line() -> StatusLine | None:
    """The live line, when the console is a terminal in `text` format (started on first use); else None."""
    global _status
    console = _rich_console
    if console is None:
        return None
    if _status is None:
        from rich.live import Live

        live = Live(
            console=console, auto_refresh=False, transient=False, redirect_stdout=True, redirect_stderr=True
        )
        live.start()
        _status = StatusLine(live)
    return _status


def stop_status_line() -> None:
    """Stop redrawing the live line (its last text stays, lines printed later go below it)."""
    global _status
    if _status is not None:
        _status.stop()
        _status = None


# ---- the handlers ------------------------------------------------------------------------------------------


class KvFormatter(logging.Formatter):
    """`time LEVEL logger] event=NAME key=value ...` for events, the message for other records."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s] %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        event = getattr(record, EVENT, None)
        if event is not None:
            record.message = " ".join([f"event={event}", *kv_pairs(getattr(record, FIELDS, {}))])
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: severity, message, time, logger, event and fields, the run's identity."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "severity": record.levelname if record.levelname != "FATAL" else "CRITICAL",
            "message": record.getMessage(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "logger": record.name,
            **_identity,
            "pid": record.process,
        }
        event = getattr(record, EVENT, None)
        if event is not None:
            out["event"] = event
        out.update({k: v for k, v in getattr(record, FIELDS, {}).items() if k not in out})
        if record.exc_info:
            out["message"] += "\n" + self.formatException(record.exc_info)
        return json.dumps(_finite(out), default=str, separators=(",", ":"))


def _finite(v: Any) -> Any:
    """NaN and infinities as strings (JSON has none)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, Mapping):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


class _Watch(logging.Filter):
    """Keeps the run's `attempt` (identity) current from the events that pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        event, fields = getattr(record, EVENT, None), getattr(record, FIELDS, {})
        if event == ev.ATTEMPT_START:
            _identity["attempt"] = fields.get("attempt")
        return True


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _PlainFormatter(logging.Formatter):
    """`time LEVEL message` (level only for warnings and errors) for `text` off a terminal."""

    def __init__(self):
        super().__init__(datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        level = f" {record.levelname}" if record.levelno >= logging.WARNING else ""
        text = f"{self.formatTime(record, self.datefmt)}{level} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


_rich_console = None


def setup(log_format: str = "text", *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
    """Replace the root logger's handlers with the console for `log_format` (one of FORMATS); INFO and up.
    Called again (the config's value, once it is read) it replaces what an earlier call installed."""
    global _rich_console, _format
    if log_format not in FORMATS:
        raise ValueError(f"log_format={log_format!r}: use one of {', '.join(FORMATS)}")
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    stop_status_line()
    _rich_console = None
    if log_format == "json":
        low, high = logging.StreamHandler(stdout), logging.StreamHandler(stderr)
        low.addFilter(_Below(logging.WARNING))
        high.setLevel(logging.WARNING)
        handlers = [low, high]
        for h in handlers:
            h.setFormatter(JsonFormatter())
        logging.captureWarnings(True)
    elif log_format == "kv":
        handlers = [logging.StreamHandler(stderr)]
        handlers[0].setFormatter(KvFormatter())
    elif _is_terminal(stderr):
        from rich.console import Console
        from rich.logging import RichHandler

        _rich_console = Console(file=stderr)
        handlers = [RichHandler(console=_rich_console, show_path=False, markup=False, rich_tracebacks=False)]
        handlers[0].setFormatter(logging.Formatter("%(message)s", datefmt="%H:%M:%S"))
    else:
        handlers = [logging.StreamHandler(stderr)]
        handlers[0].setFormatter(_PlainFormatter())
    for h in handlers:
        h.addFilter(_Watch())
    _format = log_format
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
