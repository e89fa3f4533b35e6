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

# Every pattern here runs on text of any length (a 2 MB dataset row, a 5xx page), so each is written to
# cost time linear in the text: a match may start only where nothing can extend it to the left (the
# lookbehinds), and no quantifier gives back what it took (possessive ``*+``/``++``). A pattern that
# restarts at every letter of a long run and scans to its end is quadratic: that is what these avoid.
# tests/unit/test_redact_linear.py holds each one to linear growth on long adversarial strings.

# ``scheme://user:pass@``: the scheme is a run of [a-z0-9+.-] with a letter in it, matched from the run's
# first character (never from inside it), so a run of letters is scanned once, not once per letter.
_URL_USERINFO = re.compile(r"(?<![a-z0-9+.-])(?P<scheme>[0-9+.-]*+[a-z][a-z0-9+.-]*+://)[^/@\s]++@", re.IGNORECASE)
_KEYWORDS = "token|secret|pass|pwd|key|auth|sig|credential|session|jwt"
_KEYWORD = re.compile(_KEYWORDS, re.IGNORECASE)
# A query key is ``[?&]`` then characters other than ``=&#`` and white space, up to its ``=``; it names a
# secret when a keyword stands in it before any further ``?``. A segment is one maximal run of key
# characters that ends at ``=``, found from its first character only.
_KEY_SEGMENT = re.compile(r"(?<![^=&#\s])[^=&#\s]*+=")
_KEY_CHARS_ONLY = re.compile(r"[^=&#\s]*+")
# A value runs to ``&``, ``#``, white space, a quote or ``)``, less trailing punctuation ("...?token=abc:
# failed" keeps its colon).
_VALUE_RUN = re.compile(r"[^&#\s'\")]*+")
_VALUE_TAIL = ":.,;"
_BEARER = re.compile(r"(?P<scheme>\bBearer\s++)[A-Za-z0-9._~+/=-]++", re.IGNORECASE)
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
        if value and _is_secret_key(unquote_plus(key)):
            register_secret(value)
            register_secret(unquote_plus(value))


def _is_secret_key(key: str) -> bool:
    """Whether a whole query key (without its ``?``/``&`` and ``=``) names a secret."""
    if _KEY_CHARS_ONLY.fullmatch(key) is None:
        return False
    first_q = key.find("?")
    return _KEYWORD.search(key, 0, len(key) if first_q < 0 else first_q) is not None


def _secret_key_start(text: str, begin: int, end: int, floor: int) -> int:
    """Where the leftmost secret-naming key of the segment ``text[begin:end]`` starts (its ``?`` or the
    ``&`` just before the segment), at or after ``floor``; -1 if none. Each ``?`` opens a piece that runs to
    the next ``?``; the key is the piece holding the segment's first keyword."""
    first_q = text.find("?", max(begin, floor), end)
    if begin > 0 and text[begin - 1] == "&" and begin - 1 >= floor:
        if _KEYWORD.search(text, begin, end if first_q < 0 else first_q):
            return begin - 1
    if first_q < 0:
        return -1
    word = _KEYWORD.search(text, first_q + 1, end)
    return -1 if word is None else text.rfind("?", first_q, word.start())


def _scrub_query_values(text: str) -> str:
    """``text`` with the value of every secret-naming query key (``?token=...``, ``&api_key=...``)
    replaced, left to right; a value already ``***`` is left alone, so redacting twice changes nothing."""
    out, done = [], 0
    for seg in _KEY_SEGMENT.finditer(text):
        begin, eq = seg.start(), seg.end() - 1
        start = _secret_key_start(text, begin, eq, done)
        if start < 0 or text.startswith(REDACTED, eq + 1):
            continue
        run_end = _VALUE_RUN.match(text, eq + 1).end()
        value_end = eq + 1 + len(text[eq + 1:run_end].rstrip(_VALUE_TAIL))
        if value_end == eq + 1:
            continue
        out += [text[done:eq + 1], REDACTED]
        done = value_end
    return "".join(out) + text[done:] if out else text


def _scrub_patterns(text: str) -> str:
    """``text`` with URL credentials, secret query values and auth header values replaced."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    text = _scrub_query_values(text)
    return _BEARER.sub(lambda m: f"{m.group('scheme')}{REDACTED}", text)


def _scrub(text: str) -> str:
    """``text`` with URL credentials, secret query values, auth header values and registered secrets
    replaced; time linear in ``len(text)`` (times the number of registered secrets)."""
    text = _scrub_patterns(text)
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
