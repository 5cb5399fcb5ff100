"""Bytes this process has read, from /proc/self/io: what a restore really pulled from storage.

`rchar` counts every byte the process's read calls returned (files, page cache, sockets: a GCS client's
downloads too), so the difference across a restore is what it read, whichever library did the reading.
None where the kernel does not provide it (not Linux).
"""

from __future__ import annotations

from pathlib import Path

_PROC_IO = Path("/proc/self/io")


def read_bytes() -> int | None:
    try:
        for line in _PROC_IO.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "rchar":
                return int(value)
    except (OSError, ValueError):
        return None
    return None
