"""``gym_generate`` (and ``real_generate``, the real recipe's section of the same fields): datasets drawn from a
reasoning-gym task (rlhf_core/data/gym_tasks.py), its verifier scoring them (rlhf_core/rewards/gym.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlhf_core.config.base import _check

EXTRA_EVAL_KEYS = ("name", "task", "task_config", "size", "seed")
"""The keys of one ``extra_eval`` entry (``task_config`` may be left out: the task's defaults)."""
_NAME = re.compile(r"\A[a-z0-9_]{1,64}\Z")


@dataclass
class GymGenerateConfig:
    """``gym_generate``: write RL prompts, held-out eval items and SFT answers of a reasoning-gym task."""

    section: ClassVar[str] = "gym_generate"

    out_dir: str = "data/gym"
    """Folder that receives prompts.jsonl, eval.jsonl, sft.jsonl, eval_<name>.jsonl and manifest.json."""
    task: str = "basic_arithmetic"
    """reasoning-gym dataset name (``reasoning_gym.create_dataset``'s first argument)."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's config (its difficulty: ``min_digits``, ``max_terms`` ...); empty: its
    defaults."""
    train_seed: int = 1
    """Seed of the training draw (prompts.jsonl and sft.jsonl hold the same questions). Many reasoning-gym tasks
    draw item i from seed + i, so two seeds closer than the items drawn give the same items: keep the seeds of a
    task far apart (the overlap is skipped all the same, and counted in manifest.json)."""
    eval_seed: int = 1000000
    """Seed of the held-out draw (eval.jsonl); must differ from train_seed."""
    train_size: int = 1000
    """Training questions written (after dropping repeats and items of the held-out sets)."""
    eval_size: int = 300
    """Held-out questions written (after dropping repeats)."""
    instruction: str = " Answer with the number only."
    """Text appended to every question: the answer format the prompt asks for (the format the verifier's
    extraction and ``formatted`` expect, rlhf_core/data/gym_answers.py)."""
    conversational: bool = True
    """Write each prompt as one user message, so the policy's chat template renders it (RL, evaluation and
    SFT alike); false: the question as plain text."""
    extra_eval: list[dict[str, Any]] = field(default_factory=list)
    """Other held-out tasks, each ``{name, task, task_config, size, seed}``, written as eval_<name>.jsonl with
    the same instruction and form; training questions equal to any of their items are dropped too."""

    def __post_init__(self) -> None:
        s = self.section
        _check(bool(self.task.strip()), s, "task", "must name a reasoning-gym dataset, got an empty string")
        _check(isinstance(self.task_config, dict), s, "task_config",
               f"must be a mapping of the task's config fields, got {type(self.task_config).__name__}")
        _check(self.train_seed != self.eval_seed, s, "eval_seed",
               f"must differ from train_seed (both {self.eval_seed}): the held-out items come from their own draw")
        for name in ("train_size", "eval_size"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        names = [self._check_extra(i, e) for i, e in enumerate(self.extra_eval)]
        _check(len(set(names)) == len(names), s, "extra_eval", f"names must be unique, got {names}")

    def _check_extra(self, i: int, entry: Any) -> str:
        """One ``extra_eval`` entry's keys and values; returns its name."""
        s, where = self.section, f"extra_eval[{i}]"
        _check(isinstance(entry, dict), s, where, f"must be a mapping of {', '.join(EXTRA_EVAL_KEYS)}, got {entry!r}")
        unknown = sorted(set(entry) - set(EXTRA_EVAL_KEYS))
        _check(not unknown, s, where, f"unknown key(s) {unknown}; known: {', '.join(EXTRA_EVAL_KEYS)}")
        missing = [k for k in EXTRA_EVAL_KEYS if k != "task_config" and k not in entry]
        _check(not missing, s, where, f"missing key(s) {missing}")
        _check(isinstance(entry["name"], str) and bool(_NAME.match(entry["name"])), s, f"{where}.name",
               f"must be 1-64 characters of a-z, 0-9 and _ (it names eval_<name>.jsonl), got {entry['name']!r}")
        _check(isinstance(entry["task"], str) and bool(entry["task"].strip()), s, f"{where}.task",
               f"must name a reasoning-gym dataset, got {entry['task']!r}")
        _check(isinstance(entry.get("task_config", {}), dict), s, f"{where}.task_config",
               f"must be a mapping, got {entry.get('task_config')!r}")
        for key in ("size", "seed"):
            value = entry[key]
            _check(isinstance(value, int) and not isinstance(value, bool), s, f"{where}.{key}",
                   f"must be an integer, got {value!r}")
        _check(entry["size"] >= 1, s, f"{where}.size", f"must be >= 1, got {entry['size']}")
        _check(entry["task"] != self.task or entry["seed"] != self.train_seed, s, f"{where}.seed",
               f"must differ from train_seed ({self.train_seed}) for the training task {self.task!r}")
        return entry["name"]
