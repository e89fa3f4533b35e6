"""Greedy exact-match evaluation: the one accuracy every stage reports (``eval/accuracy``).

A model answers each held-out prompt greedily; the answer is correct when its first line
equals the label exactly. A conversational prompt is rendered with the model's chat template
and generation prompt (:func:`rlhf_core.data.formats.prompt_text`); generation stops at eos (the
end of the assistant's turn) and the answer is decoded without special tokens, so no template
marker reaches the comparison. The standard error ``sqrt(p (1 - p) / n)`` is reported with it,
since "alignment raised accuracy" means by more than two of those.

An eval file whose items carry no label at all (a user's own prompts) is answered all the same: the result
has no accuracy (``eval/n_items`` and the sample answers only; the stage's guards then judge the held-out
reward or a user's metric command, :mod:`rlhf_core.promotion.guards`). A file where some items have a label and
others not is an error naming the first unlabelled line (:func:`labels_present`).

Two fields of every stage's config (``label_check``, ``format_check``) change what is judged, never how the answers are made: a ``scorer``
(``file.py:function`` with a reward function's signature, e.g. a reasoning-gym task's verifier) replaces exact
match, an item being correct when it scores at least 1.0; a ``format_check`` (``file.py:function``, completion ->
bool) adds the rate of answers in the expected format and the accuracy among those (:func:`format_metrics`), so a
model that learns the format is told apart from one that learns the task.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from rlhf_core.data.formats import Text, is_conversational, labels_present, prompt_text, read_prompt_examples
from rlhf_core.data.io import read_records
from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.embedded.tasks import is_correct, parse_prompt
from rlhf_core.rewards.sources import FunctionRewardSource, load_function


@dataclass
class GreedyAnswers:
    """A model's greedy answers to the first ``max_items`` items of an eval file and the settings that made them:
    what lets the guard probe reuse a stage's final eval instead of generating the same answers again
    (:func:`rlhf_core.promotion.probe.reusable_answers`). ``device`` is the device type, ``dtype`` the parameters';
    ``adapters``: the model was a peft (LoRA) model, whose unmerged adapters may round otherwise than the saved
    merged weights."""

    eval_file: str
    max_items: int
    max_new_tokens: int
    batch_size: int
    prompt_field: str
    device: str
    dtype: str
    adapters: bool
    answers: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalResult:
    """Accuracy of greedy answers on ``n`` items (None: the items carry no labels), with examples for a human
    to read and every answer (``answers``)."""

    accuracy: float | None
    stderr: float | None
    n: int
    samples: list[dict[str, str]] = field(default_factory=list)
    by_skill: dict[str, float] = field(default_factory=dict)
    answers: GreedyAnswers | None = None
    formatting: dict[str, float] = field(default_factory=dict)
    """With a format check: format_rate, n_formatted and (labelled items) accuracy_formatted, each rate with its
    ``_stderr`` (:func:`format_metrics`); empty without one."""

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """``<prefix>/n_items`` and, on labelled items, accuracy, its standard error and per-skill accuracy
        (never a NaN accuracy: without labels there is none to log), and the format check's figures if any."""
        out = {f"{prefix}/n_items": float(self.n)}
        out.update({f"{prefix}/{name}": value for name, value in sorted(self.formatting.items())})
        if self.accuracy is None:
            return out
        out = {f"{prefix}/accuracy": self.accuracy, f"{prefix}/accuracy_stderr": float(self.stderr or 0.0), **out}
        out.update({f"{prefix}/accuracy_{skill}": acc for skill, acc in sorted(self.by_skill.items())})
        return out

    def stage_output(self) -> tuple[dict[str, float], list[dict[str, str]], dict[str, Any] | None]:
        """What a trainer's ``evaluate`` hands the loop: metrics, samples and the answers' record."""
        return self.metrics("eval"), self.samples, None if self.answers is None else self.answers.to_dict()


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


def format_metrics(formatted: Sequence[bool], correct: Sequence[bool] | None) -> dict[str, float]:
    """The share of answers in the expected format and, given each answer's correctness, the accuracy among those
    well formatted, each with its binomial standard error (0 for none formatted) and its count."""
    rate, rate_se = accuracy_with_stderr(formatted)
    out = {"format_rate": rate, "format_rate_stderr": rate_se, "n_formatted": float(sum(formatted))}
    if correct is not None:
        acc, acc_se = accuracy_with_stderr([ok for ok, fmt in zip(correct, formatted) if fmt])
        out.update({"accuracy_formatted": acc, "accuracy_formatted_stderr": acc_se})
    return out


def judged(label_check: str, prompts: Sequence[str], answers: Sequence[str], labels: Sequence[Any]) -> list[bool]:
    """Each answer's correctness: exact match with its label, or ``label_check`` (``file.py:function``, a reward
    function's signature) scoring it >= 1.0."""
    if not label_check:
        return [is_correct(a, y) for a, y in zip(answers, labels)]
    return [score >= 1.0 for score in FunctionRewardSource(label_check)(list(prompts), list(answers), list(labels))]


def eval_options(cfg: Any) -> dict[str, str]:
    """The fields of a stage's config (:class:`rlhf_core.config.DataFields`) that say what its evaluation reads
    and how it judges: passed to :func:`evaluate_exact_match` by every stage that evaluates."""
    return {"prompt_field": cfg.prompt_field, "label_field": cfg.label_field, "label_check": cfg.label_check,
            "format_check": cfg.format_check}


def _question(prompt: Text) -> str:
    """The question a prompt asks: the text, or a conversation's last user message."""
    if not is_conversational(prompt):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def evaluate_exact_match(model: Any, tokenizer: Any, eval_file: str | Path, *, prompt_field: str = "prompt",
                         label_field: str = "label", max_items: int = 1000, max_new_tokens: int = 12,
                         batch_size: int = 256, n_samples: int = 8, show_progress: bool = False, label_check: str = "",
                         format_check: str = "") -> EvalResult:
    """Greedy exact-match accuracy of ``model`` on the first ``max_items`` items of ``eval_file`` (no accuracy, the
    answers only, when no item has a label). ``label_check``: ``file.py:function`` judging correctness instead of
    exact match; ``format_check``: ``file.py:function`` (completion) -> bool, adding :func:`format_metrics`."""
    examples = read_prompt_examples(read_records(eval_file, limit=max_items), eval_file, prompt_field=prompt_field,
                                    label_field=label_field)
    labelled = labels_present([e.label for e in examples], [e.line for e in examples], eval_file, label_field)
    prompts = [prompt_text(tokenizer, e.prompt) for e in examples]
    answers = greedy_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             show_progress=show_progress)
    param = next(model.parameters())
    record = GreedyAnswers(str(eval_file), max_items, max_new_tokens, batch_size, prompt_field, param.device.type,
                           str(param.dtype), hasattr(model, "peft_config"), list(answers))
    check = load_function(format_check)[2] if format_check else None
    formatted = [bool(check(a)) for a in answers] if check is not None else None
    if not labelled:
        samples = [{"prompt": p, "completion": a} for p, a in list(zip(prompts, answers))[:n_samples]]
        return EvalResult(None, None, len(answers), samples, answers=record,
                          formatting=format_metrics(formatted, None) if formatted is not None else {})
    labels = [str(e.label) for e in examples]
    correct = judged(label_check, prompts, answers, labels)
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
    if formatted is None:
        return EvalResult(acc, se, len(correct), samples, by_skill, record)
    for sample, fmt in zip(samples, formatted):
        sample["formatted"] = str(fmt)
    return EvalResult(acc, se, len(correct), samples, by_skill, record, format_metrics(formatted, correct))
