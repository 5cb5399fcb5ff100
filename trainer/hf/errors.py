"""The errors a user can fix that the Hugging Face readers raise, and how they word a cause.

Shared by every reader in `trainer/hf/` (directories, safetensors headers, config.json, token ids,
checkpoint configs), so one message shape and one exception type reach the CLI's "one line, exit 2" path.
"""

from __future__ import annotations

from trainer.errors import UserInputError


class MissingInput(UserInputError, FileNotFoundError):
    """A path the user named does not exist, or lacks the file the command reads there. Still a
    FileNotFoundError for callers that catch that; a UserInputError for the CLI (one line, exit 2)."""


def why(e: BaseException) -> str:
    """The first line of an exception's message (KeyError with its type, whose message is only the key)."""
    return f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e).strip().splitlines()[0]


def hf_error(message: str) -> Exception:
    """trainer.model.hf.HfFormatError, imported when raised: the CLI's input checks stay free of jax."""
    from trainer.model.hf import HfFormatError

    return HfFormatError(message)
