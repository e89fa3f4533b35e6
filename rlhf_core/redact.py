"""Secret redaction: the one redaction function for error messages, logs, MLflow params/tags
and summary files.

:func:`redact_secrets` replaces values under secret-naming keys, credentials in URLs and
secret-looking query parameters with ``***``. Every place alignflow writes something a user
supplied (a config, a reward-server URL, a tag) goes through it, so a token never lands in a
tracking store or beside a model. This module imports nothing from ``rlhf_core``, so any module
can use it without creating an import cycle.
"""

from __future__ import annotations

import re
from typing import Any

_SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "apikey", "auth", "credential", "credentials"})
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)
_SECRET_QUERY = re.compile(r"(?P<key>[?&][^=&#\s]*(?:token|secret|password|key|auth|sig)[^=&#\s]*=)[^&#\s]+",
                           re.IGNORECASE)
REDACTED = "***"


def redact_secrets(obj: Any, key: str = "") -> Any:
    """``obj`` with secrets replaced by ``***``: values under keys that name a secret (token,
    password, api_key, ...), credentials in URLs (``https://user:pass@host``) and secret-looking
    query parameters (``?token=...``). Applied to everything alignflow writes to MLflow, to logs
    and beside a model, so a reward-server URL with a token never lands in a tracking store."""
    if isinstance(obj, dict):
        return {k: redact_secrets(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_secrets(v, key) for v in obj)
    if isinstance(obj, str):
        words = set(re.split(r"[_.\-\s]+", key.lower().replace("api_key", "apikey").replace("api-key", "apikey")))
        if obj and words & _SECRET_WORDS:
            return REDACTED
        obj = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", obj)
        return _SECRET_QUERY.sub(lambda m: f"{m.group('key')}{REDACTED}", obj)
    return obj


__all__ = ["REDACTED", "redact_secrets"]
