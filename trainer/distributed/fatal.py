"""A failure that is not a lost peer ends every process, with its cause.

An out-of-memory, a compile error or a bug in one process is not something a retry fixes. The process
that hits it publishes the cause in the coordination service before it leaves; every other process
checks for it whenever its own work fails or it waits for peers (a collective that the failed process
never joins times out within `collective_timeout_seconds`), and stops with that cause's exit code,
instead of counting it as a slice failure and retrying until `elastic_max_retries`.
"""

from __future__ import annotations

import json

from trainer.errors import EXIT_FAILED, exit_code_for

_KEY = "trainer/fatal"
_ACK_DIR = "trainer/fatal_ack"  # + /<process>: that process saw the fatal error and is stopping

_COLLECTIVE_SIGNS = ("gloo", "nccl", "connection closed", "connection reset", "deadline_exceeded", "timed out")


def is_collective_failure(error: BaseException) -> bool:
    """A collective or its rendezvous failed (a peer left, was slow, or its connection broke): a failure
    between processes, which fresh communicators on a new formation recover; not this process's own."""
    text = str(error).lower()
    return any(sign in text for sign in _COLLECTIVE_SIGNS)


class PeerFailed(RuntimeError):
    """Another process of the job failed with an error that is not a lost peer; this one stops too, with
    the exit code of that cause (trainer.errors: the same code on every process for the same cause)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code


def publish(client, process_index: int, error: BaseException) -> None:
    """Record this process's fatal error and its exit code for the others (the first one recorded wins)."""
    cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:500]
    record = {"process": process_index, "cause": cause, "exit_code": exit_code_for(error)}
    try:
        client.key_value_set(_KEY, json.dumps(record))
    except Exception:  # ALREADY_EXISTS: another process recorded its cause first
        pass


def check(client, process_index: int) -> None:
    """Raise PeerFailed if a process recorded a fatal error (after acknowledging it for that process)."""
    try:
        value = client.key_value_try_get(_KEY)
    except Exception:  # NOT_FOUND: nobody failed
        return
    if not value:
        return
    record = json.loads(value)
    if record["process"] == process_index:
        return
    client.key_value_set(f"{_ACK_DIR}/{process_index}", "1")
    raise PeerFailed(
        f"process {record['process']} failed: {record['cause']}; every process stops",
        exit_code=int(record.get("exit_code", EXIT_FAILED)),
    )


def acknowledged(client) -> set[int]:
    """Processes that saw the recorded fatal error."""
    try:
        entries = client.key_value_dir_get(_ACK_DIR)
    except Exception:
        return set()
    return {int(key.rsplit("/", 1)[-1]) for key, _ in entries}
