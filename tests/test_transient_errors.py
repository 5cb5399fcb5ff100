"""Transient is never final: an error caused by the network or the object store exits 75 (restart me),
whatever the code that met it reported it as; what the user can fix stays 2, a bug stays 1.

The storage clients' own exception types are used (gcsfs, aiohttp, google-auth), raised the way the
trainer's code wraps them (`raise DataError(...) from None` keeps the context). The real client against
an unreachable endpoint, end to end: tests/test_run_safety_cli.py.
"""

from __future__ import annotations

import socket

import pytest

from trainer.data.errors import DataError
from trainer.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_TRANSIENT,
    UserInputError,
    exit_code_for,
    transient_cause,
)


def _reported_as(wrapper: type[Exception], cause: BaseException, *, hide: bool) -> Exception:
    """`wrapper` raised while handling `cause`, as `raise wrapper(...) from None` (hide) or plainly."""
    try:
        try:
            raise cause
        except BaseException:
            if hide:
                raise wrapper("cannot read shard gs://b/d/0.ar; regenerate it") from None
            raise wrapper("cannot read shard gs://b/d/0.ar; regenerate it")  # noqa: B904 - the context
    except Exception as e:  # noqa: BLE001
        return e


def _gcs_http(code: int) -> Exception:
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": "from the store"})


def _aiohttp_refused() -> Exception:
    import aiohttp

    key = type("Key", (), {"ssl": None, "host": "storage.googleapis.com", "port": 443})()
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connect call failed"))


def _google_auth_transport() -> Exception:
    from google.auth.exceptions import TransportError

    return TransportError("token refresh: connection aborted")


TRANSIENT = {
    "connection refused": lambda: ConnectionRefusedError(111, "refused"),
    "connection reset": lambda: ConnectionResetError(104, "reset by peer"),
    "timeout": lambda: TimeoutError("read timed out"),
    "name lookup to retry": lambda: socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
    "aiohttp (gcsfs) refused": _aiohttp_refused,
    "GCS 503": lambda: _gcs_http(503),
    "GCS 429": lambda: _gcs_http(429),
    "google-auth transport": _google_auth_transport,
    "tensorstore UNAVAILABLE": lambda: ValueError('Error reading "ocdbt": UNAVAILABLE: HTTP response code: 503'),
}
NOT_TRANSIENT = {
    "GCS 404": lambda: _gcs_http(404),
    "GCS 403": lambda: _gcs_http(403),
    "missing file": lambda: FileNotFoundError(2, "No such file"),
    "unknown host": lambda: socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
    "a plain ValueError": lambda: ValueError("shapes do not match"),
}


@pytest.mark.parametrize("name", TRANSIENT)
@pytest.mark.parametrize("hide", [True, False], ids=["from None", "in context"])
def test_a_data_error_caused_by_the_network_or_the_store_is_transient(name, hide):
    cause = TRANSIENT[name]()
    error = _reported_as(DataError, cause, hide=hide)
    assert transient_cause(error) is cause
    assert exit_code_for(error) == EXIT_TRANSIENT
    assert exit_code_for(cause) == EXIT_TRANSIENT


@pytest.mark.parametrize("name", NOT_TRANSIENT)
def test_what_a_retry_cannot_fix_keeps_its_code(name):
    cause = NOT_TRANSIENT[name]()
    assert transient_cause(cause) is None
    assert exit_code_for(_reported_as(DataError, cause, hide=True)) == EXIT_BAD_INPUT
    assert exit_code_for(_reported_as(UserInputError, cause, hide=False)) == EXIT_BAD_INPUT
    assert exit_code_for(cause) == EXIT_FAILED


def test_an_error_that_names_its_own_code_keeps_it():
    error = _reported_as(RuntimeError, ConnectionResetError(104, "reset"), hide=False)
    error.exit_code = 42  # a peer's failure ends this process with the code of its cause
    assert exit_code_for(error) == 42


def test_a_cycle_in_the_chain_ends():
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert transient_cause(a) is None
