"""The live metrics of a run: a pure mapping from its events and metrics rows to named values.

`LiveState` is fed the run's events and rows as they are written and gives a `Values` at each scrape
(`live_values(events, rows, now=...)` does both for lists), which `trainer.observe.metrics_server` serves
to Prometheus. Each number comes from the records the run already writes, so a scrape and a later report
agree:

- the newest step row: step, loss, learning rate, tokens/s, MFU (None where the device kind is unknown),
  step time;
- goodput and badput by cause: `trainer.observe.goodput`'s account of every event and row so far, up to
  `now`; each cause also carries ml-goodput-measurement's `BadputType` name (`BADPUT_TYPES`);
- recoveries by kind: each attempt that resumed saved state after a failure or a restart (the kind is
  `restart` for a new process, else the tier it restored from: `snapshot`, `local`, `checkpoint`, ...);
- failures by cause (slice_down_detected); steps lost (the sum of attempt_start's steps_rewound, as
  `trainer.observe.runlog.summarize` counts them);
- seconds since the newest committed save, per tier (`checkpoint`, `local`);
- slices in use (the newest attempt_start's or wait_end's active slices);
- the planner's predicted goodput (the newest periods_planned's `expected_goodput`; None when no period
  is `auto`, so nothing was planned).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from trainer.observe import catalogue
from trainer.observe.goodput import GoodputAccount
from trainer.observe.records import is_eval

# Our badput causes under ml-goodput-measurement's names (its `BadputType`), for dashboards built on them.
BADPUT_TYPES = {
    "startup_compile": "PROGRAM_STARTUP",
    "checkpoint_save": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "restore": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "wasted_progress": "WASTED_PROGRESS_FROM_DISRUPTION",
    "waiting_for_slices": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "eval": "CUSTOM_BADPUT_EVENTS",
    "sdc_check": "CUSTOM_BADPUT_EVENTS",
    "rollback": "CUSTOM_BADPUT_EVENTS",
    "hang": "CUSTOM_BADPUT_EVENTS",
    "other": "OTHER",
}

# The fields of the newest step row served as gauges.
STEP_GAUGES = ("step", "loss", "learning_rate", "tokens_per_s", "mfu", "step_time_s")
SAVE_TIERS = {
    catalogue.CHECKPOINT_SAVE_COMMITTED: "checkpoint",
    catalogue.LOCAL_CHECKPOINT_SAVE_COMMITTED: "local",
}


@dataclasses.dataclass(frozen=True)
class Values:
    step: int | None = None
    loss: float | None = None
    learning_rate: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    goodput: float | None = None
    wall_s: float = 0.0
    productive_s: float = 0.0
    badput_s: dict[str, float] = dataclasses.field(default_factory=dict)
    recoveries: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    steps_lost: int = 0
    seconds_since_save: dict[str, float] = dataclasses.field(default_factory=dict)
    slices: int | None = None
    predicted_goodput: float | None = None


class LiveState:
    """The run's live metrics, fed its events and metrics rows one at a time in file order (`add_event`,
    `add_row`); `values(now)` at any point. It keeps running counts and the goodput account's per-step
    state (`trainer.observe.goodput.GoodputAccount`), never the records: a long run's endpoint holds a
    few bytes per step, and a scrape costs one pass over the step times."""

    def __init__(self):
        self.goodput = GoodputAccount()
        self.last: dict[str, Any] = {}  # the newest step row's fields
        self.recoveries: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.saved: dict[str, float] = {}  # tier -> the newest committed save's time
        self.steps_lost = 0
        self.slices: int | None = None
        self.predicted: float | None = None
        self._previous: str | None = None  # the previous event's name

    def add_event(self, e: dict[str, Any]) -> None:
        self.goodput.add_event(e)
        name = e["event"]
        if name == catalogue.ATTEMPT_START:
            self.steps_lost += e.get("steps_rewound") or 0
            self.slices = _count(e.get("slices"), self.slices)
            kind = _recovery_kind(e, restart=self._previous == catalogue.RESTART_RESUMED)
            if kind is not None:
                self.recoveries[kind] = self.recoveries.get(kind, 0) + 1
        elif name == catalogue.WAIT_END:
            self.slices = _count(e.get("active"), self.slices)
        elif name == catalogue.SLICE_DOWN_DETECTED:
            cause = str(e.get("cause") or "unknown")
            self.failures[cause] = self.failures.get(cause, 0) + 1
        elif name in SAVE_TIERS:
            self.saved[SAVE_TIERS[name]] = e["time"]
        elif name == catalogue.PERIODS_PLANNED and e.get("expected_goodput") is not None:
            self.predicted = e["expected_goodput"]
        self._previous = name

    def add_row(self, row: dict[str, Any]) -> None:
        self.goodput.add_row(row)
        if not is_eval(row):
            self.last = {k: row.get(k) for k in STEP_GAUGES}

    def values(self, now: float) -> Values:
        summary = self.goodput.result(now)
        return Values(
            **self.last,
            goodput=summary["goodput"],
            wall_s=summary["wall_s"],
            productive_s=summary["productive_s"],
            badput_s=dict(summary["badput_s"]),
            recoveries=dict(self.recoveries),
            failures=dict(self.failures),
            steps_lost=self.steps_lost,
            seconds_since_save={tier: max(0.0, now - t) for tier, t in self.saved.items()},
            slices=self.slices,
            predicted_goodput=self.predicted,
        )


def live_values(events: Iterable[dict[str, Any]], rows: Iterable[dict[str, Any]], *, now: float) -> Values:
    """The run's live metrics from its events and metrics rows so far (file order), at time `now`."""
    state = LiveState()
    for e in events:
        state.add_event(e)
    for r in rows:
        state.add_row(r)
    return state.values(now)


def _recovery_kind(attempt_start: dict[str, Any], *, restart: bool) -> str | None:
    """`restart`, or the tier an attempt after a failure restored from; None for a run's first attempt
    or an attempt that initialised fresh state."""
    source = attempt_start.get("source")
    if source in (None, "init"):
        return None
    if restart:
        return "restart"
    if attempt_start.get("attempt") == 1:
        return None  # a new run started from load_*_path
    return str(source).split(":", 1)[0]


def _count(active: Any, before: int | None) -> int | None:
    if isinstance(active, (list, tuple)):
        return len(active)
    if isinstance(active, int) and not isinstance(active, bool):
        return active
    return before
