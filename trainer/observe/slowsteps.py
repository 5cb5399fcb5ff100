"""Slow-step detection (`monitor_step_time_deviation`): a step much slower than the recent ones is an event.

Rule: step s is slow when its `step_time_s` exceeds `factor` x the median of the previous WINDOW step
times of the same attempt (at least MIN_HISTORY of them; the first steps of an attempt include its
compile and are only history). The median ignores the odd spike, so one slow step does not hide the
next. A slow step emits `slow_step` (step, step_time_s, median_s, factor, process) in events.jsonl; it
goes into the window too, so a lasting slowdown becomes the new normal instead of an event per step.

Which process was slowest (several processes): in SPMD every process waits for the slowest one inside
the step's collectives, so all of them see the same step time and flag the same step. What differs is
each process's own host time before it could dispatch the step (`host_time_s` in its records: boundary
work, loading the batch, the transfer). A process that flags step s publishes its host time for s in the
coordination service's key-value store (no device collective, nothing on the steps that are not slow)
and reads everyone's at its next record, one step later, when every process has published: the event
then names `slowest_process` and lists `host_time_s` per process. Keys are never read back by the step
loop itself, so a dead peer costs a missing entry, never a wait.
"""

from __future__ import annotations

import collections
import json
import logging
import statistics
from typing import Any, Protocol

from trainer.observe import catalogue

log = logging.getLogger(__name__)
WINDOW = 20  # recent step times the median is taken over
MIN_HISTORY = 5  # steps of an attempt before any step is judged
KEY_PREFIX = "trainer/slow_step/"


class HostTimes(Protocol):
    """Shares one number per (step, process) among the processes of a job."""

    def publish(self, step: int, record: dict[str, Any]) -> None: ...

    def collect(self, step: int, when: float | None) -> dict[int, float]: ...


class CoordinationHostTimes:
    """HostTimes over the coordination service's key-value store (jax.distributed's client).

    A step can run twice (a rollback, an elastic rewind): each value carries the wall time of its step,
    and `collect` keeps only values within `max_age_s` of the reader's own, so an earlier run of the same
    step number is not mistaken for this one."""

    def __init__(self, client, process_index: int, *, max_age_s: float = 600.0):
        self.client = client
        self.process_index = process_index
        self.max_age_s = max_age_s

    def publish(self, step: int, record: dict[str, Any]) -> None:
        self.client.key_value_set(
            f"{KEY_PREFIX}{step}/{self.process_index}", json.dumps(record), allow_overwrite=True
        )

    def collect(self, step: int, when: float | None) -> dict[int, float]:
        """{process: host_time_s} published for `step` around wall time `when`."""
        out = {}
        for key, value in self.client.key_value_dir_get(f"{KEY_PREFIX}{step}/"):
            try:
                process, entry = int(key.rsplit("/", 1)[1]), json.loads(value)
            except (ValueError, IndexError):
                continue
            fresh = when is None or entry.get("time") is None or abs(entry["time"] - when) <= self.max_age_s
            if fresh and entry.get("host_time_s") is not None:
                out[process] = entry["host_time_s"]
        return out


class SlowStepMonitor:
    """A metrics sink that emits `slow_step` events (the rule is in the module docstring).

    `factor` <= 0 turns it off. `host_times` (several processes) names the slowest process; without it
    the event names this process. A new attempt (the step goes back, or a gap) starts a fresh window.
    """

    def __init__(self, factor: float, events, *, process_index: int = 0, host_times: HostTimes | None = None):
        self.factor = factor
        self.events = events
        self.process_index = process_index
        self.host_times = host_times
        self.window: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.last_step: int | None = None
        self.unresolved: dict[str, Any] | None = None  # a slow step whose peers' host times are not read yet

    def write(self, record: dict[str, Any]) -> None:
        if self.factor <= 0 or "step_time_s" not in record:  # off, or not a step row (an eval row)
            return
        self._resolve()
        step, seconds = record["step"], record["step_time_s"]
        if self.last_step is not None and step != self.last_step + 1:
            self.window.clear()  # a new attempt: its first step compiles again
        self.last_step = step
        if len(self.window) >= MIN_HISTORY:
            median = statistics.median(self.window)
            if seconds > self.factor * median:
                self._slow(record, median)
        self.window.append(seconds)

    def _slow(self, record: dict[str, Any], median: float) -> None:
        fields = {
            "step": record["step"],
            "step_time_s": round(record["step_time_s"], 4),
            "median_s": round(median, 4),
            "factor": self.factor,
            "process": self.process_index,
        }
        host = record.get("host_time_s")
        if self.host_times is None:
            self.events.emit(catalogue.SLOW_STEP, **fields, slowest_process=self.process_index, host_time_s=host)
            return
        try:
            self.host_times.publish(record["step"], {"host_time_s": host, "time": record.get("time")})
        except Exception as e:  # noqa: BLE001 - observability must never end training
            log.warning("could not share the host time of slow step %d: %s", record["step"], e)
        self.unresolved = {**fields, "time": record.get("time")}

    def _resolve(self) -> None:
        """Emit the pending slow step with every process's host time (they have published by now)."""
        pending, self.unresolved = self.unresolved, None
        if pending is None:
            return
        when = pending.pop("time")
        try:
            host = dict(sorted(self.host_times.collect(pending["step"], when).items()))
        except Exception as e:  # noqa: BLE001
            log.warning("could not read the host times of slow step %d: %s", pending["step"], e)
            host = {}
        slowest = max(host, key=host.get) if host else None
        self.events.emit(
            catalogue.SLOW_STEP, **pending, slowest_process=slowest, host_time_s={str(p): host[p] for p in host}
        )

    def close(self) -> None:
        self._resolve()
