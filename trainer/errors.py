"""The exit-code contract with the scheduler, and the expected failures every CLI reports the same way.

On a cluster the exit code is the whole conversation with Kubernetes or Slurm, so every way a run ends
maps to one code, the same on every process of a job for the same cause:

    code  status         meaning                                              the scheduler should
    0     finished       reached `steps` (or `target_eval_loss`)              complete the job
    1     failed         a bug or an unknown error                            restart a few times, then fail
    2     bad_input      config, data, a path, a checkpoint that does not     fail at once, never retry
                         match the config, a run directory another job holds
    3     gave_up        failures came faster than the run progressed         fail at once
    42    preempted      stopped from outside (SIGTERM: drain, Spot, time     restart, using up no budget
                         limit); the newest state it held is saved
    75    transient      infrastructure failed (storage, a lost peer that     restart, from a generous
                         did not come back in time, a save that kept          counted budget
                         failing); everything left resumable

42 and 75 sit outside the shell's (126, 127) and signals' (128 + n) codes; 75 is sysexits' EX_TEMPFAIL
("temporary failure; the user is invited to retry"). The deploy manifests (`scripts/deploy/`) map each
code, and `tests/test_manifest_semantics.py` checks what Kubernetes and Slurm do with every one.

`UserInputError` is the base of every error a user causes and can fix (a bad config key or value, bad
data, a missing file, an existing output); `ConfigError` and `DataError` are the two whose STATUS line
names them. `TransientError` is the base of failures that a restart of
the same command can get past, and so is any error whose chain holds a network or object-store failure
(`transient_cause`: a refused or reset connection, a timeout, an HTTP 408/429/5xx from Cloud Storage, a
`UNAVAILABLE` from tensorstore), after the storage clients' own bounded retries (gcsfs: 6 tries with
backoff; tensorstore and google-cloud-storage likewise): reading a data shard or opening the run
directory while the store is away exits 75, never 2. `tool_main` is the one error path of the
command-line tools: a user error prints `<prog>: error: <message>` and returns 2; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Callable, Iterator

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_GAVE_UP = 3
EXIT_PREEMPTED = 42
EXIT_TRANSIENT = 75
# The tools' own outcome, outside the trainer's contract: `python -m trainer.compile` compiled the program but
# it does not fit the chip's memory.
EXIT_DOES_NOT_FIT = 4

# (code, status word printed on the STATUS line and in the `finish` event, meaning) for docs and tests.
EXIT_CODES = (
    (EXIT_OK, "finished", "reached steps (or target_eval_loss)"),
    (EXIT_FAILED, "failed", "a bug or an unknown error"),
    (EXIT_BAD_INPUT, "bad_input", "bad config, data, path or checkpoint; a run directory held by another job"),
    (EXIT_GAVE_UP, "gave_up", "failures came faster than the run progressed"),
    (EXIT_PREEMPTED, "preempted", "stopped from outside (SIGTERM); the newest state is saved: restart me"),
    (EXIT_TRANSIENT, "transient", "infrastructure failed; everything is resumable: restart me"),
)


class UserInputError(ValueError):
    """Input the user gave that cannot work; the message names the input and the fix."""


class ConfigError(UserInputError):
    """A config key, value or combination that cannot run (STATUS: config_error). The message names the key
    and the fix. Defined here, below every package, so the grammars the config validates with (the fault
    schedule, data mixtures) raise it without importing the config package."""


class DataError(UserInputError):
    """Data that cannot be trained on (STATUS: data_error). The message names the file or field and the
    fix. Defined here so the config's data-mixture grammar raises it without importing the data package."""


class TransientError(RuntimeError):
    """Infrastructure failed (storage, a peer, memory) in a way a restart of the same command can get past;
    nothing the run saved was changed by it."""


class GaveUp(RuntimeError):
    """Failures came faster than the run progressed: restarting the same command would not help."""


# HTTP statuses a retry can get past: timeout, rate limit, server errors.
_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})
# absl status codes in tensorstore's (and gRPC's) messages that mean "try again".
_TRANSIENT_STATUS = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|ABORTED): ")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then its causes and contexts (those a `raise ... from None` hides too), each once."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, TransientError | ConnectionError | TimeoutError):
        return True
    if isinstance(e, socket.gaierror):
        return e.errno == socket.EAI_AGAIN  # a name lookup that may work next time
    # The storage clients' own errors, from the modules already loaded (none is imported for this).
    for module, names in (
        ("aiohttp", ("ClientConnectionError", "ClientPayloadError", "ServerTimeoutError")),
        ("google.auth.exceptions", ("TransportError",)),
        ("google.api_core.exceptions", ("ServerError", "TooManyRequests", "RequestTimeout")),
        ("requests.exceptions", ("ConnectionError", "Timeout")),
        ("urllib3.exceptions", ("ProtocolError", "TimeoutError")),
    ):
        mod = sys.modules.get(module)
        types = tuple(t for n in names if isinstance(t := getattr(mod, n, None), type))
        if types and isinstance(e, types):
            return True
    http = sys.modules.get("gcsfs.retry")
    if http is not None and isinstance(e, getattr(http, "HttpError", ())):
        return getattr(e, "code", None) in _TRANSIENT_HTTP
    return type(e) is ValueError and bool(_TRANSIENT_STATUS.search(str(e)))  # tensorstore's status errors


def transient_cause(error: BaseException) -> BaseException | None:
    """The network or object-store failure in `error`'s chain that a restart can get past, if any."""
    return next((e for e in _chain(error) if _is_transient(e)), None)


def exit_code_for(error: BaseException) -> int:
    """The contract's code for an error that ends a run (an error may carry its own `exit_code`: a peer's
    failure ends this process with the code of its cause). An error caused by a network or object-store
    failure is transient (75), whatever it was reported as (a data shard that could not be read)."""
    code = getattr(error, "exit_code", None)
    if isinstance(code, int):
        return code
    if transient_cause(error) is not None:
        return EXIT_TRANSIENT
    if isinstance(error, UserInputError):
        return EXIT_BAD_INPUT
    if isinstance(error, GaveUp):
        return EXIT_GAVE_UP
    if isinstance(error, TransientError):
        return EXIT_TRANSIENT
    return EXIT_FAILED


def tool_main(prog: str, fn: Callable[[], int | None]) -> int:
    """Run a tool's body; expected input errors become one line on stderr and exit 2."""
    try:
        return int(fn() or 0)
    except UserInputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
