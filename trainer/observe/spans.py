"""Spans of a run: each interval between a start event and its end event (wait_start → wait_end,
restore_start → restore_end), paired one way for the goodput account, the report's recovery phases and
the planner's measured costs, so the three always count the same seconds.

The pairing rule, over events in file order: an end closes the newest start not yet closed, and every
start before that one is dropped (a start whose end was never written, by a process that died); an end
with no start open is ignored. A start still open after the last event is a span with no end (a run
in progress, waiting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from trainer.observe import catalogue


@dataclasses.dataclass(frozen=True)
class Span:
    start: float  # the start event's time
    end_event: dict | None  # the event that closed it; None: still open

    @property
    def end(self) -> float | None:
        return None if self.end_event is None else self.end_event["time"]

    @property
    def seconds(self) -> float | None:
        """Its length; None while it is open."""
        return None if self.end_event is None else self.end_event["time"] - self.start


def spans(events: Iterable[dict], start: catalogue.Event, end: catalogue.Event) -> list[Span]:
    """The spans from `start` to `end` events in `events` (file order), in order: only the last may be open."""
    out, opened = [], None
    for e in events:
        if e["event"] == start:
            opened = e["time"]
        elif e["event"] == end and opened is not None:
            out.append(Span(opened, e))
            opened = None
    if opened is not None:
        out.append(Span(opened, None))
    return out


def closed(events: Iterable[dict], start: catalogue.Event, end: catalogue.Event) -> list[Span]:
    """The spans from `start` to `end` that have ended."""
    return [s for s in spans(events, start, end) if s.end_event is not None]
