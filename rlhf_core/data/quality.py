"""Pure data-quality checks behind the data report: normalisation, eval contamination,
near-duplicates and drift between two datasets.

No GX, MLflow or Prefect here: :mod:`rlhf_core.data.report` turns these per-row flags and
statistics into Great Expectations expectations, and tests call them with hand-made strings.

* **Normalisation** (:func:`normalize`): Unicode NFKC, case-folded, whitespace runs collapsed to
  one space, ends stripped. Punctuation is kept on purpose: in the embedded task ``47+85=`` and
  ``47-85=`` are different prompts, and stripping operators would call them duplicates.
* **Contamination** (:class:`EvalIndex`): a training prompt is contaminated when its normalised
  text equals an eval prompt's, or, for prompts of at least ``n`` words, when it shares a word
  ``n``-gram with an eval prompt (``n = 13``: the GPT-3 paper's overlap test, Brown et al. 2020,
  appendix C).
* **Near-duplicates** (:func:`repeats`): a row repeats when its key (a normalised prompt, chosen
  text, or the whole normalised example) equals an earlier row's; the rate is the fraction of
  such rows, so a file holding one example ``k`` times has rate ``(k-1)/k``.
* **Drift** (:func:`relative_change`, :func:`drift_bounds`): a statistic's change against the
  previous cycle's, relative to the previous value's size.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

NGRAM = 13
"""Word n-gram length of the overlap test (GPT-3's contamination analysis)."""
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed and stripped: ``"  Sort\\t 52 ="`` -> ``"sort 52 ="``."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_of(value: Any) -> str:
    """The text of a field: a string as is; a message list as its contents, one per line."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(str(m.get("content", "")) for m in value if isinstance(m, dict))
    return "" if value is None else str(value)


def word_ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The word ``n``-grams of the normalised ``text`` (none when it has fewer than ``n`` words)."""
    words = normalize(text).split(" ")
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)} if len(words) >= n else set()


class EvalIndex:
    """The eval set's normalised prompts and word n-grams, to test training prompts against."""

    def __init__(self, eval_prompts: Iterable[str], n: int = NGRAM):
        self.n = n
        self.exact: set[str] = set()
        self.grams: set[tuple[str, ...]] = set()
        for prompt in eval_prompts:
            self.exact.add(normalize(prompt))
            self.grams |= word_ngrams(prompt, n)

    def exact_match(self, prompt: str) -> bool:
        """The normalised prompt is an eval prompt."""
        return normalize(prompt) in self.exact

    def ngram_overlap(self, prompt: str) -> bool:
        """A prompt of at least ``n`` words shares a word ``n``-gram with some eval prompt."""
        return not self.grams.isdisjoint(word_ngrams(prompt, self.n))


def repeats(keys: Sequence[Hashable]) -> list[bool]:
    """``True`` for each key equal to an earlier one: ``[a, b, a, a]`` -> ``[F, F, T, T]``."""
    seen: set[Hashable] = set()
    flags = []
    for key in keys:
        flags.append(key in seen)
        seen.add(key)
    return flags


def rate(flags: Sequence[bool]) -> float:
    """The fraction of ``True`` flags (0 for none)."""
    return sum(flags) / len(flags) if flags else 0.0


def relative_change(previous: float, current: float) -> float:
    """``|current - previous| / max(|previous|, 1e-9)``: 10 -> 15 is 0.5."""
    return abs(current - previous) / max(abs(previous), 1e-9)


def drift_bounds(previous: float, max_change: float) -> tuple[float, float]:
    """The values within ``max_change`` relative change of ``previous``: 10, 0.5 -> (5, 15)."""
    span = max_change * abs(previous)
    return previous - span, previous + span
