"""The embedded task: deterministic, disjoint splits, plausible wrong answers, checkable rewards."""

from __future__ import annotations

import json
import random

from rlhf_core.tracking.lineage import file_md5
from rlhf_core.embedded.tasks import (
    flawed_answer,
    Problem,
    ProblemSpace,
    SortProblem,
    generate_datasets,
    is_correct,
    parse_prompt,
    rule_reward,
    wrong_answer,
)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generation_is_byte_identical_for_a_seed(tmp_path):
    kwargs = dict(seed=3, n_sft=200, n_preference=50, n_prompts=50, n_eval=50, sft_noise=0.3)
    a = generate_datasets(tmp_path / "a", **kwargs)
    b = generate_datasets(tmp_path / "b", **kwargs)
    assert {k: file_md5(v) for k, v in a.items()} == {k: file_md5(v) for k, v in b.items()}
    c = generate_datasets(tmp_path / "c", **{**kwargs, "seed": 4})
    assert file_md5(c["sft"]) != file_md5(a["sft"])


def test_splits_are_disjoint_and_labels_correct(tmp_path):
    paths = generate_datasets(tmp_path, seed=1, n_sft=500, n_preference=100, n_prompts=100, n_eval=100,
                              sft_noise=0.0)
    prompts = {name: {r["prompt"] for r in _rows(p)} for name, p in paths.items()}
    names = list(prompts)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            assert not prompts[x] & prompts[y], (x, y)
    for r in _rows(paths["eval"]):
        assert str(parse_prompt(r["prompt"]).answer) == r["label"]
    # noise 0: every demonstration is right
    assert all(is_correct(r["completion"], str(parse_prompt(r["prompt"]).answer)) for r in _rows(paths["sft"]))


def test_noise_fraction_and_preference_pairs(tmp_path):
    paths = generate_datasets(tmp_path, seed=2, n_sft=2000, n_preference=200, n_prompts=10, n_eval=10,
                              sft_noise=0.25)
    wrong = sum(r["completion"] != str(parse_prompt(r["prompt"]).answer) for r in _rows(paths["sft"]))
    assert 0.21 < wrong / 2000 < 0.29
    for r in _rows(paths["preferences"]):
        right = str(parse_prompt(r["prompt"]).answer)
        assert r["chosen"] == right and r["rejected"] != right
        assert abs(len(r["rejected"]) - len(r["chosen"])) <= 1  # similar length: answer, not shape, differs


def test_wrong_answer_is_the_classic_mistake():
    """247+185: carries dropped -> 2+1=3, 4+8=12->2, 7+5=12->2 -> 322. 402-185 borrows dropped -> 383."""
    rng = random.Random(0)
    assert wrong_answer(Problem(247, "+", 185), rng) == 322
    assert wrong_answer(Problem(402, "-", 185), rng) == 383
    assert wrong_answer(SortProblem("3211"), rng) in ("1213", "1132")  # sorted 1123, a neighbouring pair swapped
    assert wrong_answer(SortProblem("777"), rng) == "778"
    for a in range(0, 100, 7):
        for b in range(0, 10):
            for op in "+-*":
                p = Problem(a, op, b)
                assert wrong_answer(p, rng) != p.answer


def test_rule_reward_and_parsing():
    assert rule_reward(["2+2="], [" 4\nextra"], ["4"]) == [1.0]
    assert rule_reward(["2+2=", "3*3="], ["5", "9"], ["4", "9"]) == [0.0, 1.0]
    assert parse_prompt("12*3=") == Problem(12, "*", 3)
    assert parse_prompt("hello") is None
    assert parse_prompt("sort 5281=") == SortProblem("5281")
    assert SortProblem("5281").answer == "1258"


def test_exhausted_problem_space_is_a_clear_error(tmp_path):
    import pytest

    tiny = ProblemSpace(sort_fraction=0.0, ops="+", min_add=0, max_add=9)  # 100 problems
    with pytest.raises(ValueError, match="nearly exhausted"):
        generate_datasets(tmp_path, seed=0, n_sft=200, n_preference=1, n_prompts=1, n_eval=1, sft_noise=0.0,
                          space=tiny)


def test_systematic_flaw_on_long_sorts(tmp_path):
    """sft_flaw=0.6, noise 0: long sorts (>= 6 digits) are descending ~60% of the time (the
    rest correct); short sorts and arithmetic are always right. Preference pairs on long sorts
    reject the descending answer with probability 0.6 / (0.6 + 0.4 * 0) = 1."""
    paths = generate_datasets(tmp_path, seed=2, n_sft=3000, n_preference=300, n_prompts=10, n_eval=10,
                              sft_noise=0.0, sft_flaw=0.6, flaw_min_len=6)
    long_rows, other = [], []
    for r in _rows(paths["sft"]):
        p = parse_prompt(r["prompt"])
        (long_rows if isinstance(p, SortProblem) and len(p.digits) >= 6 else other).append((p, r["completion"]))
    assert all(c == str(p.answer) for p, c in other)
    backwards = [c == flawed_answer(p) for p, c in long_rows if flawed_answer(p) is not None]
    assert 0.55 < sum(backwards) / len(backwards) < 0.65
    for r in _rows(paths["preferences"]):
        p = parse_prompt(r["prompt"])
        if isinstance(p, SortProblem) and len(p.digits) >= 6 and flawed_answer(p) is not None:
            assert r["rejected"] == flawed_answer(p)
    assert flawed_answer(SortProblem("5281")) == "8521"
    assert flawed_answer(SortProblem("777")) is None  # descending == ascending: no flaw possible
    assert flawed_answer(Problem(2, "+", 3)) is None
