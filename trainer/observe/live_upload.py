"""A remote run's files, live on the bucket: a background thread that sends them (`RunPaths.sync`) every
`LIVE_SYNC_SECONDS`, and soon after each committed checkpoint, so the bucket holds the logs of every
committed step and a process killed -9 (an OOM kill, a lost node) loses at most the last interval.

It only wakes and calls `sync`; what goes up and how (appends composed on Cloud Storage) is
`trainer.observe.rundir`'s. A sync that fails (the store away) is a warning there, and the next one
sends what this one could not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from trainer.observe import catalogue
from trainer.observe.rundir import LIVE_SYNC_SECONDS

log = logging.getLogger(__name__)


class LiveUpload:
    """Calls `sync` every `interval_s` and when `request`ed (by a committed checkpoint's event)."""

    def __init__(self, sync: Callable[[], Any], interval_s: float = LIVE_SYNC_SECONDS):
        self.sync = sync
        self.interval_s = interval_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LiveUpload:
        self._thread = threading.Thread(target=self._run, name="run-files-upload", daemon=True)
        self._thread.start()
        return self

    def request(self) -> None:
        """Sync soon (the thread wakes now), without waiting for it."""
        self._wake.set()

    def on_event(self, record: dict[str, Any]) -> None:
        """An `EventLog` listener: a committed checkpoint sends the logs that lead up to it."""
        if record.get("event") == catalogue.CHECKPOINT_SAVE_COMMITTED:
            self.request()

    def stop(self) -> None:
        """Stop the thread (the caller's own last sync follows); an upload under way is waited for."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - the next sync tries again; training goes on
                log.warning("could not send the run's files to the bucket: %s", e)
