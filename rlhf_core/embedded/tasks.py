"""The embedded default task: two digit skills whose answers a rule can check.

* **arithmetic**: ``"47+85="`` -> ``"132"`` (+, - and *; the exact integer answer);
* **sorting**: ``"sort 5281="`` -> ``"1258"`` (the digits in ascending order).

A tiny transformer learns sorting within a minute or two of CPU training but arithmetic
(carries, borrows) much more slowly, so after a short SFT the model is good at one skill
and weak at the other — which leaves visible room for alignment, and per-skill metrics
show where it went. Because every answer is checkable, one seed yields every dataset an
alignment pipeline needs, with no download:

* SFT demonstrations from a flawed demonstrator: a configurable fraction of them wrong in the
  ways a weak student is wrong (carries dropped, borrows dropped, a factor off by one, two
  digits swapped), and one *systematic* flaw: long sorting inputs (``flaw_min_len`` digits
  or more) are written in descending order with probability ``sft_flaw``. Scattered errors
  mostly wash out under greedy decoding; a consistent one made more often than not does
  not, so the SFT model sorts long inputs backwards and only a preference or reward signal
  (which always prefers the right answer) can remove it — the gap alignment is meant to
  close, in miniature;
* preference pairs (chosen = correct, rejected = what the flawed demonstrator wrote instead:
  the descending order where its flaw applies, else one of the plausible errors; same
  format, similar length, so a reward model must read the answer, not the shape);
* RL prompts with their labels, for rule rewards;
* a held-out evaluation set disjoint from all of the above.

Generation is deterministic in the seed: the same config writes byte-identical files, which
is what lets ``dvc repro`` reproduce the md5s in ``dvc.lock``.

Run: ``alignflow generate``.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from rlhf_core.common.atomic_io import write_text_atomic

OPS = ("+", "-", "*")
_ARITH_RE = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*$")
_SORT_RE = re.compile(r"^\s*sort\s+(\d+)\s*=\s*$")


@dataclass(frozen=True)
class Problem:
    """One arithmetic question ``a op b``."""

    a: int
    op: str
    b: int

    skill = "arithmetic"

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        return self.a * self.b


@dataclass(frozen=True)
class SortProblem:
    """Sort a string of decimal digits ascending."""

    digits: str

    skill = "sort"

    @property
    def prompt(self) -> str:
        return f"sort {self.digits}="

    @property
    def answer(self) -> str:
        return "".join(sorted(self.digits))


Task = Problem | SortProblem


def parse_prompt(prompt: str) -> Task | None:
    """Inverse of ``.prompt``; ``None`` when the text is neither task's prompt."""
    match = _ARITH_RE.match(prompt)
    if match is not None:
        return Problem(int(match.group(1)), match.group(2), int(match.group(3)))
    match = _SORT_RE.match(prompt)
    return SortProblem(match.group(1)) if match is not None else None


def normalize_completion(completion: str) -> str:
    """The answer part of a completion: first line, whitespace stripped."""
    stripped = completion.strip()
    return stripped.splitlines()[0].strip() if stripped else ""


def is_correct(completion: str, label: str | int) -> bool:
    """Exact match of a completion's answer against the label."""
    return normalize_completion(completion) == str(label).strip()


def rule_reward(
    prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str]
) -> list[float]:
    """Verifiable reward: 1.0 for an exact answer, 0.0 otherwise.

    Signature ``(prompts, completions, labels) -> rewards`` is the one every rule reward
    file follows, so this function is also the embedded task's reward file.
    """
    del prompts  # the label already carries the answer
    return [1.0 if is_correct(c, y) else 0.0 for c, y in zip(completions, labels, strict=True)]


# --------------------------------------------------------------------------------------
# Plausible wrong answers
# --------------------------------------------------------------------------------------


def _digitwise(a: int, b: int, combine) -> int:
    """Apply ``combine`` to aligned decimal digits with no carry or borrow between them."""
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    digits = [combine(int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0)
              for i in range(width)]
    return int("".join(str(d) for d in reversed(digits)))


def flawed_answer(problem: Task) -> str | None:
    """The demonstrator's systematic mistake on ``problem``, or ``None`` where it has none.

    Sorting: the digits in *descending* order (same length and multiset as the answer),
    unless that happens to equal the answer (all digits equal).
    """
    if isinstance(problem, SortProblem):
        backwards = "".join(sorted(problem.digits, reverse=True))
        return backwards if backwards != problem.answer else None
    return None


def wrong_answer(problem: Task, rng: random.Random) -> int | str:
    """A wrong answer a weak student plausibly gives, of similar length to the right one.

    Sorting: two neighbouring output digits swapped (or, where they are equal, one digit
    nudged), so the length and the multiset of digits look right at a glance.

    ``+``: carries dropped (247+185 -> 322); ``-``: borrows dropped, digit-wise absolute
    difference (402-185 -> 383); ``*``: one factor off by one (23*7 -> 23*8). When the
    systematic error happens to give the right answer (no carry occurred), one digit is
    nudged by one instead.
    """
    if isinstance(problem, SortProblem):
        out = list(problem.answer)
        if len(set(out)) == 1:
            out[-1] = str((int(out[-1]) + 1) % 10)
            return "".join(out)
        i = rng.choice([j for j in range(len(out) - 1) if out[j] != out[j + 1]])
        out[i], out[i + 1] = out[i + 1], out[i]
        return "".join(out)
    a, b, right = problem.a, problem.b, problem.answer
    if problem.op == "+":
        guess = _digitwise(a, b, lambda x, y: (x + y) % 10)
    elif problem.op == "-":
        guess = _digitwise(a, b, lambda x, y: abs(x - y))
        guess = guess if right >= 0 else -guess
    else:
        guess = a * (b + rng.choice((-1, 1))) if b > 1 else (a + 1) * b
    if abs(len(str(guess)) - len(str(right))) > 1:  # 10+90 -> "00": too easy to spot by length
        guess = right
    if guess == right:
        text = str(abs(right))
        pos = rng.randrange(len(text))
        digit = int(text[pos])
        new = (digit + 1) % 10 if pos or digit != 9 else digit - 1
        if pos == 0 and new == 0 and len(text) > 1:
            new = digit - 1 if digit > 1 else digit + 1
        guess = int(text[:pos] + str(new) + text[pos + 1 :]) * (1 if right >= 0 else -1)
    return guess


