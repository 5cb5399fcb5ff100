"""Goodput and badput of a run, computed from its events and metrics (a pure function of the records).

goodput = time of the steps whose results survived / wall time. Badput is the rest, by cause:
startup_compile (process start to the first step, plus any compile), checkpoint_save (time the loop
was blocked saving, beyond waiting for the step it saves), restore, wasted_progress (steps computed
and then rewound by a failure), waiting_for_slices, eval (held-out evaluations: the eval rows'
eval_time_s, kept out of the step times), sdc_check (the silent-data-corruption replay checks: the
records' sdc_check_s and sdc_detected's seconds), rollback (steps undone by a loss-spike rollback),
hang (no progress until the watchdog ended the process: hang_detected's seconds), and other
(detection, teardown, logging, data).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from trainer.observe import catalogue
from trainer.observe.records import is_eval

CAUSES = (
    "startup_compile",
    "checkpoint_save",
    "restore",
    "wasted_progress",
    "waiting_for_slices",
    "eval",
    "sdc_check",
    "rollback",
    "hang",
    "other",
)


def _rolled_back(step: int, time: float, rollbacks: list[dict]) -> bool:
    """Whether a step's record (its step and time) was undone by a loss-spike rollback (a step from after
    the restored one through the spike, recorded before the rollback)."""
    return any(e["restored_step"] < step <= e["step"] and time <= e["time"] for e in rollbacks)


class _StepTimes:
    """The newest record of each step, by step number: its step time and the time it was written (16 bytes
    a step; NaN: no record yet)."""

    def __init__(self):
        self._rows = np.full((1024, 2), np.nan)  # [step - first] -> (step_time_s, time)
        self._first: int | None = None  # the step number of _rows[0]

    def put(self, step: int, seconds: float, time: float) -> tuple[float, float] | None:
        """Record `step`'s newest record; returns the (step_time_s, time) of the one it supersedes, if any."""
        if self._first is None:
            self._first = step
        if step < self._first:  # a step before every one so far: grow at the front
            self._rows = np.concatenate([np.full((self._first - step, 2), np.nan), self._rows])
            self._first = step
        i = step - self._first
        if i >= len(self._rows):
            grown = np.full((max(2 * len(self._rows), i + 1), 2), np.nan)
            grown[: len(self._rows)] = self._rows
            self._rows = grown
        before = self._rows[i].copy()
        self._rows[i] = (seconds, time)
        return None if np.isnan(before[1]) else (float(before[0]), float(before[1]))

    def total(self) -> float:
        """The step times of the newest records, summed."""
        return float(np.nansum(self._rows[:, 0]))


