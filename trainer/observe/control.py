"""The control endpoint: operators' requests to a running job (checkpoint now, drain, re-plan periods).

It is served beside the live metrics (`trainer.observe.metrics_server.Endpoint`, metrics_port) on
process 0: `POST /control/<action>` with the header `Authorization: Bearer <token>`. The token is fresh at
every process start, written to `<run dir>/control/token` (mode 0600, in a 0700 directory: only the job's
user reads it; the bucket copy of the run directory leaves `control/` out), with the endpoint's port
beside it in `control/port`; both are removed when the process ends. `python -m trainer.control` reads
them and sends a request.

`ControlRequests.handle` answers on the HTTP server's thread and changes nothing there: a request with a
missing token is refused with 401, a wrong one with 403, any method but POST with 405, an unknown action
with 404, an action the run cannot do (`offer`) with 409; an accepted one (202) is queued. Every request,
accepted or refused, is a `control_request` event. The training thread takes the queue at a step
boundary (`take`) and acts on it (trainer/run.py); each action it starts is a `control_applied` event.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import queue
import secrets
from collections.abc import Callable, Iterable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from trainer.observe import catalogue

log = logging.getLogger(__name__)

CONTROL_DIR = "control"  # under the run directory; never uploaded (trainer.observe.rundir)
TOKEN_FILE = "token"
PORT_FILE = "port"
PATH = "/control/"
ACTIONS = ("checkpoint", "drain", "replan")
NOT_STARTED = "the run is still starting: retry in a moment"


def write_access(run_dir: Path, token: str, port: int) -> None:
    """`token` and the endpoint's `port` in `run_dir/control/`, readable by this user only."""
    directory = Path(run_dir) / CONTROL_DIR
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    _write_private(directory / TOKEN_FILE, token)
    _write_private(directory / PORT_FILE, str(port))


def remove_access(run_dir: Path) -> None:
    """The process ends: its token and port no longer reach anything."""
    for name in (TOKEN_FILE, PORT_FILE):
        (Path(run_dir) / CONTROL_DIR / name).unlink(missing_ok=True)


def read_access(run_dir: Path) -> tuple[str, int]:
    """(token, port) of the run's endpoint; FileNotFoundError when the run serves none."""
    directory = Path(run_dir) / CONTROL_DIR
    token = (directory / TOKEN_FILE).read_text().strip()
    return token, int((directory / PORT_FILE).read_text().strip())


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask, and a leftover file's mode
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


class ControlRequests:
    """The token check and the request queue (module docstring). `events`: the run's event log;
    `token`: the one requests must carry (None: a fresh one). Thread-safe: `handle` runs on the HTTP
    server's threads, `take` on the training thread."""

    def __init__(self, events, token: str | None = None):
        self.token = token or secrets.token_urlsafe(32)
        self.events = events
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._refusals: dict[str, str] | None = None  # None until the run says what it can do

    def offer(self, refusals: dict[str, str]) -> None:
        """The run is ready for requests; `refusals`: action -> why this run cannot do it."""
        self._refusals = dict(refusals)

    def handle(self, method: str, path: str, authorization: str, remote: str = "") -> tuple[int, dict[str, Any]]:
        """Answer one HTTP request: (status, JSON body). Emits its `control_request` event."""
        action = path[len(PATH) :] if path.startswith(PATH) else path
        status, reason = self._judge(method, action, authorization)
        accepted = status == HTTPStatus.ACCEPTED
        if accepted:
            self._queue.put(action)
        self.events.emit(
            catalogue.CONTROL_REQUEST,
            action=action,
            accepted=accepted,
            status=int(status),
            remote=remote,
            **({} if accepted else {"reason": reason}),
        )
        return int(status), {"action": action, "accepted": accepted, "message": reason}

    def _judge(self, method: str, action: str, authorization: str) -> tuple[HTTPStatus, str]:
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return HTTPStatus.UNAUTHORIZED, "no token: send 'Authorization: Bearer <run dir>/control/token'"
        if not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            return HTTPStatus.FORBIDDEN, "wrong token: read it again from <run dir>/control/token"
        if method != "POST":
            return HTTPStatus.METHOD_NOT_ALLOWED, f"{method} changes nothing: actions are POST requests"
        if action not in ACTIONS:
            return HTTPStatus.NOT_FOUND, f"no action {action!r}: one of {', '.join(ACTIONS)}"
        refusals = self._refusals
        if refusals is None:
            return HTTPStatus.SERVICE_UNAVAILABLE, NOT_STARTED
        if action in refusals:
            return HTTPStatus.CONFLICT, refusals[action]
        return HTTPStatus.ACCEPTED, f"{action}: queued for the next step boundary"

    def take(self) -> list[str]:
        """The accepted requests not taken yet, oldest first (the training thread, at a step boundary)."""
        taken = []
        while True:
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                return taken

    def app(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        """The WSGI application of the `PATH` requests."""
        status, body = self.handle(
            environ.get("REQUEST_METHOD", ""),
            environ.get("PATH_INFO", ""),
            environ.get("HTTP_AUTHORIZATION", ""),
            environ.get("REMOTE_ADDR", ""),
        )
        start_response(f"{status} {HTTPStatus(status).phrase}", [("Content-Type", "application/json")])
        return [json.dumps(body).encode()]
