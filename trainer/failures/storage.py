"""Storage failures: a checkpoint read or save fails as a storage timeout or a dropped connection would.

    storage=restore|save[,count=N]       the first N reads of a persistent checkpoint step (restore) or
                                         the first N checkpoint saves (save) fail with an OSError

They show that a transient storage error changes nothing on storage: the checkpointer retries (or exits
with the transient code) and never sets the step aside. Either kind of run (one controller or several
processes) takes them.
"""

from __future__ import annotations

import dataclasses
import threading

from trainer.failures.kind import ANY, FailureKind, Fields, entry_error
from trainer.observe import catalogue

OPERATIONS = ("restore", "save")


@dataclasses.dataclass(frozen=True)
class StorageFailure:
    """The first `count` checkpoint `operation`s (restore or save) fail."""

    operation: str
    count: int = 1


def parse(entry: str, fields: Fields, num_slices: int) -> StorageFailure:
    try:
        rest = dict(fields)
        operation, count = rest.pop("storage"), int(rest.pop("count", 1))
        if rest or operation not in OPERATIONS or count < 1:
            raise ValueError
    except ValueError:
        raise entry_error(entry, "a storage failure is storage=restore|save[,count=N] (N >= 1)") from None
    return StorageFailure(operation, count)


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
    def of(cls, faults) -> StorageFaults:
        """The storage failures among `faults` (a fault plan's)."""
        counts = dict.fromkeys(OPERATIONS, 0)
        for f in faults:
            if isinstance(f, StorageFailure):
                counts[f.operation] += f.count
        return cls(**counts)

    def fire(self, kind: str, what: str) -> None:
        """Raise InjectedStorageError if a `kind` failure is still due (thread-safe)."""
        with self._lock:
            left = getattr(self, kind)
            if left <= 0:
                return
            setattr(self, kind, left - 1)
        raise InjectedStorageError(f"injected transient storage error ({kind} of {what})")


KIND = FailureKind(
    name="storage",
    keys=frozenset({"storage", "count"}),
    parse=parse,
    faults=(StorageFailure,),
    grammar="storage=restore|save[,count=N]",
    scope=ANY,
    injection=None,  # the checkpointer fires them (trainer.checkpoint.checkpointer)
    injected_by="trainer.failures.storage:StorageFaults",
    detected_by="trainer.checkpoint.checkpointer:CheckpointRestoreTransient",
    outcome="retried with backoff; still failing, the run exits 75 (transient) and nothing is set aside",
    events=(catalogue.CHECKPOINT_RESTORE_FAILED, catalogue.CHECKPOINT_SAVE_FAILED),
    goodput_cause="restore",
)
