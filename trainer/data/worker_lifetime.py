"""A data worker process lives no longer than the trainer process that started it.

Grain's `mp_prefetch` workers are separate processes (spawned) that fill a bounded queue. When the trainer
ends normally it stops them; when it is killed (SIGKILL, the kernel's OOM killer) nothing does, and a
worker blocked on its full queue would stay, holding its memory, for as long as the machine runs.
`exit_with_parent` is the workers' init function: it notes the process that started the worker and
ends the worker once it is gone.
"""

from __future__ import annotations

import os
import threading

POLL_S = 1.0


def _watch(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        threading.Event().wait(poll_s)
    os._exit(0)  # reparented: the trainer is gone; no queue is read any more


def exit_with_parent(worker_index: int = 0, worker_count: int = 1, *, poll_s: float = POLL_S) -> None:
    """Grain `worker_init_fn`: end this worker within `poll_s` of its parent's death (it is reparented)."""
    del worker_index, worker_count
    threading.Thread(target=_watch, args=(os.getppid(), poll_s), name="exit-with-parent", daemon=True).start()
