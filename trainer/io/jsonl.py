"""Append-only JSON-lines logs (metrics.jsonl, events.jsonl) that survive a torn tail.

A process killed mid-write leaves a last line without its newline, cut anywhere. Readers skip every
line that is not a JSON object (and say how many); a writer that reopens such a file first cuts the
torn fragment off, so its own first record starts on a fresh line instead of being glued to it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from trainer.logevents import event_extra

log = logging.getLogger(__name__)


def parse_lines(text: str, *, source: str = "") -> list[dict[str, Any]]:
    """The JSON objects of `text`, one per line; unparsable lines (a torn write) are skipped."""
    out, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict):
            out.append(record)
        else:
            bad += 1
    if bad:
        log.warning(
            "skipped %d torn or corrupt lines of %s",
            bad,
            source or "?",
            extra=event_extra("jsonl_skipped", {"file": str(source or "?"), "lines": bad}),
        )
    return out


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a JSONL file (local or an epath on an object store); [] if it does not exist."""
    from etils import epath

    p = epath.Path(path)
    if not p.exists():
        return []
    return parse_lines(p.read_bytes().decode("utf-8", errors="replace"), source=str(path))


def read_jsonl_ends(path: str | os.PathLike, *, head_bytes: int, tail_bytes: int) -> list[dict[str, Any]]:
    """The records of a local JSONL file's first `head_bytes` and last `tail_bytes` (whole lines only, each
    record once; the whole file when it is no bigger): memory and time bounded however long the run."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size <= head_bytes + tail_bytes:
            f.seek(0)
            return parse_lines(f.read().decode("utf-8", errors="replace"), source=str(path))
        f.seek(0)
        head = f.read(head_bytes)
        head = head[: head.rfind(b"\n") + 1]  # whole lines
        f.seek(size - tail_bytes)
        tail = f.read(tail_bytes)
        tail = tail[tail.find(b"\n") + 1 :]  # from the first whole line
    return parse_lines((head + tail).decode("utf-8", errors="replace"), source=str(path))


class LineCounter:
    """Counts the records of a growing local JSONL file that `match`, reading only what was appended since
    the previous call (constant memory; time proportional to the new lines)."""

    def __init__(self, path: str | os.PathLike, match):
        self.path = Path(path)
        self.match = match
        self.offset = 0
        self.count = 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        except FileNotFoundError:
            return self.count
        whole = new[: new.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(whole)
        for record in parse_lines(whole.decode("utf-8", errors="replace"), source=str(self.path)):
            self.count += bool(self.match(record))
        return self.count


def repair_tail(path: str | os.PathLike) -> int:
    """Cut a torn last line (no trailing newline, not valid JSON) off a local file; returns bytes cut.

    A last line that parses but lacks its newline gets the newline instead."""
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        window = min(size, 1 << 20)
        f.seek(size - window)
        tail = f.read(window)
        start = tail.rfind(b"\n") + 1
        fragment = tail[start:]
        try:
            json.loads(fragment)
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
            return 0
        except ValueError:
            f.truncate(size - len(fragment))
    log.warning(
        "removed a torn last line (%d bytes) from %s",
        len(fragment),
        path,
        extra=event_extra("jsonl_torn_tail_removed", {"file": str(path), "bytes": len(fragment)}),
    )
    return len(fragment)


def open_append(path: str | os.PathLike, *, buffering: int = 1):
    """Open a JSONL log for appending after repairing a torn tail left by a killed writer."""
    repair_tail(path)
    return open(path, "a", buffering=buffering, encoding="utf-8")


def dumps(record: dict[str, Any]) -> str:
    """One record as one line (newline included), so a single write() carries the whole record."""
    return json.dumps(record, default=str) + "\n"
