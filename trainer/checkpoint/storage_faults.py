"""Injected storage failures, to show that a transient storage error changes nothing on storage.

`fault_schedule` entries of the form `storage=restore[,count=N]` make the first N reads of a persistent
checkpoint step fail with an OSError, as a storage timeout or a dropped connection would; the
checkpointer must retry (or exit with the transient code) and never set the step aside.
`storage=save[,count=N]` makes the first N checkpoint saves fail the same way. The other entries of
the schedule (slice failures, process errors) are parsed by `trainer.elastic`; this module only reads
its own, so every layer can parse the schedule without importing the others.
"""

from __future__ import annotations

import dataclasses
import threading

from trainer.config.fault_schedule import parse_storage_faults


class InjectedStorageError(OSError):
    """An injected transient storage failure (fault_schedule storage=...)."""


@dataclasses.dataclass
class StorageFaults:
    """How many more restores / saves fail (the schedule's counts, used up as they fire)."""

    restore: int = 0
    save: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    @classmethod
    def from_schedule(cls, text: str) -> StorageFaults:
        """The storage failures a fault_schedule asks for (`storage=...` entries)."""
        spec = parse_storage_faults(text)
        return cls(restore=spec.restore, save=spec.save)

    def fire(self, kind: str, what: str) -> None:
        """Raise InjectedStorageError if a `kind` failure is still due (thread-safe)."""
        with self._lock:
            left = getattr(self, kind)
            if left <= 0:
                return
            setattr(self, kind, left - 1)
        raise InjectedStorageError(f"injected transient storage error ({kind} of {what})")