# --------------------------------------------------------------------------------------
# Dataset generation
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProblemSpace:
    """Which problems exist: the skill mix and inclusive operand ranges."""

    sort_fraction: float = 0.5
    ops: str = "+-*"
    min_add: int = 0
    max_add: int = 99
    min_mul_left: int = 0
    max_mul_left: int = 99
    min_mul_right: int = 0
    max_mul_right: int = 9
    sort_min_len: int = 3
    sort_max_len: int = 8

    def draw(self, rng: random.Random) -> Task:
        """One problem: a sorting one with probability ``sort_fraction``, else arithmetic."""
        if rng.random() < self.sort_fraction:
            n = rng.randint(self.sort_min_len, self.sort_max_len)
            return SortProblem("".join(str(rng.randrange(10)) for _ in range(n)))
        op = rng.choice(self.ops)
        if op == "*":
            return Problem(rng.randint(self.min_mul_left, self.max_mul_left), op,
                           rng.randint(self.min_mul_right, self.max_mul_right))
        return Problem(rng.randint(self.min_add, self.max_add), op, rng.randint(self.min_add, self.max_add))


def sample_problems(n: int, rng: random.Random, space: ProblemSpace, exclude: set[Task]) -> list[Task]:
    """Draw ``n`` distinct problems not in ``exclude`` (and add them to it)."""
    out: list[Task] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(
                f"could not draw {n} new problems ({len(exclude)} already taken): the problem space is "
                "nearly exhausted; widen the operand ranges or lower the dataset sizes"
            )
        p = space.draw(rng)
        if p not in exclude:
            exclude.add(p)
            out.append(p)
    return out


def write_jsonl(rows: Iterable[dict], path: Path) -> Path:
    """Write rows as JSON lines atomically (a half-written file never appears at ``path``)."""
    return write_text_atomic(path, (json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows))


def generate_datasets(
    out_dir: Path,
    *,
    seed: int,
    n_sft: int,
    n_preference: int,
    n_prompts: int,
    n_eval: int,
    sft_noise: float,
    sft_flaw: float = 0.0,
    flaw_min_len: int = 6,
    space: ProblemSpace = ProblemSpace(),
) -> dict[str, Path]:
    """Write ``sft.jsonl``, ``preferences.jsonl``, ``prompts.jsonl`` and ``eval.jsonl``.

    A demonstration of a problem the flaw applies to (sorting, ``flaw_min_len`` digits or
    more) is the flawed answer with probability ``sft_flaw``; any other demonstration is a
    plausible wrong answer with probability ``sft_noise``. A preference pair's rejected
    response is drawn the same way, conditioned on being wrong.

    Splits are disjoint by problem, so no evaluation item is ever trained on.
    Returns the written paths by split name.
    """
    if not 0.0 <= sft_noise < 1.0:
        raise ValueError(f"sft_noise must be in [0, 1), got {sft_noise}")
    if not 0.0 <= sft_flaw < 1.0:
        raise ValueError(f"sft_flaw must be in [0, 1), got {sft_flaw}")
    rng = random.Random(seed)
    taken: set[Problem] = set()
    # Eval first so that its draw does not depend on the training-set sizes.
    eval_set = sample_problems(n_eval, rng, space, taken)
    sft = sample_problems(n_sft, rng, space, taken)
    prefs = sample_problems(n_preference, rng, space, taken)
    prompts = sample_problems(n_prompts, rng, space, taken)

    def flaw_of(p: Task) -> str | None:
        flawed = flawed_answer(p)
        return flawed if flawed is not None and len(p.digits) >= flaw_min_len else None  # type: ignore[union-attr]

    def sft_row(p: Task) -> dict:
        flawed = flaw_of(p)
        if flawed is not None and rng.random() < sft_flaw:
            answer: int | str = flawed
        else:
            answer = wrong_answer(p, rng) if rng.random() < sft_noise else p.answer
        return {"prompt": p.prompt, "completion": str(answer)}

    def pref_row(p: Task) -> dict:
        flawed = flaw_of(p)
        # The flawed demonstrator's share of wrong answers on this problem is its flaw.
        share = sft_flaw / (sft_flaw + (1 - sft_flaw) * sft_noise) if flawed is not None and sft_flaw else 0.0
        rejected = flawed if flawed is not None and rng.random() < share else wrong_answer(p, rng)
        return {"prompt": p.prompt, "chosen": str(p.answer), "rejected": str(rejected)}

    def label_row(p: Task) -> dict:
        return {"prompt": p.prompt, "label": str(p.answer)}

    out_dir = Path(out_dir)
    return {
        "sft": write_jsonl((sft_row(p) for p in sft), out_dir / "sft.jsonl"),
        "preferences": write_jsonl((pref_row(p) for p in prefs), out_dir / "preferences.jsonl"),
        "prompts": write_jsonl((label_row(p) for p in prompts), out_dir / "prompts.jsonl"),
        "eval": write_jsonl((label_row(p) for p in eval_set), out_dir / "eval.jsonl"),
    }