class GoodputAccount:
    """The goodput account of a run, fed its events and metrics rows one at a time, in file order
    (`add_event`, `add_row`); `result(now)` at any point is the account of what was fed.

    It keeps what the account needs, not the records: a step time per step number (`_StepTimes`), running
    sums, and the records a rewind superseded (few: a rewind repeats at most the steps since the state it
    restored). So a live run's metrics endpoint holds a few bytes per step however long the run, and a
    scrape costs one pass over the step times."""

    def __init__(self):
        self.t0: float | None = None  # the first event's time
        self.latest = 0.0  # the newest time of any record
        self.finished: float | None = None  # the last finish event's time
        self.first_attempt: float | None = None
        self.evaluating = self.saving = self.compiling = self.sdc = self.hang = 0.0
        self._kept = _StepTimes()
        self._undone: list[tuple[int, float, float]] = []  # (step, time, step_time_s) of superseded records
        self._rollbacks: list[dict] = []
        self._open: dict[str, float | None] = {catalogue.RESTORE_START: None, catalogue.WAIT_START: None}
        self._closed = {
            catalogue.RESTORE_START: [0, 0.0],
            catalogue.WAIT_START: [0, 0.0],
        }  # count, seconds after the first

    def add_event(self, e: dict[str, Any]) -> None:
        name, t = e["event"], e["time"]
        if self.t0 is None:
            self.t0 = t
        self.latest = max(self.latest, t)
        if name == catalogue.FINISH:
            self.finished = t
        elif name == catalogue.CHECKPOINT_SAVE_BLOCKED:
            # Waiting for the step in flight before copying it is that step's device time: productive.
            self.saving += e.get("seconds", 0.0) - e.get("waited_for_step_s", 0.0)
        elif name == catalogue.LOSS_SPIKE_ROLLBACK:
            self._rollbacks.append(e)
        elif name == catalogue.ATTEMPT_START and self.first_attempt is None:
            self.first_attempt = t
        elif name == catalogue.COMPILE_DONE and self.first_attempt is not None and t > self.first_attempt:
            self.compiling += e.get("seconds", 0.0)
        elif name == catalogue.SDC_DETECTED:
            self.sdc += e.get("seconds", 0.0)
        elif name == catalogue.HANG_DETECTED:
            self.hang += e.get("seconds", 0.0)
        for start, end in (
            (catalogue.RESTORE_START, catalogue.RESTORE_END),
            (catalogue.WAIT_START, catalogue.WAIT_END),
        ):
            # The spans' pairing rule (trainer.observe.spans): an end closes the newest open start.
            if name == start:
                self._open[start] = t
            elif name == end and self._open[start] is not None:
                count, seconds = self._closed[start]
                # The first restore (or init) belongs to startup, the first wait to it too; later ones count.
                self._closed[start] = [count + 1, seconds + (t - self._open[start] if count else 0.0)]
                self._open[start] = None

    def add_row(self, r: dict[str, Any]) -> None:
        self.latest = max(self.latest, r["time"])
        if is_eval(r):
            self.evaluating += r.get("eval_time_s") or 0.0
            return
        self.sdc += r.get("sdc_check_s") or 0.0
        superseded = self._kept.put(r["step"], r["step_time_s"], r["time"])
        if superseded is not None:
            self._undone.append((r["step"], superseded[1], superseded[0]))

    def result(self, now: float | None = None) -> dict:
        if self.t0 is None:
            return {"wall_s": 0.0, "productive_s": 0.0, "goodput": None, "badput_s": {c: 0.0 for c in CAUSES}}
        t1 = self.finished if self.finished is not None else (now if now is not None else self.latest)
        wall = max(t1 - self.t0, 1e-9)
        # A step's step_time_s includes the time the loop was blocked starting its save: count that once,
        # as checkpoint_save, not also as productive time.
        productive = max(0.0, self._kept.total() - self.saving)
        rolled_back = sum(
            s for step, t, s in self._undone if self._rollbacks and _rolled_back(step, t, self._rollbacks)
        )
        first_attempt = self.first_attempt if self.first_attempt is not None else t1
        bad = {
            "startup_compile": (first_attempt - self.t0) + self.compiling,
            "checkpoint_save": self.saving,
            "restore": self._closed[catalogue.RESTORE_START][1],
            "wasted_progress": sum(s for _, _, s in self._undone) - rolled_back,
            "waiting_for_slices": self._closed[catalogue.WAIT_START][1],
            "eval": self.evaluating,
            "sdc_check": self.sdc,
            "rollback": rolled_back,
            "hang": self.hang,
        }
        bad["other"] = max(0.0, wall - productive - sum(bad.values()))
        return {
            "wall_s": wall,
            "productive_s": productive,
            "goodput": productive / wall,
            "badput_s": {c: round(bad[c], 4) for c in CAUSES},
        }


def account(
    events: Iterable[dict[str, Any]], metrics: Iterable[dict[str, Any]], *, now: float | None = None
) -> dict:
    """The account of a run's events and metrics rows (each in file order), up to `now` when the run has
    not finished (else up to its newest record)."""
    acc = GoodputAccount()
    for e in events:
        acc.add_event(e)
    for r in metrics:
        acc.add_row(r)
    return acc.result(now)
