"""Recovery timelines from events.jsonl: for each slice failure, when each phase happened.

Times are seconds after the kill (or after detection when the kill time is unknown, as on Pathways).
"""

from __future__ import annotations

from typing import Any

from trainer.observe import catalogue

PHASES = ("killed", "detected", "slices_ready", "restored", "first_step")


def recovery_timelines(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    last_kill: dict[str, Any] | None = None
    for e in events:
        name = e["event"]
        if name == catalogue.SLICE_KILLED:
            last_kill = e
        elif name == catalogue.SLICE_DOWN_DETECTED:
            current = {
                "killed": last_kill["time"] if last_kill else None,
                "detected": e["time"],
                "slice": last_kill["slice"] if last_kill else None,
                "last_step": e["last_step"],
                "slices_before": e["slices"],
                "attempt": e["attempt"] + 1,
            }
            last_kill = None
            out.append(current)
        elif current is None:
            continue
        elif name == catalogue.WAIT_END and "slices_ready" not in current:
            current["slices_ready"], current["slices_after"] = e["time"], e["active"]
        elif name == catalogue.RESTORE_END and "restored" not in current:
            current["restored"], current["restore_source"] = e["time"], e["source"]
            current["restore_s"], current["restore_bytes"] = e["seconds"], e["bytes"]
        elif name == catalogue.ATTEMPT_START and "steps_rewound" not in current:
            current["steps_rewound"], current["resumed_from_step"] = e["steps_rewound"], e["start_step"]
        elif name == catalogue.FIRST_STEP_AFTER_RECOVERY and "first_step" not in current:
            current["first_step"], current["first_step_number"] = e["time"], e["step"]
    for t in out:
        origin = t["killed"] if t["killed"] is not None else t["detected"]
        t["relative_s"] = {p: (None if t.get(p) is None else round(t[p] - origin, 3)) for p in PHASES}
    return out


def format_timeline(t: dict[str, Any]) -> str:
    r = t["relative_s"]
    labels = {
        "killed": f"slice {t['slice']} killed",
        "detected": "failure detected in the train function",
        "slices_ready": f"slices ready {t.get('slices_after')}",
        "restored": f"state restored from {t.get('restore_source')}",
        "first_step": f"first step after recovery (step {t.get('first_step_number')})",
    }
    lines = [f"  t={r[p]:+8.3f}s  {labels[p]}" for p in PHASES if r.get(p) is not None]
    lines.append(
        f"  steps rewound: {t.get('steps_rewound')} (last completed {t['last_step']}, resumed from "
        f"{t.get('resumed_from_step')})"
    )
    return "\n".join(lines)
