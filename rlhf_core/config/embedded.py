"""The embedded default's sections: the arithmetic and sorting datasets (``generate``), the tiny model and its
tokenizer (``model``, ``tool_model``), and the tool task's data and evaluation (``tool_generate``,
``tool_evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlhf_core.config.base import _check


@dataclass
class GenerateConfig:
    """``generate``: write the embedded task's datasets."""

    out_dir: str = "data/embedded"
    """Folder that receives sft.jsonl, preferences.jsonl, prompts.jsonl and eval.jsonl."""
    seed: int = 1234
    """Seed of the problem draw and of the noisy demonstrations."""
    n_sft: int = 10000
    """Number of SFT demonstrations."""
    n_preference: int = 2000
    """Number of preference pairs (chosen correct, rejected a plausible error)."""
    n_prompts: int = 1000
    """Number of RL prompts with labels."""
    n_eval: int = 1000
    """Number of held-out evaluation items (disjoint from every training split)."""
    sft_noise: float = 0.25
    """Fraction of SFT demonstrations given a plausible wrong answer (scattered errors)."""
    sft_flaw: float = 0.6
    """Probability that a sorting demonstration of flaw_min_len+ digits is written in descending
    order: one systematic demonstrator mistake that greedy SFT imitates and alignment removes."""
    flaw_min_len: int = 6
    """Sorting inputs with at least this many digits are subject to the systematic flaw."""
    sort_fraction: float = 0.5
    """Fraction of problems that are digit sorting (the rest are arithmetic)."""
    sort_min_len: int = 3
    """Fewest digits in a sorting problem."""
    sort_max_len: int = 8
    """Most digits in a sorting problem."""
    ops: str = "+-*"
    """Operators of arithmetic problems (any of + - *)."""
    min_add: int = 0
    """Smallest operand of + and -."""
    max_add: int = 99
    """Largest operand of + and -."""
    min_mul_left: int = 0
    """Smallest left operand of *."""
    max_mul_left: int = 99
    """Largest left operand of *."""
    min_mul_right: int = 0
    """Smallest right operand of *."""
    max_mul_right: int = 9
    """Largest right operand of *."""

    def __post_init__(self) -> None:
        s = "generate"
        for name in ("n_sft", "n_preference", "n_prompts", "n_eval"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _check(0.0 <= self.sft_noise < 1.0, s, "sft_noise", f"must be in [0, 1), got {self.sft_noise}")
        _check(0.0 <= self.sft_flaw < 1.0, s, "sft_flaw", f"must be in [0, 1), got {self.sft_flaw}")
        _check(self.flaw_min_len >= 1, s, "flaw_min_len", f"must be >= 1, got {self.flaw_min_len}")
        _check(0.0 <= self.sort_fraction <= 1.0, s, "sort_fraction", f"must be in [0, 1], got {self.sort_fraction}")
        _check(1 <= self.sort_min_len <= self.sort_max_len, s, "sort_max_len",
               f"must be >= sort_min_len ({self.sort_min_len}) >= 1, got {self.sort_max_len}")
        _check(bool(self.ops) and set(self.ops) <= set("+-*"), s, "ops", f"must be a non-empty subset of '+-*', got {self.ops!r}")
        for lo, hi in (("min_add", "max_add"), ("min_mul_left", "max_mul_left"), ("min_mul_right", "max_mul_right")):
            _check(0 <= getattr(self, lo) <= getattr(self, hi), s, hi,
                   f"must be >= {lo} ({getattr(self, lo)}) and {lo} >= 0, got {getattr(self, hi)}")


@dataclass
class ModelConfig:
    """``init-model``: build the embedded tiny model and its tokenizer."""

    out_dir: str = "models/base"
    """Folder of the saved HF model directory (weights, config, tokenizer)."""
    corpus_file: str = "data/embedded/sft.jsonl"
    """JSONL whose prompt+completion text trains the tokenizer."""
    arch: str = "qwen2"
    """Architecture: qwen2 or llama (stock transformers classes)."""
    vocab_size: int = 320
    """Target BPE vocabulary size (byte alphabet + specials + merges)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 6
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 384
    """MLP hidden width."""
    max_positions: int = 64
    """Maximum sequence length the model supports."""
    seed: int = 0
    """Seed of the weight initialisation."""
    added_tokens: list[str] = field(default_factory=list)
    """Strings added to the tokenizer as single (non-special) tokens, e.g. a tool call's tags; empty: none."""

    def __post_init__(self) -> None:
        s = "model"
        _check(all(isinstance(t, str) and t and not t.isspace() for t in self.added_tokens), s, "added_tokens",
               f"must be non-blank strings, got {self.added_tokens!r}")
        _check(self.arch in ("qwen2", "llama"), s, "arch", f"must be 'qwen2' or 'llama', got {self.arch!r}")
        _check(self.vocab_size >= 260, s, "vocab_size", f"must be >= 260 (byte alphabet + specials), got {self.vocab_size}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.hidden_size % self.num_heads == 0, s, "hidden_size",
               f"must be divisible by num_heads ({self.num_heads}), got {self.hidden_size}")
        _check(self.num_heads % self.num_kv_heads == 0, s, "num_kv_heads",
               f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")


@dataclass
class ToolGenerateConfig:
    """``tool_generate``: write the tool task's datasets."""

    section: ClassVar[str] = "tool_generate"

    out_dir: str = "data/tool"
    """Folder that receives sft.jsonl, prompts.jsonl and eval.jsonl."""
    seed: int = 4321
    """Seed of the problem draw and of the demonstrator's choices."""
    n_sft: int = 10000
    """Number of SFT demonstrations."""
    n_prompts: int = 1000
    """Number of RL prompts with labels."""
    n_eval: int = 500
    """Number of held-out evaluation items (disjoint from the other splits)."""
    skip_tool: float = 0.7
    """Fraction of demonstrations that skip the calculator and answer directly (a guess)."""
    guess_noise: float = 0.5
    """Fraction of those guesses that are a plausible wrong answer."""
    ops: str = "+-*"
    """Operators (any of + - *)."""
    max_add: int = 99
    """Largest operand of + and - (smallest: 0)."""
    max_mul_left: int = 99
    """Largest left operand of * (smallest: 0)."""
    max_mul_right: int = 9
    """Largest right operand of * (smallest: 0)."""

    def __post_init__(self) -> None:
        s = self.section
        for name in ("n_sft", "n_prompts", "n_eval"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("skip_tool", "guess_noise"):
            _check(0.0 <= getattr(self, name) <= 1.0, s, name, f"must be in [0, 1], got {getattr(self, name)}")
        _check(bool(self.ops) and set(self.ops) <= set("+-*"), s, "ops", f"must be some of '+-*', got {self.ops!r}")


@dataclass
class ToolEvalConfig:
    """``tool_evaluate``: greedy multi-turn accuracy and tool-call rate on held-out items."""

    section: ClassVar[str] = "tool_evaluate"

    eval_file: str = "data/tool/eval.jsonl"
    """Held-out prompts with labels."""
    max_items: int = 500
    """Items evaluated (the first of the file)."""
    max_turns: int = 2
    """Model turns per trajectory."""
    max_trajectory_tokens: int = 32
    """Response tokens per trajectory (turns and observations)."""
    max_new_tokens: int = 24
    """Tokens per model turn."""
    num_threads: int = 2
    """torch intra-op threads on CPU."""

    def __post_init__(self) -> None:
        for name in ("max_items", "max_turns", "max_trajectory_tokens", "max_new_tokens", "num_threads"):
            _check(getattr(self, name) >= 1, self.section, name, f"must be >= 1, got {getattr(self, name)}")
