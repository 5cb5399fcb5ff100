"""The data package's one exception type for unusable data (exit code 2): `trainer.errors.DataError`,
defined with the exit-code contract so the config's data-mixture grammar raises the same class."""

from trainer.errors import DataError

__all__ = ["DataError"]
