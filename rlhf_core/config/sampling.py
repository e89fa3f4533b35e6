"""Sections of the stages that sample from a trained model without training it: best-of-n rejection sampling
(``rejection``) and greedy evaluation (``evaluate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf_core.config.base import _check
from rlhf_core.config.data import DataFields


@dataclass
class RejectionConfig(DataFields):
    """``rejection``: best-of-n sampling from a policy, scored by a reward model or the rule."""

    policy_path: str = "models/sft"
    """Policy that samples the candidates."""
    prompts_file: str = "data/embedded/prompts.jsonl"
    """Prompts (with labels when scoring by rule)."""
    scorer: str = "reward_model"
    """reward_model (uses reward_model_path) or rule (the label check against the label: ``label_check``'s
    function, exact match when it is empty)."""
    reward_model_path: str = "models/reward"
    """Reward model directory, for scorer=reward_model."""
    n_samples: int = 4
    """Candidates per prompt."""
    min_score: float = float("-inf")
    """A prompt's best candidate is kept (and its pair written) only when it scores at least this (a verifier's
    1.0: only right answers become RAFT's SFT data); -inf keeps every prompt's best."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 12
    """Generation budget per candidate."""
    max_prompts: int = 0
    """Use at most this many prompts (0: all)."""
    batch_size: int = 64
    """Prompts per generate call."""
    output_file: str = "data/rejection/best.jsonl"
    """Best candidate per prompt, as an SFT dataset (prompt, completion, score)."""
    pairs_file: str = "data/rejection/pairs.jsonl"
    """Best vs worst candidate as preference pairs (only where their scores differ)."""
    num_threads: int = 2
    """torch intra-op threads on CPU."""
    seed: int = 0
    """Sampling seed."""

    def __post_init__(self) -> None:
        s = "rejection"
        self._check_limits(s)
        _check(self.scorer in ("reward_model", "rule"), s, "scorer",
               f"must be reward_model or rule, got {self.scorer!r}")
        _check(self.n_samples >= 2, s, "n_samples", f"must be >= 2, got {self.n_samples}")
        _check(self.temperature > 0, s, "temperature", f"must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, s, "top_p", f"must be in (0, 1], got {self.top_p}")
        for name in ("max_new_tokens", "batch_size", "num_threads"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.max_prompts >= 0, s, "max_prompts", f"must be >= 0, got {self.max_prompts}")
        _check(not math.isnan(self.min_score), s, "min_score", "must be a number, got nan")


@dataclass
class EvalConfig(DataFields):
    """``evaluate``: greedy exact-match accuracy of a model on held-out prompts."""

    model_path: str = "models/sft"
    """HF model directory to evaluate."""
    eval_file: str = "data/embedded/eval.jsonl"
    """Held-out prompts with labels."""
    output_file: str = "metrics/eval_sft.json"
    """JSON file receiving accuracy, its standard error and the item count."""
    max_items: int = 1000
    """Evaluate on at most this many items (in file order)."""
    max_new_tokens: int = 12
    """Generation budget per answer (the longest embedded answer is 8 digits + eos)."""
    batch_size: int = 256
    """Prompts per generate call."""
    num_threads: int = 2
    """torch intra-op threads on CPU."""
    def __post_init__(self) -> None:
        self._check_limits("evaluate")
        for name in ("max_items", "max_new_tokens", "batch_size", "num_threads"):
            _check(getattr(self, name) >= 1, "evaluate", name, f"must be >= 1, got {getattr(self, name)}")
