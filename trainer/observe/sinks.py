"""Where step metrics go: metrics.jsonl, TensorBoard, the log. One interface, swappable sinks."""

from __future__ import annotations

import collections
import logging
import math
import statistics
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

from trainer.io.jsonl import dumps, open_append
from trainer.observe import catalogue as ev
from trainer.observe import console
from trainer.observe.records import is_eval

log = logging.getLogger("trainer.metrics")


class MetricSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """metrics.jsonl: one JSON object per step (and per evaluation: trainer.observe.records), flushed per
    line so a killed run keeps its history."""

    def __init__(self, path: Path):
        self._file = open_append(path)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(dumps(record))

    def close(self) -> None:
        self._file.close()


class RecordedSteps:
    """Which step's row metrics.jsonl holds last, for writers that must not get ahead of it: the local
    checkpoint tier commits a step only once its row is written, so a restored step always has its
    record. Placed after the JSONL sink, whose write is flushed. One attempt at a time: `begin` resets it
    (a rewind trains steps again), `end` releases writers still waiting for a row that never comes."""

    def __init__(self):
        self._cond = threading.Condition()
        self._step = -1
        self._open = True

    def write(self, record: dict[str, Any]) -> None:
        if is_eval(record):
            return
        with self._cond:
            self._step = max(self._step, int(record["step"]))
            self._cond.notify_all()

    def close(self) -> None:
        self.end()

    def begin(self) -> None:
        with self._cond:
            self._step, self._open = -1, True

    def end(self) -> None:
        with self._cond:
            self._open = False
            self._cond.notify_all()

    def has(self, step: int) -> bool:
        """Whether step `step`'s row is written (now, without waiting)."""
        with self._cond:
            return self._step >= step

    def wait(self, step: int) -> bool:
        """Block until step `step`'s row is written (True) or the attempt ended without it (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._step >= step or not self._open)
            return self._step >= step


class TensorBoardSink:
    """Scalars under <run dir>/tensorboard, one tag per numeric field: train/<field> for step rows,
    eval/<field without its eval_ prefix> for eval rows (eval/loss, eval/perplexity, ...)."""

    SKIP = ("step", "time", "pid", "batch_fingerprint", "kind")

    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(logdir))

    def write(self, record: dict[str, Any]) -> None:
        for k, v in record.items():
            if k not in self.SKIP and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                tag = f"eval/{k.removeprefix('eval_')}" if is_eval(record) else f"train/{k}"
                self._writer.add_scalar(tag, v, record["step"])

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class LogSink:
    """Every `period` steps one grep-friendly line: step, loss, step time, tokens/s, TFLOP/s, MFU (the
    record's fields attached for the json console: trainer.observe.console)."""

    def __init__(self, period: int):
        self.period = period

    def write(self, record: dict[str, Any]) -> None:
        if is_eval(record):  # every evaluation gets its line
            log.info(
                "eval step=%d eval_loss=%s eval_perplexity=%s eval_tokens=%d eval_time_s=%.3f",
                record["step"],
                _maybe(record["eval_loss"], ".4f"),
                _maybe(record["eval_perplexity"], ".3f"),
                record["eval_tokens"],
                record["eval_time_s"],
                extra={console.FIELDS: _scalars(record)},
            )
            return
        if record["step"] % self.period and not record.get("last"):
            return
        mfu = record.get("mfu")
        log.info(
            "step=%d loss=%.4f lr=%.3e grad_norm=%.3f step_time_s=%.4f tokens_per_s=%.1f "
            "tflops_per_device=%.3f mfu=%s",
            record["step"],
            record["loss"],
            record["learning_rate"],
            record["grad_norm"],
            record["step_time_s"],
            record["tokens_per_s"],
            record["tflops_per_device"],
            "null" if mfu is None else f"{mfu:.3f}",
            extra={console.FIELDS: _scalars(record)},
        )

    def close(self) -> None:
        pass


class ProgressSink:
    """One live line at a terminal, redrawn every step: step/total, loss, tokens/s, ETA and, when the
    checkpoint period is known, the time to the next save.

    ETA = the median of the last `window` step times × the steps remaining; the median ignores the
    spikes of checkpoint saves and recompiles. After an elastic rewind the step goes back and the ETA
    grows accordingly. Where the console has a live line (`trainer.observe.console.status_line`: text
    format at a terminal) the line is drawn there, below the log lines; under the json or kv format a
    log line every `period` steps instead (LogSink); otherwise it is rewritten in place (\\r) on `stream`
    (stderr by default), and close ends it with a newline so whatever is printed next starts on its own line.
    `save_period`: the checkpoint period the line counts down to (None: not known, no countdown); as an
    event-log listener (`on_event`) it takes each period the planner chooses.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        stream: TextIO | None = None,
        window: int = 20,
        period: int = 10,
        save_period: int | None = None,
    ):
        self.total_steps = total_steps
        self.save_period = save_period if save_period is not None and save_period > 0 else None
        self.stream = sys.stderr if stream is None else stream
        self._step_times: collections.deque[float] = collections.deque(maxlen=window)
        self._width = 0  # length of the line on screen, to blank out what a shorter line leaves behind
        self._lines = LogSink(period)

    def write(self, record: dict[str, Any]) -> None:
        if console.current_format() != "text":
            self._lines.write(record)
            return
        status = console.status_line()
        if status is not None:
            if is_eval(record):
                self._lines.write(record)
            else:
                status.update(self._line(record))
            return
        if is_eval(record):  # a line of its own, kept above the live line
            line = f"eval at step {record['step']}: eval_loss {_maybe(record['eval_loss'], '.4f')}"
            self.stream.write("\r" + line + " " * max(self._width - len(line), 0) + "\n")
            self.stream.flush()
            self._width = 0
            return
        line = self._line(record)
        self.stream.write("\r" + line + " " * max(self._width - len(line), 0))
        self.stream.flush()
        self._width = len(line)

    def _line(self, record: dict[str, Any]) -> str:
        self._step_times.append(record["step_time_s"])
        median = statistics.median(self._step_times)
        step = record["step"]
        line = (
            f"step {step}/{self.total_steps}  loss {record['loss']:.4f}  "
            f"{record['tokens_per_s']:,.0f} tokens/s  ETA {_clock(median * max(self.total_steps - step, 0))}"
        )
        if self.save_period is None or step >= self.total_steps:
            return line
        save = min((step // self.save_period + 1) * self.save_period, self.total_steps)
        return f"{line}  save in {_clock(median * (save - step))}"

    def on_event(self, record: dict[str, Any]) -> None:
        """An event-log listener: a planned checkpoint period (`periods_planned`) becomes the one the
        line counts down to."""
        period = record.get("checkpoint_period")
        if record.get("event") == ev.PERIODS_PLANNED and isinstance(period, int) and period > 0:
            self.save_period = period

    def close(self) -> None:
        console.stop_status_line()  # its last line stays on the screen
        if self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def _scalars(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if isinstance(v, (int, float, str, bool)) or v is None}


def _maybe(value: float | None, fmt: str) -> str:
    return "null" if value is None else format(value, fmt)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Sinks:
    """Fan a record out to every sink; the loop holds one of these."""

    def __init__(self, sinks: list[MetricSink], *, writable: Callable[[], bool] = lambda: True):
        self.sinks = sinks
        self.writable = writable  # False: this process is fenced (trainer.process.watchdog), it writes nothing

    def write(self, record: dict[str, Any]) -> None:
        if not self.writable():
            return
        record = {
            k: (None if isinstance(v, float) and not math.isfinite(v) and k == "mfu" else v)
            for k, v in record.items()
        }
        for s in self.sinks:
            s.write(record)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
