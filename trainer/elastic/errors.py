"""Elastic outcomes that end a run."""

from trainer.errors import GaveUp, TransientError


class ElasticGiveUp(GaveUp):
    """Failures came faster than the run progressed (exit 3); the newest committed checkpoint is intact."""


class SlicesUnavailable(TransientError):
    """Too few slices came back within elastic_timeout_seconds (exit 75: a restart of the job may get new
    ones); the newest committed checkpoint is intact."""
