"""Dataset sections: the field names of a user's dataset (shared by every stage that reads one) and the data
report's thresholds (``data_report``, ``tool_data_report``)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config.base import _check


MAX_LINE_BYTES = 16 * 1024 * 1024
"""The longest JSON Lines line read unless a caller sets another (``DataFields.max_line_bytes``)."""


@dataclass
class DataFields:
    """Field names of a user's dataset (renamable so user data needs no conversion)."""

    prompt_field: str = "prompt"
    """Field holding the prompt text."""
    completion_field: str = "completion"
    """Field holding the target completion (SFT)."""
    messages_field: str = "messages"
    """Field holding a chat as a list of {role, content}; used when present instead of prompt/completion."""
    label_field: str = "label"
    """Field holding the checkable answer (RL prompts, eval)."""
    label_check: str = ""
    """How an answer is judged against its label in every evaluation (a stage's eval, ``evaluate``, the guard
    probe): empty, exact match of the answer's first line; else ``file.py:function`` with a reward function's
    signature (prompts, completions, labels) -> scores, an item being correct when it scores >= 1.0 (a
    reasoning-gym task: rlhf_core/rewards/gym.py:reward)."""
    format_check: str = ""
    """Empty: none. Else ``file.py:function`` (completion) -> bool, whether an answer is in the expected format;
    evaluations then add the format rate and the accuracy among well-formatted answers, each with its standard
    error and count (a reasoning-gym task: rlhf_core/rewards/gym.py:formatted)."""
    chosen_field: str = "chosen"
    """Field holding the preferred response (preference pairs)."""
    rejected_field: str = "rejected"
    """Field holding the dispreferred response (preference pairs)."""
    margin_field: str = "margin"
    """Optional numeric field: how much better chosen is than rejected."""
    max_field_chars: int = 20000
    """Longest text field (a message list: its contents together) the dataset gate accepts, in characters."""
    max_line_bytes: int = MAX_LINE_BYTES
    """Longest JSON Lines line read, in bytes, checked before parsing: a longer line is refused unread."""

    def __post_init__(self) -> None:
        self._check_limits("data")

    def _check_limits(self, s: str) -> None:
        """The size limits' and the checks' specs, for the ``__post_init__`` of each config built on these fields."""
        for name in ("max_field_chars", "max_line_bytes"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("label_check", "format_check"):
            spec = getattr(self, name)
            _check(not spec or (".py:" in spec and not spec.endswith(":")), s, name,
                   f"must be empty or 'path/to/file.py:function', got {spec!r}")


@dataclass
class DataReportConfig:
    """``data_report``: near-duplicate, eval-contamination and drift checks on every dataset a flow or a
    training stage command trains on (rlhf_core/data/report.py); a check over its threshold stops it before
    training. ``tool_data_report``: the same for the tool task's stage commands (``--section tool_*``)."""

    max_duplicate_prompt_rate: float = 0.25
    """Most rows whose normalised prompt repeats an earlier row's (embedded default: 0)."""
    max_repeated_chosen_rate: float = 0.6
    """Most rows whose normalised chosen text (completion, for SFT data) repeats an earlier row's
    (embedded default: 0.30 in preferences, 0.48 in sft: the task's answers are short numbers)."""
    max_near_duplicate_rate: float = 0.05
    """Most rows equal to an earlier row after normalisation (case, Unicode form, whitespace); exact
    duplicates are already refused by the gate (embedded default: 0)."""
    check_contamination: bool = True
    """Refuse any training prompt found in the eval set: exact match after normalisation, or a shared
    word n-gram for prompts of at least ngram words."""
    ngram: int = 13
    """Word n-gram length of the contamination overlap test (GPT-3's: 13)."""
    max_mean_drift: float = 0.5
    """Cycles: most relative change of a text field's mean length against the previous cycle's data
    (0.5: a mean of 10 may move to between 5 and 15)."""

    def __post_init__(self) -> None:
        s = "data_report"
        for name in ("max_duplicate_prompt_rate", "max_repeated_chosen_rate", "max_near_duplicate_rate"):
            value = getattr(self, name)
            _check(0.0 <= value <= 1.0, s, name, f"must be a rate in [0, 1], got {value}")
        _check(self.ngram >= 1, s, "ngram", f"must be >= 1, got {self.ngram}")
        _check(self.max_mean_drift >= 0, s, "max_mean_drift", f"must be >= 0, got {self.max_mean_drift}")
