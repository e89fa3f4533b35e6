"""Greedy exact-match evaluation: the one accuracy every stage reports (``eval/accuracy``).

A model answers each held-out prompt greedily; the answer is correct when its first line
equals the label exactly. A conversational prompt is rendered with the model's chat template
and generation prompt (:func:`rlhf_core.data.formats.prompt_text`); generation stops at eos (the
end of the assistant's turn) and the answer is decoded without special tokens, so no template
marker reaches the comparison. The standard error ``sqrt(p (1 - p) / n)`` is reported with it,
since "alignment raised accuracy" means by more than two of those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from rlhf_core.data.formats import Text, is_conversational, prompt_text, read_prompt_examples
from rlhf_core.data.io import DataError, read_records
from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.synthetic import is_correct, parse_prompt


@dataclass
class EvalResult:
    """Accuracy of greedy answers on ``n`` items, with examples for a human to read."""

    accuracy: float
    stderr: float
    n: int
    samples: list[dict[str, str]] = field(default_factory=list)
    by_skill: dict[str, float] = field(default_factory=dict)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {f"{prefix}/accuracy": self.accuracy, f"{prefix}/accuracy_stderr": self.stderr,
               f"{prefix}/n_items": float(self.n)}
        out.update({f"{prefix}/accuracy_{skill}": acc for skill, acc in sorted(self.by_skill.items())})
        return out


def accuracy_with_stderr(correct: Sequence[bool]) -> tuple[float, float]:
    """Mean of a 0/1 vector and its binomial standard error ``sqrt(p (1-p) / n)``."""
    n = len(correct)
    if n == 0:
        return 0.0, 0.0
    p = sum(correct) / n
    return p, math.sqrt(p * (1.0 - p) / n)


@torch.no_grad()
def greedy_answers(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int,
                   batch_size: int, show_progress: bool = False) -> list[str]:
    """Greedy completions of ``prompts`` (left-padded batches, KV cache, stop at eos)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    outputs: list[str] = []
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="generate", disable=not show_progress or len(starts) < 3, leave=False):
        chunk = [encode_prompt(tokenizer, p) for p in prompts[start:start + batch_size]]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, ids in enumerate(chunk):  # left padding: every prompt ends at the same column
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention[i, width - len(ids):] = 1
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        outputs.extend(tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True))
    model.train(was_training)
    return outputs


def _question(prompt: Text) -> str:
    """The question a prompt asks: the text, or a conversation's last user message."""
    if not is_conversational(prompt):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def evaluate_exact_match(model: Any, tokenizer: Any, eval_file: str | Path, *, prompt_field: str = "prompt",
                         label_field: str = "label", max_items: int = 1000, max_new_tokens: int = 12,
                         batch_size: int = 256, n_samples: int = 8, show_progress: bool = False) -> EvalResult:
    """Greedy exact-match accuracy of ``model`` on the first ``max_items`` items of ``eval_file``."""
    examples = read_prompt_examples(read_records(eval_file, limit=max_items), eval_file, prompt_field=prompt_field,
                                    label_field=label_field)
    missing = [e.line for e in examples if e.label is None]
    if missing:
        raise DataError(eval_file, missing[0], "missing (needed for exact-match evaluation)", label_field)
    prompts = [prompt_text(tokenizer, e.prompt) for e in examples]
    labels = [str(e.label) for e in examples]
    answers = greedy_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             show_progress=show_progress)
    correct = [is_correct(a, y) for a, y in zip(answers, labels)]
    acc, se = accuracy_with_stderr(correct)
    # Per-skill accuracy for the embedded task (user prompts that parse as neither are skipped).
    groups: dict[str, list[bool]] = {}
    for example, ok in zip(examples, correct):
        problem = parse_prompt(_question(example.prompt))
        if problem is not None:
            groups.setdefault(problem.skill, []).append(ok)
    by_skill = {skill: accuracy_with_stderr(oks)[0] for skill, oks in groups.items()}
    samples = [{"prompt": p, "completion": a, "label": y, "correct": str(c)}
               for p, a, y, c in list(zip(prompts, answers, labels, correct))[:n_samples]]
    return EvalResult(acc, se, len(correct), samples, by_skill)
