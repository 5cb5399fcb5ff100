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
data, a missing file, an existing output). `TransientError` is the base of failures that a restart of
the same command can get past. `tool_main` is the one error path of the command-line tools: a user
error prints `<prog>: error: <message>` and returns 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

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


class TransientError(RuntimeError):
    """Infrastructure failed (storage, a peer, memory) in a way a restart of the same command can get past;
    nothing the run saved was changed by it."""


class GaveUp(RuntimeError):
    """Failures came faster than the run progressed: restarting the same command would not help."""


def exit_code_for(error: BaseException) -> int:
    """The contract's code for an error that ends a run (an error may carry its own `exit_code`: a peer's
    failure ends this process with the code of its cause)."""
    code = getattr(error, "exit_code", None)
    if isinstance(code, int):
        return code
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
