"""Run events (start, compile, checkpoint, elastic phases, finish) as one JSON object per line."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.io.jsonl import dumps, open_append, read_jsonl
from trainer.logevents import event_extra
from trainer.observe.catalogue import NAMES, Event
from trainer.observe.console import describe, severity

log = logging.getLogger(__name__)


class UnknownEvent(ValueError):
    """An event name that trainer/observe/catalogue.py does not list."""


class EventLog:
    """Appends `{"event", "time", "pid", ...fields}` to events.jsonl and logs one record per event (its
    sentence, with the event and fields attached for the console's formats: trainer.observe.console).

    Thread-safe (async checkpoint callbacks emit from other threads); the clock is injectable. Event
    names are the entries of `trainer.observe.catalogue`: a name that is not one raises `UnknownEvent`
    (a programming error, caught by the tests; the check is one set lookup).
    """

    def __init__(self, path: Path | None, *, clock: Callable[[], float] = time.time):
        self.path = path
        self.clock = clock
        self._lock = threading.Lock()
        self._file = open_append(path) if path is not None else None
        self.writable: Callable[[], bool] = lambda: True  # False: this process is fenced, it writes nothing
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener(record)` after each event is written (from the emitting thread: keep it short;
        an exception in it is logged, never raised into the code that emitted)."""
        self._listeners.append(listener)

    def emit(self, event: Event, **fields: Any) -> dict[str, Any]:
        if event not in NAMES:
            raise UnknownEvent(f"event {event!r} is not in trainer/observe/catalogue.py")
        record = {"event": str(event), "time": self.clock(), "pid": os.getpid(), **fields}
        with self._lock:
            if self._file is not None and self.writable():
                self._file.write(dumps(record))
        log.log(severity(event), "%s", describe(event, fields), extra=event_extra(event, fields))
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - an observer never breaks the code that emitted
                log.exception("event listener %r failed on %s", listener, event)
        return record

    def __call__(self, event: Event, fields: dict[str, Any] | None = None) -> None:
        """The `on_event(name, fields)` callback shape other packages take."""
        self.emit(event, **(fields or {}))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: Path) -> list[dict[str, Any]]:
    """Parse events.jsonl, skipping torn lines (the run may have been killed mid-write)."""
    return read_jsonl(path)
