"""Where step metrics go: metrics.jsonl, TensorBoard, the log. One interface, swappable sinks."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("trainer.metrics")


class MetricSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """metrics.jsonl: one JSON object per step, flushed per line so a killed run keeps its history."""

    def __init__(self, path: Path):
        self._file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars under <run dir>/tensorboard, one tag per numeric field."""

    SKIP = ("step", "time", "pid", "batch_fingerprint")

    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(logdir))

    def write(self, record: dict[str, Any]) -> None:
        for k, v in record.items():
            if k not in self.SKIP and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                self._writer.add_scalar(f"train/{k}", v, record["step"])

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class LogSink:
    """Every `period` steps one grep-friendly line: step, loss, step time, tokens/s, TFLOP/s, MFU."""

    def __init__(self, period: int):
        self.period = period

    def write(self, record: dict[str, Any]) -> None:
        if record["step"] % self.period and not record.get("last"):
            return
        mfu = record.get("mfu")
        log.info("step=%d loss=%.4f lr=%.3e grad_norm=%.3f step_time_s=%.4f tokens_per_s=%.1f "
                 "tflops_per_device=%.3f mfu=%s", record["step"], record["loss"], record["learning_rate"],
                 record["grad_norm"], record["step_time_s"], record["tokens_per_s"],
                 record["tflops_per_device"], "null" if mfu is None else f"{mfu:.3f}")

    def close(self) -> None:
        pass


class Sinks:
    """Fan a record out to every sink; the loop holds one of these."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) and k == "mfu" else v)
                  for k, v in record.items()}
        for s in self.sinks:
            s.write(record)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
