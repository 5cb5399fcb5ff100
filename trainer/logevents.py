"""A log record that carries an event: its name and fields ride in the record's `extra`, beside a sentence.

Any module logs an event this way, whatever its layer, with the standard library alone:

    log.warning("removed a torn last line (%d bytes) from %s", n, path,
                extra=event_extra("jsonl_torn_tail_removed", {"file": str(path), "bytes": n}))

The console's formatters (`trainer.observe.console`) show the sentence (`log_format=text`), the event as
`event=NAME key=value ...` (`kv`), or both with the fields as JSON keys (`json`). A record without an
event is shown as its message in every format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EVENT = "trainer_event"  # a LogRecord attribute: the event's name
FIELDS = "trainer_fields"  # a LogRecord attribute: the event's (or a record's) fields, a dict


def event_extra(event: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The `extra=` of an event's log record."""
    return {EVENT: str(event), FIELDS: dict(fields)}
