"""Secret redaction: the one redaction function for error messages, logs, MLflow params/tags
and summary files.

:func:`redact_secrets` replaces values under secret-naming keys, credentials in URLs,
secret-looking query parameters, ``Bearer`` header values and every *registered* secret with
``***``. Every place alignflow writes something a user supplied (a config, a reward-server URL,
a tag, an exception's text) goes through it, so a token never lands in a tracking store, a log
or beside a model.

Patterns alone cannot find a secret once it is out of its URL (a 5xx page that echoes the
token, an exception that quotes it), so code that *holds* a secret registers the value:
:func:`register_secret` for a token read from an environment variable, :func:`register_url_secrets`
for the credentials and secret query values of a URL. The registry is process-wide and only
grows (a secret, once seen, stays scrubbed); values shorter than :data:`MIN_SECRET_LEN`
characters are not registered, since scrubbing them would mangle ordinary text.

Secrets reach alignflow only by environment-variable *name* (``reward_token_env``): a field
ending in ``_env`` holds such a name, so it is not itself redacted.

This module imports nothing from ``rlhf_core``, so any module can use it without creating an
import cycle.
"""

from __future__ import annotations

import base64
import re
import threading
from typing import Any
from urllib.parse import unquote, unquote_plus, urlsplit

_SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "apikey", "auth", "credential", "credentials"})
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)
_SECRET_KEY = r"[^=&#\s?]*(?:token|secret|pass|pwd|key|auth|sig|credential|session|jwt)[^=&#\s]*"
# The value stops short of trailing punctuation ("...?token=abc: failed" keeps its colon), and an
# already-redacted value is left alone, so redacting twice changes nothing.
_SECRET_QUERY = re.compile(rf"(?P<key>[?&]{_SECRET_KEY}=)(?!\*\*\*)[^&#\s'\")]*[^&#\s'\"):.,;]", re.IGNORECASE)
_BEARER = re.compile(r"(?P<scheme>\bBearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
REDACTED = "***"
MIN_SECRET_LEN = 6
"""Shorter values are not registered: scrubbing ``"abc"`` from every message would mangle text."""

_registered: set[str] = set()
_registry_lock = threading.Lock()  # reward calls may run in worker threads


def register_secret(value: str | None) -> None:
    """Scrub ``value`` (e.g. a token read from ``reward_token_env``) from every later
    :func:`redact_secrets` result, wherever it appears in the text."""
    if value and len(value) >= MIN_SECRET_LEN:
        with _registry_lock:
            _registered.add(value)


def register_url_secrets(url: str) -> None:
    """Register the password of ``user:pass@`` (also as Basic auth's base64) and the values of
    secret-looking query parameters of ``url``, raw and percent-decoded: once registered they are
    scrubbed even where they appear outside the URL (an echoed 5xx body, an exception message)."""
    parts = urlsplit(url)
    if parts.password:
        register_secret(parts.password)
        register_secret(unquote(parts.password))
        # requests sends user:pass@ as HTTP Basic auth; a server echoing its headers shows this form
        basic = f"{unquote(parts.username or '')}:{unquote(parts.password)}".encode("latin-1", "replace")
        register_secret(base64.b64encode(basic).decode())
    for pair in parts.query.split("&"):
        key, _, value = pair.partition("=")
        if value and re.fullmatch(_SECRET_KEY, unquote_plus(key), re.IGNORECASE):
            register_secret(value)
            register_secret(unquote_plus(value))


def _scrub(text: str) -> str:
    """``text`` with URL credentials, secret query values, auth header values and registered secrets replaced."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    text = _SECRET_QUERY.sub(lambda m: f"{m.group('key')}{REDACTED}", text)
    text = _BEARER.sub(lambda m: f"{m.group('scheme')}{REDACTED}", text)
    with _registry_lock:
        known = sorted(_registered, key=len, reverse=True)  # longest first: one secret may contain another
    for secret in known:
        text = text.replace(secret, REDACTED)
    return text


def redact_secrets(obj: Any, key: str = "") -> Any:
    """``obj`` with secrets replaced by ``***``: values under keys that name a secret (token,
    password, api_key, ... but not ``*_env``, which names a variable), credentials in URLs
    (``https://user:pass@host``), secret-looking query parameters (``?token=...``), ``Bearer``
    header values and every registered secret (:func:`register_secret`). Applied to everything
    alignflow writes to MLflow, to logs, to error messages and beside a model."""
    if isinstance(obj, dict):
        return {k: redact_secrets(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_secrets(v, key) for v in obj)
    if isinstance(obj, str):
        words = set(re.split(r"[_.\-\s]+", key.lower().replace("api_key", "apikey").replace("api-key", "apikey")))
        if obj and words & _SECRET_WORDS and not key.lower().endswith("_env"):
            return REDACTED
        return _scrub(obj)
    return obj


__all__ = ["MIN_SECRET_LEN", "REDACTED", "redact_secrets", "register_secret", "register_url_secrets"]
