"""A reasoning-gym item's label and the answer format: what the dataset writer puts in a prompt record's
``label`` and what the verifier (rlhf_core/rewards/gym.py) reads back, with the one rule for finding the answer
in a completion and the one rule for a well-formatted completion. Needs no reasoning-gym: the files it reads
and writes are plain JSON.

* **Label**: compact JSON ``{"answer": ..., "metadata": ..., "task": ...}`` (keys sorted), one string per item, so
  the gate checks it as any label (a non-blank string) and the verifier scores the item with its task's own scorer.
* **Extraction** (:func:`extract_answer`): the text of the last ``<answer>...</answer>`` when the completion has
  one (reasoning-gym's ``utils.extract_answer`` rule); else the last number (``-12``, ``3.5``, ``1,000``) in it;
  else its last whitespace-separated word with surrounding punctuation stripped; ``None`` for a blank completion.
* **Format** (:func:`formatted`): the completion, stripped, is exactly one number: the answer format the
  default ``instruction`` (" Answer with the number only.") asks for. :func:`formatted_answer` writes a reference
  answer in that format (the SFT file's completions).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_TAGGED = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?")
_BARE_NUMBER = re.compile(r"\A[-+]?\d+(?:\.\d+)?\Z")
_PUNCTUATION = ".,;:!?\"'()[]{}*`"


@dataclass(frozen=True)
class GymLabel:
    """One item's label: its task, reference answer and the metadata its scorer may read."""

    task: str
    answer: str
    metadata: dict[str, Any]

    def entry(self) -> dict[str, Any]:
        """The item as reasoning-gym's ``score_answer(answer, entry)`` reads it."""
        return {"answer": self.answer, "metadata": self.metadata}


def make_label(task: str, answer: Any, metadata: dict[str, Any]) -> str:
    """The label string of one item. A metadata value JSON has no type for is written as its ``str``
    (gsm_symbolic's ``Fraction`` variables: ``"3/4"``; its scorer reads the answer only); a NaN or infinity, or a
    key that is not a string, is a ``ValueError`` naming the task."""
    try:
        return json.dumps({"task": task, "answer": str(answer), "metadata": metadata}, sort_keys=True,
                          separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=str)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"task {task!r}: an item's metadata is not JSON-serialisable ({exc}), so its label could "
                         "not be scored from the file") from None


def parse_label(label: str | None) -> GymLabel:
    """The :class:`GymLabel` of a label string; a ``ValueError`` saying what is wrong with it."""
    if label is None:
        raise ValueError("no label: a reasoning-gym item's label names its task and reference answer")
    try:
        data = json.loads(label)
    except json.JSONDecodeError as exc:
        raise ValueError(f"label is not JSON ({exc.msg}): {label[:80]!r}") from None
    if not isinstance(data, dict) or not isinstance(data.get("task"), str) or "answer" not in data:
        raise ValueError(f"label is not a reasoning-gym label {{task, answer, metadata}}: {label[:80]!r}")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"label's metadata must be a mapping: {label[:80]!r}")
    return GymLabel(data["task"], str(data["answer"]), metadata)


def extract_answer(completion: str) -> str | None:
    """The answer a completion gives, by the rule in the module docstring."""
    tagged = _TAGGED.findall(completion)
    if tagged:
        return tagged[-1].strip()
    numbers = _NUMBER.findall(completion)
    if numbers:
        return numbers[-1]
    words = completion.split()
    return (words[-1].strip(_PUNCTUATION) or words[-1]) if words else None


def formatted(completion: str) -> bool:
    """Whether the completion is exactly an answer in the expected format: one bare number."""
    return bool(_BARE_NUMBER.match(completion.strip()))


def formatted_answer(answer: str) -> str:
    """A reference answer as a well-formatted completion writes it (the SFT file's completion)."""
    return str(answer).strip()
