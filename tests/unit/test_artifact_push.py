"""artifact_push.failure_reason: the root cause of a failed push in a few words, for the one error line a user sees."""

from __future__ import annotations

import pytest

from rlhf_core.tracking.artifact_push import failure_reason


@pytest.mark.parametrize("text, reason", [
    ("HTTPConnectionPool(host='127.0.0.1', port=9): Max retries exceeded (Caused by NewConnectionError("
     "'<conn>: Failed to establish a new connection: [Errno 111] Connection refused'))", "[Errno 111] Connection refused"),
    ("API request to endpoint /api/2.0/mlflow-artifacts failed: too many 500 error responses",
     "too many 500 error responses"),
    ("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))",
     "ConnectionResetError(104, 'Connection reset by peer')"),
])
def test_the_root_cause_is_named(text, reason):
    assert failure_reason(OSError(text)) == reason


def test_an_unknown_failure_gives_its_type_and_the_start_of_its_text():
    assert failure_reason(ValueError("x" * 1000), limit=20) == "ValueError: " + "x" * 20
