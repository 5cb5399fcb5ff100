"""Elastic outcomes that end a run."""


class ElasticGiveUp(RuntimeError):
    """Retries exhausted or slices did not return in time; the newest committed checkpoint is intact."""
