"""reasoning-gym's verifier as a reward file and an evaluation scorer.

Name it in a config as ``rlhf_core/rewards/gym.py:reward`` (``reward.function`` of RL or rejection sampling, or
``label_check`` of any stage that evaluates), and its format rule as ``rlhf_core/rewards/gym.py:formatted``
(``format_check``). ``rlhf_core/rewards/gym.py:formatted_reward`` scores only answers in the format the prompt
asks for (0.0 otherwise): as an RL reward it keeps the policy from drifting into longer answers whose last
number happens to be right.
Each label is one written by ``alignflow gym-generate`` (:func:`rlhf_core.data.gym_answers.make_label`): the
task's name, reference answer and metadata. The answer is taken from the completion by
:func:`rlhf_core.data.gym_answers.extract_answer` and scored by the task's own ``score_answer`` (1.0 right, 0.0
wrong; some tasks give partial credit, gsm_symbolic 0.01 for a wrong number). Loaded by file path, so it imports
only what a standalone file can; reasoning-gym is imported on the first call (the real-model extra).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rlhf_core.data.gym_answers import extract_answer, formatted, parse_label
from rlhf_core.data.gym_tasks import reasoning_gym

__all__ = ["formatted", "formatted_reward", "reward", "scorer"]

_SCORERS: dict[str, Callable[[str | None, dict[str, Any]], float]] = {}


def scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The task's ``score_answer(answer, entry)`` (its dataset class with the default config), kept per task."""
    if task not in _SCORERS:
        try:
            _SCORERS[task] = reasoning_gym().get_score_answer_fn(task)
        except ValueError as exc:  # an unknown name
            raise ValueError(f"label names task {task!r}, which reasoning-gym has no scorer for: {exc}") from None
    return _SCORERS[task]


def reward(prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str | None]) -> list[float]:
    """The task's score of the answer each completion gives (every sample needs a reasoning-gym label)."""
    out = []
    for i, (completion, raw) in enumerate(zip(completions, labels)):
        try:
            label = parse_label(raw)
        except ValueError as exc:
            raise ValueError(f"sample {i}: {exc}") from None
        out.append(float(scorer(label.task)(extract_answer(completion), label.entry())))
    return out


def formatted_reward(prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str | None]) -> list[float]:
    """:func:`reward` for completions in the expected format (:func:`formatted`), 0.0 for any other."""
    scores = reward(prompts, completions, labels)
    return [score if formatted(completion) else 0.0 for score, completion in zip(scores, completions)]
