"""Expected failures every CLI reports the same way: one line naming the input and the fix, exit 2.

`UserInputError` is the base of every error a user causes and can fix (a bad config key or value, bad
data, a missing file, an existing output). `tool_main` is the one error path of the command-line tools:
such an error prints `<prog>: error: <message>` and returns 2; anything else is a bug and keeps its
traceback (exit 1).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_BAD_INPUT = 2


class UserInputError(ValueError):
    """Input the user gave that cannot work; the message names the input and the fix."""


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
