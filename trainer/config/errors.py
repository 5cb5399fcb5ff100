"""The one exception type for bad configuration; the CLI turns it into exit code 2."""

from trainer.errors import UserInputError


class ConfigError(UserInputError):
    """A config key, value or combination that cannot run. The message names the key and the fix."""
