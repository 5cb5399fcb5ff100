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

from trainer.config.errors import ConfigError

KINDS = ("restore", "save")


class InjectedStorageError(OSError):
    """An injected transient storage failure (fault_schedule storage=...)."""


def is_storage_entry(entry: str) -> bool:
    return any(part.strip().startswith("storage=") for part in entry.split(","))


@dataclasses.dataclass
class StorageFaults:
    """How many more restores / saves fail (the schedule's counts, used up as they fire)."""

    restore: int = 0
    save: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    def fire(self, kind: str, what: str) -> None:
        """Raise InjectedStorageError if a `kind` failure is still due (thread-safe)."""
        with self._lock:
            left = getattr(self, kind)
            if left <= 0:
                return
            setattr(self, kind, left - 1)
        raise InjectedStorageError(f"injected transient storage error ({kind} of {what})")


def parse_storage_faults(text: str) -> StorageFaults:
    """The storage entries of a fault_schedule ('storage=restore,count=1; step=4,slice=0'), or a ConfigError."""
    faults = StorageFaults()
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        if not is_storage_entry(entry):
            continue
        try:
            fields = dict(part.strip().split("=", 1) for part in entry.split(","))
            kind, count = fields.pop("storage").strip(), int(fields.pop("count", 1))
            if fields or kind not in KINDS or count < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"fault_schedule entry {entry!r}: a storage failure is storage=restore|save[,count=N] (N >= 1)"
            ) from None
        setattr(faults, kind, getattr(faults, kind) + count)
    return faults
