"""Pushing a run's artifacts into MLflow's artifact store (on the team profile: through the tracking server into
the object store behind it).

A push that fails -- the object store unreachable, the server answering 500 -- is one :class:`ArtifactPushFailed`
naming what was pushed, the server and why, instead of MLflow's exception and traceback. The stage or registration
stops there: a flow registers nothing from the run and moves no alias (tasks/registry.py pushes the model before it
makes the version). Transient for Prefect: the store may be back for the retry.
"""

from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rlhf_core.common.redact import redact_secrets


class ArtifactPushFailed(RuntimeError):
    """An artifact or model could not be pushed into the run's artifact store."""


def failure_reason(exc: BaseException, limit: int = 300) -> str:
    """The root cause of a failed request in a few words (``[Errno 111] Connection refused``, ``too many 500 error
    responses``, ``ConnectionResetError(104, 'Connection reset by peer')``), else the exception's type and the first
    ``limit`` characters of its text."""
    # an error class's name is bounded ({1,60}): an unbounded \w+ makes the search quadratic on a long word
    found = re.search(r"\[Errno -?\d+\] [^'\")\]]+|too many \d+ error responses|\b\w{1,60}Error\(-?\d+, '[^']+'\)",
                      str(exc))
    return found.group(0).strip() if found else f"{type(exc).__name__}: {str(exc)[:limit]}"


@contextmanager
def pushing(what: str, run_id: str, uri: str) -> Iterator[None]:
    """Run the block that pushes ``what`` (an artifact file, a model) of run ``run_id`` to MLflow at ``uri``; a failure
    of the push becomes :class:`ArtifactPushFailed`."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow (only when something is pushed)

    try:
        yield
    except (MlflowException, OSError) as exc:  # requests' errors are OSErrors
        raise ArtifactPushFailed(redact_secrets(
            f"{what} of MLflow run {run_id} could not be pushed to the artifact store through {uri}; nothing is "
            f"registered from this run and no alias moves ({failure_reason(exc, 60)}). Check the object store behind "
            "the server (alignflow services status on the team profile), then run again.")) from exc


def pushes(method: Callable[..., Any]) -> Callable[..., Any]:
    """A tracker's upload ``method(self, obj, artifact_file, ...)`` run inside :func:`pushing`."""

    @functools.wraps(method)
    def push(self: Any, obj: Any, artifact_file: str, *args: Any, **kwargs: Any) -> Any:
        with pushing(artifact_file, self.run_id, self.client.tracking_uri):
            return method(self, obj, artifact_file, *args, **kwargs)

    return push
