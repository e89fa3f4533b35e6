"""How a training stage run in a child process (:mod:`tasks.worker`) fails.

A module of its own, importing nothing, so that both the worker and the retry rule in
:mod:`tasks.common` can name these without importing each other.
"""

from __future__ import annotations


class StageProcessDied(RuntimeError):
    """The stage's process ended without a result (killed, crashed); transient: Prefect retries."""


class StageRejected(RuntimeError):
    """The stage refused its input (bad data, bad config, bad model): permanent, never retried."""
