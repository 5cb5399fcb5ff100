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

from trainer.observe import catalogue
from trainer.observe.records import eval_rows, step_rows
from trainer.observe.spans import closed

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


def _rolled_back(record: dict, rollbacks: list[dict]) -> bool:
    """Whether a step's record was undone by a loss-spike rollback (a step from after the restored one
    through the spike, recorded before the rollback)."""
    return any(e["restored_step"] < record["step"] <= e["step"] and record["time"] <= e["time"] for e in rollbacks)


def account(
    events: Iterable[dict[str, Any]], metrics: Iterable[dict[str, Any]], *, now: float | None = None
) -> dict:
    events, metrics = list(events), list(metrics)
    evaluating = sum(r.get("eval_time_s") or 0.0 for r in eval_rows(metrics))
    metrics = step_rows(metrics)
    if not events:
        return {"wall_s": 0.0, "productive_s": 0.0, "goodput": None, "badput_s": {c: 0.0 for c in CAUSES}}
    t0 = events[0]["time"]
    finish = [e for e in events if e["event"] == catalogue.FINISH]
    t1 = (
        finish[-1]["time"]
        if finish
        else (now if now is not None else max([e["time"] for e in events] + [m["time"] for m in metrics]))
    )
    wall = max(t1 - t0, 1e-9)
    last_of_step: dict[int, int] = {}
    for i, m in enumerate(metrics):
        last_of_step[m["step"]] = i
    kept = set(last_of_step.values())
    # Waiting for the step in flight before copying it is that step's device time, which is productive.
    saving = sum(
        e.get("seconds", 0.0) - e.get("waited_for_step_s", 0.0)
        for e in events
        if e["event"] == catalogue.CHECKPOINT_SAVE_BLOCKED
    )
    # A step's step_time_s includes the time the loop was blocked starting its save: count that once,
    # as checkpoint_save, not also as productive time.
    productive = max(0.0, sum(m["step_time_s"] for i, m in enumerate(metrics) if i in kept) - saving)
    undone = [i for i, m in enumerate(metrics) if i not in kept]
    rollbacks = [e for e in events if e["event"] == catalogue.LOSS_SPIKE_ROLLBACK]
    spiked = [i for i in undone if rollbacks and _rolled_back(metrics[i], rollbacks)]
    rolled_back = sum(metrics[i]["step_time_s"] for i in spiked)
    wasted = sum(metrics[i]["step_time_s"] for i in undone) - rolled_back
    first_attempt = next((e["time"] for e in events if e["event"] == catalogue.ATTEMPT_START), t1)
    startup = (first_attempt - t0) + sum(
        e.get("seconds", 0.0) for e in events if e["event"] == catalogue.COMPILE_DONE and e["time"] > first_attempt
    )
    # The first restore (or init) belongs to startup; later ones are recoveries.
    restore = sum((s.seconds for s in closed(events, catalogue.RESTORE_START, catalogue.RESTORE_END)[1:]), 0.0)
    waiting = sum((s.seconds for s in closed(events, catalogue.WAIT_START, catalogue.WAIT_END)[1:]), 0.0)
    bad = {
        "startup_compile": startup,
        "checkpoint_save": saving,
        "restore": restore,
        "wasted_progress": wasted,
        "waiting_for_slices": waiting,
        "eval": evaluating,
        "sdc_check": sum(m.get("sdc_check_s") or 0.0 for m in metrics)
        + sum(e.get("seconds", 0.0) for e in events if e["event"] == catalogue.SDC_DETECTED),
        "rollback": rolled_back,
        "hang": sum(e.get("seconds", 0.0) for e in events if e["event"] == catalogue.HANG_DETECTED),
    }
    bad["other"] = max(0.0, wall - productive - sum(bad.values()))
    return {
        "wall_s": wall,
        "productive_s": productive,
        "goodput": productive / wall,
        "badput_s": {c: round(bad[c], 4) for c in CAUSES},
    }
