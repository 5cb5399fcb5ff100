"""The costs of a run's phases, measured from its run directory (events.jsonl, metrics.jsonl, config.yml).

Each cost is measured the way `trainer.observe.goodput` accounts it, so a plan fed these numbers
predicts the report's goodput:
- step_s: mean step_time_s of the steps that survived, leaving out the first step of each attempt and the
  steps that started a save (those are measured as the save's cost);
- snapshot_save_s / local_save_s: how much longer a step that started a host snapshot / local save took;
- checkpoint_save_s: checkpoint_save_blocked seconds beyond waiting for the step it saves;
- *_write_s: a save's own duration (snapshot_taken, checkpoint_save_committed seconds);
- *_restore_s: restore_start to restore_end after a failure, by source (snapshot, local, checkpoint);
- detect_s: per recovery, the time between the last step before it and the first step after it, less
  the wait for slices (wait_start to wait_end) and the restore; reschedule_s: that wait;
- step_gap_s: time between consecutive steps outside their step_time_s; tail_s: last step to finish;
- startup_s: process start to the first attempt, plus compiles after it (as the report counts it).
"""

from __future__ import annotations

import dataclasses
import statistics

import yaml

from trainer.config.schema import UNPLANNED_CHECKPOINT_PERIOD
from trainer.observe import catalogue
from trainer.observe.spans import closed
from trainer.plan.model import Costs


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What the plan needs from a run besides costs: its shape and settings (from config.yml)."""

    steps: int
    slices: int
    devices_per_slice: int
    checkpoint_period: int
    local_checkpoint_period: int
    snapshot_period: int
    min_slices: int
    failures: int
    wall_s: float
    goodput: float | None
    badput_s: dict[str, float]  # as the report accounts it


def _mean(values, default: float = 0.0) -> float:
    values = list(values)
    return statistics.fmean(values) if values else default


def _first_rows(events: list[dict], records: list[dict]) -> set[int]:
    """Indices of the first step record after each attempt_start."""
    firsts, i = set(), 0
    starts = [e["time"] for e in events if e["event"] == catalogue.ATTEMPT_START]
    for t in starts:
        while i < len(records) and records[i]["time"] <= t:
            i += 1
        if i < len(records):
            firsts.add(i)
    return firsts


def measure(run) -> tuple[Costs, RunFacts]:
    """Costs and facts of a `trainer.observe.runlog.RunLog`."""
    from trainer.observe.goodput import account

    events, records = run.events, run.records
    by = {}
    for e in events:
        by.setdefault(e["event"], []).append(e)
    firsts = _first_rows(events, records)
    snap_steps = {
        e["step"] for e in by.get(catalogue.SNAPSHOT_TAKEN, []) if e.get("origin", "snapshot") == "snapshot"
    }
    local_steps = {e["step"] for e in by.get(catalogue.LOCAL_CHECKPOINT_SAVE_START, [])}
    ckpt_steps = {e["step"] for e in by.get(catalogue.CHECKPOINT_SAVE_START, [])}
    surviving = {id(r) for r in run.surviving}

    def times(select):
        return [
            r["step_time_s"] for i, r in enumerate(records) if id(r) in surviving and i not in firsts and select(r)
        ]

    plain = times(lambda r: r["step"] not in snap_steps | local_steps | ckpt_steps)
    step_s = _mean(plain, default=_mean(r["step_time_s"] for r in records))
    snap_only = snap_steps - local_steps - ckpt_steps
    first_attempt = next((e["time"] for e in events if e["event"] == catalogue.ATTEMPT_START), events[0]["time"])
    # {id(end event): seconds since its start}, the intervals the report accounts
    spans = {
        id(s.end_event): s.seconds
        for start, end in (
            (catalogue.RESTORE_START, catalogue.RESTORE_END),
            (catalogue.WAIT_START, catalogue.WAIT_END),
        )
        for s in closed(events, start, end)
    }
    every_restore = [
        dict(e, seconds=spans.get(id(e), e.get("seconds", 0.0))) for e in by.get(catalogue.RESTORE_END, [])
    ]
    restores = [e for e in every_restore if e["time"] > first_attempt]  # not the start's
    gaps = []
    for i in range(1, len(records)):
        if i not in firsts:
            gaps.append(records[i]["time"] - records[i]["step_time_s"] - records[i - 1]["time"])
    recoveries = []
    for d in by.get(catalogue.SLICE_DOWN_DETECTED, []):
        before = [r for r in records if r["time"] <= d["time"]]
        after = [i for i in sorted(firsts) if records[i]["time"] > d["time"]]
        if not before or not after:
            continue
        first = records[after[0]]
        window = [e for e in events if before[-1]["time"] <= e["time"] <= first["time"]]
        wait = sum(spans.get(id(e), 0.0) for e in window if e["event"] == catalogue.WAIT_END)
        read = sum(spans.get(id(e), 0.0) for e in window if e["event"] == catalogue.RESTORE_END)
        span = first["time"] - first["step_time_s"] - before[-1]["time"]
        recoveries.append((max(0.0, span - wait - read), wait))
    g = account(events, records)
    finish = [e["time"] for e in by.get(catalogue.FINISH, [])]
    startup = first_attempt - events[0]["time"]
    startup += sum(e.get("seconds", 0.0) for e in by.get(catalogue.COMPILE_DONE, []) if e["time"] > first_attempt)
    costs = Costs(
        step_s=step_s,
        startup_s=startup,
        step_gap_s=max(0.0, _mean(gaps)),
        tail_s=max(0.0, finish[-1] - records[-1]["time"]) if finish and records else 0.0,
        first_step_extra_s=max(0.0, _mean(records[i]["step_time_s"] for i in firsts) - step_s),
        checkpoint_save_s=_mean(
            e.get("seconds", 0.0) - e.get("waited_for_step_s", 0.0)
            for e in by.get(catalogue.CHECKPOINT_SAVE_BLOCKED, [])
        ),
        local_save_s=max(0.0, _mean(times(lambda r: r["step"] in local_steps), default=step_s) - step_s),
        snapshot_save_s=max(0.0, _mean(times(lambda r: r["step"] in snap_only), default=step_s) - step_s),
        checkpoint_write_s=_mean(e.get("seconds", 0.0) for e in by.get(catalogue.CHECKPOINT_SAVE_COMMITTED, [])),
        local_write_s=_mean(e.get("seconds", 0.0) for e in by.get(catalogue.LOCAL_CHECKPOINT_SAVE_COMMITTED, [])),
        snapshot_write_s=_mean(e.get("seconds", 0.0) for e in by.get(catalogue.SNAPSHOT_TAKEN, [])),
        checkpoint_restore_s=_restore(restores, "checkpoint", every_restore),
        local_restore_s=_restore(restores, "local", []),
        snapshot_restore_s=_restore(restores, "snapshot", []),
        init_s=_restore(restores, "init", every_restore),
        detect_s=_mean(r[0] for r in recoveries),
        reschedule_s=_mean(r[1] for r in recoveries),
    )
    return costs, _facts(run, g, len(by.get(catalogue.SLICE_DOWN_DETECTED, [])))


def _restore(restores: list[dict], source: str, fallback: list[dict]) -> float:
    """Mean restore time from `source` after failures; else that of the start's restore (`fallback`)."""

    def of(found):
        return [e.get("seconds", 0.0) for e in found if str(e.get("source", "")).split(":")[0] == source]

    seconds = of(restores) or of(fallback)
    return _mean(seconds)


