"""The config package's one exception type for bad configuration (exit code 2): `trainer.errors.ConfigError`,
defined with the exit-code contract so the failure kinds below this package raise the same class."""

from trainer.errors import ConfigError

__all__ = ["ConfigError"]
