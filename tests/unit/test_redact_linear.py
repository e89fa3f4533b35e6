"""Redaction costs time linear in its input and redacts exactly what the original patterns did.

The reference below is the three patterns redaction used before it was made linear. They are
the specification of *what* is redacted (every secrets test was written against them), and they
are quadratic on long runs (a run of letters, ``?`` followed by ``token`` repeated), so the
differential test feeds both only short strings, drawn from the characters the patterns care
about. The scaling tests then hold the linear version to the growth the issue sets: for each
adversarial family, the time for 400k characters under 3x the time for 200k, and under a second.
"""

from __future__ import annotations

import re
import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.common import redact
from rlhf_core.data.report import offline
from rlhf_core.common.redact import REDACTED, _is_secret_key, _scrub_patterns, redact_secrets

_REF_KEY = r"[^=&#\s?]*(?:token|secret|pass|pwd|key|auth|sig|credential|session|jwt)[^=&#\s]*"
_REF_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)
_REF_QUERY = re.compile(rf"(?P<key>[?&]{_REF_KEY}=)(?!\*\*\*)[^&#\s'\")]*[^&#\s'\"):.,;]", re.IGNORECASE)
_REF_BEARER = re.compile(r"(?P<scheme>\bBearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)


def _reference(text: str) -> str:
    text = _REF_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    text = _REF_QUERY.sub(lambda m: f"{m.group('key')}{REDACTED}", text)
    return _REF_BEARER.sub(lambda m: f"{m.group('scheme')}{REDACTED}", text)


# Pieces that make the patterns branch: markers, terminators, keywords, a scheme, letters, digits,
# case and Unicode case-folding corners (the Kelvin sign folds to 'k', the long s to 's').
_PIECES = st.sampled_from(["?", "&", "=", "#", " ", "\n", ":", "/", "@", ".", ",", ";", "'", '"', ")", "*",
                           "***", "+", "-", "a", "Z", "0", "9", "token", "TOKEN", "api_key", "Secret", "pass",
                           "key", "sig", "ses", "://", "https://", "u:p@", "Bearer ", "bearer\t", "\u212a", "\u017f",
                           "é"])
_TEXT = st.lists(_PIECES, max_size=40).map("".join)


@settings(max_examples=400, derandomize=True)
@given(_TEXT)
def test_linear_patterns_redact_exactly_what_the_reference_did(text):
    assert _scrub_patterns(text) == _reference(text)


@settings(max_examples=200, derandomize=True)
@given(_TEXT)
def test_redacting_twice_changes_nothing(text):
    once = redact_secrets(text)
    assert redact_secrets(once) == once


@settings(max_examples=200, derandomize=True)
@given(_TEXT)
def test_secret_key_rule_matches_the_reference(key):
    assert _is_secret_key(key) == (re.fullmatch(_REF_KEY, key, re.IGNORECASE) is not None)


def test_redaction_before_clipping_leaves_no_part_of_a_secret():
    """A secret at the clip point is gone whole: the excerpt redacts first, then clips."""
    from rlhf_core.data.validate import VALUE_CHARS, excerpt

    value = "x" * (VALUE_CHARS - 10) + "?token=SUPERSECRETVALUE123 tail"
    shown = excerpt(3, {"prompt": value})
    assert "SUPERS" not in shown and "line 3" in shown


N = 200_000
FAMILIES = {
    "run of letters": lambda n: "a" * n,
    "scheme-like run": lambda n: "a+" * (n // 2),
    "URL user part": lambda n: "https://" + "u" * n + "@host/",
    "URL user part, no @": lambda n: "https://" + "u" * n,
    "digits before ://": lambda n: "1" * n + "://x@y",
    "?token= value": lambda n: "https://h/?token=" + "v" * n,
    "? then token repeated": lambda n: "?" + "token" * (n // 5),
    "?token repeated, no =": lambda n: "?token" * (n // 6),
    "?token repeated, = last": lambda n: "?token" * (n // 6) + "=",
    "? then x repeated, = last": lambda n: "?x" * (n // 2) + "=v",
    "trailing punctuation": lambda n: "?token=a" + ":" * n,
    "Bearer value": lambda n: "Authorization: Bearer " + "b" * n,
    "Bearer then blanks": lambda n: "Bearer" + " " * n,
    "runs of a.": lambda n: "a." * (n // 2),
    "runs of x ": lambda n: "x " * (n // 2),
    "runs of <img ": lambda n: "<img " * (n // 5),
}


def _median_times(fn, small: str, large: str, repeats: int = 7) -> tuple[float, float]:
    """Median seconds of ``fn`` on each input, the two measured alternately so that load from
    other processes falls on both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for text, out in ((small, times[0]), (large, times[1])):
            start = time.perf_counter()
            fn(text)
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _every_path(text: str) -> None:
    """Everything a long user string can meet: the redactor (patterns and registry) and the data
    report's offline filter."""
    redact_secrets(text)
    offline(text)


@pytest.mark.parametrize("family", FAMILIES)
def test_time_grows_linearly(family):
    """Doubling the input less than triples the median time (plus 2 ms of timer noise: linear
    cases take milliseconds), and 400k characters take under a second. A quadratic pattern
    takes seconds at 16k characters and hours at 2 MB."""
    make = FAMILIES[family]
    small, large = _median_times(_every_path, make(N), make(2 * N))
    assert large < 1.0, f"{family}: {large:.3f} s for {2 * N} characters"
    assert large < 3 * small + 0.002, f"{family}: {small:.4f} s -> {large:.4f} s when doubled"


def test_long_inputs_still_redacted():
    """The linear patterns still find secrets in long text, at both ends."""
    redact.register_secret("REGISTERED-SECRET-VALUE")
    text = ("https://bob:hunter2@h/ " + "a" * N + " https://h/?api_key=K3Y&x=1 Bearer abc.def "
            + "z" * N + " REGISTERED-SECRET-VALUE")
    out = redact_secrets(text)
    for secret in ("hunter2", "K3Y", "abc.def", "REGISTERED-SECRET-VALUE"):
        assert secret not in out
    assert out.count(REDACTED) == 4 and "&x=1" in out
