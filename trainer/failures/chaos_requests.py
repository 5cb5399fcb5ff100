"""The chaos request protocol: how `trainer.chaos` (outside the job) asks a live trainer to lose a slice.

A request is a JSON file `<run dir>/chaos/<time>-kill-slice-<k>.json` ({slice, down_s, requested_at,
target}), written atomically. `target` names one trainer attempt by its `start` event (pid and time):
the trainer (`trainer.elastic.faults.FaultInjector`) honours only a request naming itself, so a request
left in the directory never kills a later run of it (a container restarts its trainer with the same pid,
so the pid alone would not do). This module is the protocol only; the CLI validates and writes through it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

CHAOS_DIR = "chaos"


def attempt_of(start: dict[str, Any]) -> dict[str, Any]:
    """The identity of the trainer process that wrote the `start` event: its pid and the event's time."""
    return {"pid": start.get("pid"), "started": start.get("time")}


def names_attempt(request: dict[str, Any], attempt: dict[str, Any] | None) -> bool:
    """True when the request's `target` is `attempt` (both pid and start time)."""
    target = request.get("target")
    return (
        isinstance(target, dict)
        and attempt is not None
        and target.get("pid") == attempt["pid"]
        and target.get("started") == attempt["started"]
    )


def request_kill(run_dir: Path, slice_index: int, down_s: float, target: dict[str, Any]) -> Path:
    """Write a kill request for the trainer attempt `target` (see `attempt_of`); returns its path."""
    chaos = Path(run_dir) / CHAOS_DIR
    chaos.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-kill-slice-{slice_index}"
    tmp = chaos / f"{name}.tmp"
    tmp.write_text(
        json.dumps({"slice": slice_index, "down_s": down_s, "requested_at": time.time(), "target": target})
    )
    final = chaos / f"{name}.json"
    os.replace(tmp, final)  # atomic: the trainer never reads a half-written request
    return final