def _period(cfg: dict, events: list[dict], key: str, unplanned: int = 0) -> int:
    """A period from config.yml; an `auto` one (-1) is what the run last planned (`unplanned` before any
    plan, or when the run did not plan it)."""
    value = int(cfg.get(key, unplanned))
    if value >= 0:
        return value
    planned = [e[key] for e in events if e["event"] == catalogue.PERIODS_PLANNED and key in e]
    return int(planned[-1]) if planned else unplanned


def _facts(run, goodput: dict, failures: int) -> RunFacts:
    config_path = run.path / "config.yml"
    cfg = yaml.safe_load(config_path.read_text()) if config_path.exists() else {}
    cfg = cfg or {}
    devices = max((r.get("devices", 1) for r in run.records), default=1)
    slices = int(cfg.get("num_slices", 1))
    return RunFacts(
        steps=int(cfg.get("steps", max((r["step"] for r in run.records), default=0))),
        slices=slices,
        devices_per_slice=max(1, devices // slices),
        checkpoint_period=_period(cfg, run.events, "checkpoint_period", unplanned=UNPLANNED_CHECKPOINT_PERIOD),
        local_checkpoint_period=_period(cfg, run.events, "local_checkpoint_period"),
        snapshot_period=_period(cfg, run.events, "snapshot_period"),
        min_slices=int(cfg.get("elastic_min_slice_count", -1)),
        failures=failures,
        wall_s=goodput["wall_s"],
        goodput=goodput["goodput"],
        badput_s=goodput["badput_s"],
    )
