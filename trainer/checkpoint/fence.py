"""A generation token checked at commit: a save that belongs to an older attempt, or to a job that lost
the run's lease, never commits.

After a slice failure the failed attempt's save may still be writing in Orbax's background thread (its
close is bounded, the thread is not stopped). The next attempt opens a new checkpointer, which advances
the fence. When the old save reaches its commit, the fence refuses it: its directory stays a partial
step, removed by the next cleanup, and on an object store (where a step is written in place and
committed by a marker) it can never commit a step with objects missing. The same check asks the run's
lease (`trainer.checkpoint.lease`) whether this job still holds the run directory: a process frozen
past its lease's staleness bound, whose run was taken over, commits nothing when it wakes up.

The hook is Orbax's commit itself: the step's `TemporaryPath.finalize` (the rename of the tmp
directory, or the commit marker on object stores) runs the check first, and records the step's files
for verification (`trainer.checkpoint.verify`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from etils import epath

from trainer.io.orbax_internals import orbax_commit_classes
from trainer.io.paths import is_remote

log = logging.getLogger(__name__)


class FencedWrite(RuntimeError):
    """A save reached its commit after a newer attempt (or another job) took over: it is not committed."""


class SaveFence:
    """One per process: the newest attempt's epoch, and (process 0) the run's lease."""

    def __init__(self, lease=None):
        self._epoch = 0
        self._lock = threading.Lock()
        self.lease = lease

    def advance(self) -> int:
        """A new attempt's checkpointer: saves of every older epoch can no longer commit."""
        with self._lock:
            self._epoch += 1
            return self._epoch

    def check(self, epoch: int, step: int) -> None:
        with self._lock:
            current = self._epoch
        if epoch != current:
            raise FencedWrite(
                f"save of step {step} belongs to attempt epoch {epoch}, and epoch {current} has started: "
                "not committed"
            )
        if self.lease is not None and not self.lease.still_ours():
            raise FencedWrite(f"save of step {step}: this job no longer holds the run's lease: not committed")


def fenced_path_class(
    directory: epath.PathLike, check: Callable[[int], None], record: Callable[[epath.Path], None]
):
    """Orbax's TemporaryPath class for `directory` (atomic rename locally, commit marker on object stores)
    whose step-level commit first runs `check(step)` (raising refuses the commit) and `record(path)`."""
    rename, marker = orbax_commit_classes()
    base = marker if is_remote(str(directory)) else rename
    root = str(epath.Path(directory))

    class Fenced(base):
        async def finalize(self):
            final = self.get_final()
            if str(final.parent) == root and final.name.isdigit():  # the step, not one of its items
                check(int(final.name))
                record(self.get())
            return await super().finalize()

    return Fenced
