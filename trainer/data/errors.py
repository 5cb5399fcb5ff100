"""The one exception type for unusable data; the CLI turns it into exit code 2 before training."""

from trainer.errors import UserInputError


class DataError(UserInputError):
    """Data that cannot be trained on. The message names the file or field and the fix."""
