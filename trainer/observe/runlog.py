"""A run directory read back for reports: its events and step records, and the numbers a summary shows.

After an elastic rewind the trainer records steps again, so metrics.jsonl can hold a step more than
once. Read in file order, a record whose step is not past the previous one starts a new attempt; the
records it replaces are `superseded` and the rest `surviving` (the trajectory the final state came
from). This also holds for a run still in progress that has not yet re-reached its old last step.

Everything here is a pure function of the two files, so a run still in progress (no finish event, a
torn last line) reads the same way as a finished one. Both files are read only through
`trainer.io.jsonl.read_jsonl`, which skips a last line cut at any byte (a writer killed mid-line); a
record without the fields a report needs (an event's name and time, a step record's step and time)
is skipped too, so no cut can break a report.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from functools import partial
from typing import Any

from etils import epath

from trainer.errors import UserInputError
from trainer.io.jsonl import read_jsonl, read_jsonl_ends
from trainer.io.paths import resolve
from trainer.observe import catalogue
from trainer.observe.goodput import account
from trainer.observe.records import eval_rows, step_rows
from trainer.observe.spans import spans
from trainer.observe.timeline import recovery_timelines

METRICS_FILE, EVENTS_FILE = "metrics.jsonl", "events.jsonl"

# Recovery phases, in the order they happen after a slice failure.
DOWN, WAITING, RESTORING, TO_FIRST_STEP = (
    "down → detected",
    "waiting for slices",
    "restoring",
    "restored → first step",
)


class MissingRunFiles(UserInputError, FileNotFoundError):
    """The directory holds no metrics.jsonl / events.jsonl, so it is not (yet) a run directory. A user
    input error (the report CLI prints one line and exits 2), still a FileNotFoundError for callers."""


@dataclasses.dataclass(frozen=True)
class RunLog:
    name: str
    path: epath.Path
    events: list[dict[str, Any]]
    records: list[dict[str, Any]]  # every step record, in file order
    surviving: list[dict[str, Any]]  # the last record of each step on the final trajectory
    superseded: list[dict[str, Any]]  # records of steps that a rewind threw away
    eval_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # every eval row, file order
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the newest eval row of each step

    @property
    def t0(self) -> float:
        """Wall-clock origin of the run: its first event (or, without events, its first step's start)."""
        if self.events:
            return self.events[0]["time"]
        if self.records:
            return self.records[0]["time"] - self.records[0].get("step_time_s", 0.0)
        return 0.0

    @property
    def t_end(self) -> float:
        return max([e["time"] for e in self.events] + [r["time"] for r in self.records] + [self.t0])

    @property
    def status(self) -> str:
        """The finish status of the newest process, or "in progress" when it has not finished."""
        last_start = max((i for i, e in enumerate(self.events) if e["event"] == catalogue.START), default=-1)
        finish = [e for e in self.events[last_start + 1 :] if e["event"] == catalogue.FINISH]
        return finish[-1].get("status", "finished") if finish else "in progress"


def load_run(run_dir: str | os.PathLike, *, window_bytes: int | None = None) -> RunLog:
    """The run at `run_dir` (relative to the working directory, ~, or gs://).

    `window_bytes` (a local directory): read only the first `window_bytes` and the last `window_bytes` of
    each file, the run's start and its recent past, so a trainer measuring itself while it runs spends
    bounded memory and time however long the run has been going."""
    run_dir = resolve(run_dir)
    expected = "expected a run directory <base_output_directory>/<run_name>/ written by python -m trainer.train"
    if not run_dir.is_dir():
        raise MissingRunFiles(f"{run_dir} {'is a file' if run_dir.exists() else 'does not exist'}; {expected}")
    missing = [n for n in (METRICS_FILE, EVENTS_FILE) if not (run_dir / n).is_file()]
    if missing:
        raise MissingRunFiles(f"{run_dir} has no {' or '.join(missing)}; {expected}")
    if window_bytes is None:
        read = read_jsonl
    else:
        read = partial(read_jsonl_ends, head_bytes=window_bytes, tail_bytes=window_bytes)
    events = [
        e for e in read(run_dir / EVENTS_FILE) if isinstance(e.get("event"), str) and _is_number(e.get("time"))
    ]
    rows = [r for r in read(run_dir / METRICS_FILE) if _is_number(r.get("step")) and _is_number(r.get("time"))]
    records, evaluated = step_rows(rows), eval_rows(rows)
    if not events and not records:
        raise MissingRunFiles(f"{run_dir}: {METRICS_FILE} and {EVENTS_FILE} are both empty; nothing to report yet")
    surviving, superseded = split_rewound(records)
    evals, _ = split_rewound(evaluated)  # a step evaluated again after a rewind: its newest eval counts
    return RunLog(run_dir.name, run_dir, events, records, surviving, superseded, evaluated, evals)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def split_rewound(records: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """(surviving, superseded): a record at step s throws away every earlier-kept record at step >= s."""
    kept: list[dict] = []
    dropped: list[dict] = []
    for r in records:
        while kept and kept[-1]["step"] >= r["step"]:
            dropped.append(kept.pop())
        kept.append(r)
    return kept, sorted(dropped, key=lambda r: r["time"])


def recovery_phases(run: RunLog) -> list[tuple[dict, list[tuple[str, float, float]]]]:
    """For each failure: its timeline (trainer.observe.timeline) and its phases as (name, start, end).

    A phase still open (a run in progress waiting for slices) ends at the newest record in the files.
    """
    timelines = recovery_timelines(run.events)
    out = []
    for i, t in enumerate(timelines):
        next_detect = timelines[i + 1]["detected"] if i + 1 < len(timelines) else math.inf
        end = t.get("first_step", next_detect)
        window = [e for e in run.events if t["detected"] <= e["time"] <= end]
        phases: list[tuple[str, float, float]] = []
        if t["killed"] is not None:
            phases.append((DOWN, t["killed"], t["detected"]))
        for name, opens, closes in (
            (WAITING, catalogue.WAIT_START, catalogue.WAIT_END),
            (RESTORING, catalogue.RESTORE_START, catalogue.RESTORE_END),
        ):
            phases += [
                (name, s.start, run.t_end if s.end is None else s.end) for s in spans(window, opens, closes)
            ]
        restored = [e["time"] for e in window if e["event"] == catalogue.RESTORE_END]
        if restored and "first_step" in t:
            phases.append((TO_FIRST_STEP, restored[-1], t["first_step"]))
        out.append((t, phases))
    return out


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """The numbers a report prints, derived from the files (see `summarize`)."""

    name: str
    status: str
    steps_done: int
    steps_planned: int | None
    final_loss: float | None
    median_step_time_s: float | None
    median_tokens_per_s: float | None
    failures: int
    steps_lost: int
    downtime_s: float
    goodput: dict[str, Any]  # trainer.observe.goodput.account over the whole file
    recorded: dict[str, Any]  # the newest elastic_summary / goodput events the trainer logged, if any
    timelines: list[dict[str, Any]]
    final_eval_loss: float | None = None  # the newest evaluation's loss (None: no eval yet)
    final_eval_step: int | None = None
    slow_steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # slow_step events
    periods: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # periods_planned events
    hangs: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # hang_detected events
    # Where every attempt restored from: [{attempt, source, steps_lost, restart}] (restart: a new process
    # after the previous one was lost, counted by its restart_resumed event).
    restores: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def summarize(run: RunLog) -> RunSummary:
    """Derive every number from the records, so an unfinished run reports the same way as a finished one.

    failures = slice_down_detected events; steps lost = the sum of attempt_start.steps_rewound;
    downtime = the sum of first_step_after_recovery.seconds_since_detection (detection to first step,
    as the supervisor counts it). For a finished single-process run these equal its elastic_summary
    event; `recorded` keeps the trainer's own numbers so a report can show where they differ.
    """
    ev = run.events
    start = next((e for e in reversed(ev) if e["event"] == catalogue.START), {})
    step_times = [r["step_time_s"] for r in run.surviving if r.get("step_time_s")]
    tokens = [r["tokens_per_s"] for r in run.surviving if r.get("tokens_per_s")]
    recorded = {
        name: e for e in ev for name in (catalogue.ELASTIC_SUMMARY, catalogue.GOODPUT) if e["event"] == name
    }
    return RunSummary(
        name=run.name,
        status=run.status,
        steps_done=run.surviving[-1]["step"] if run.surviving else 0,
        steps_planned=start.get("steps"),
        final_loss=run.surviving[-1].get("loss") if run.surviving else None,
        median_step_time_s=statistics.median(step_times) if step_times else None,
        median_tokens_per_s=statistics.median(tokens) if tokens else None,
        failures=sum(e["event"] == catalogue.SLICE_DOWN_DETECTED for e in ev),
        steps_lost=sum(e.get("steps_rewound") or 0 for e in ev if e["event"] == catalogue.ATTEMPT_START),
        downtime_s=sum(
            e.get("seconds_since_detection") or 0.0
            for e in ev
            if e["event"] == catalogue.FIRST_STEP_AFTER_RECOVERY
        ),
        goodput=account(ev, run.records + run.eval_records),
        recorded=recorded,
        timelines=recovery_timelines(ev),
        final_eval_loss=run.evals[-1].get("eval_loss") if run.evals else None,
        final_eval_step=run.evals[-1]["step"] if run.evals else None,
        slow_steps=[e for e in ev if e["event"] == catalogue.SLOW_STEP],
        periods=[e for e in ev if e["event"] == catalogue.PERIODS_PLANNED],
        hangs=[e for e in ev if e["event"] == catalogue.HANG_DETECTED],
        restores=_restores(ev),
    )


def _restores(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per attempt that resumed saved state (not a fresh init): its source tier and the steps
    it trained again."""
    out = []
    for i, e in enumerate(ev):
        if e["event"] != catalogue.ATTEMPT_START or e.get("source") in (None, "init"):
            continue
        restart = i > 0 and ev[i - 1]["event"] == catalogue.RESTART_RESUMED  # emitted right before it
        if e.get("attempt") == 1 and not restart:
            continue  # a new run started from load_*_path
        out.append(
            {
                "attempt": e.get("attempt"),
                "source": e["source"],
                "steps_lost": e.get("steps_rewound") or 0,
                "restart": restart,
            }
        )
    return out
