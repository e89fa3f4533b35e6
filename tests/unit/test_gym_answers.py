"""The reasoning-gym plumbing that needs no reasoning-gym: labels, answer extraction, the format rule, the
``gym_generate`` config's checks, and the missing-package refusal. (With the package: tests/e2e/test_gym_tasks.py.)"""

from __future__ import annotations

import json
import sys
from fractions import Fraction

import pytest

from rlhf_core.config import ConfigError, GymGenerateConfig, build_config, load_config
from rlhf_core.data.gym_answers import extract_answer, formatted, formatted_answer, make_label, parse_label
from rlhf_core.data.gym_tasks import prompt_of, reasoning_gym
from conftest import REPO


def test_label_round_trips_compact_and_sorted():
    label = make_label("products", 42, {"expression": "6 * 7", "num_terms": 2})
    assert label == '{"answer":"42","metadata":{"expression":"6 * 7","num_terms":2},"task":"products"}'
    parsed = parse_label(label)
    assert (parsed.task, parsed.answer) == ("products", "42")
    assert parsed.entry() == {"answer": "42", "metadata": {"expression": "6 * 7", "num_terms": 2}}


def test_label_writes_a_value_json_lacks_as_its_str_and_refuses_nan():
    assert json.loads(make_label("gsm_symbolic", 3, {"ratio": Fraction(3, 4)}))["metadata"] == {"ratio": "3/4"}
    with pytest.raises(ValueError, match="gsm_symbolic.*not JSON-serialisable"):
        make_label("gsm_symbolic", 3, {"x": float("nan")})


@pytest.mark.parametrize("label, message", [
    (None, "no label"), ("42", "not a reasoning-gym label"), ("{oops", "not JSON"),
    ('{"task": "t", "answer": "1", "metadata": [1]}', "metadata must be a mapping"),
])
def test_parse_label_refuses_what_is_not_a_gym_label(label, message):
    with pytest.raises(ValueError, match=message):
        parse_label(label)


@pytest.mark.parametrize("completion, answer", [
    ("42", "42"),
    ("  -17\n", "-17"),
    ("12 + 30 = 42.", "42"),                       # the last number
    ("It is 1,000 apples", "1,000"),
    ("<answer>7</answer> then 8", "7"),            # a tagged answer wins over later numbers
    ("<answer>1</answer><answer> 2 </answer>", "2"),  # the last tag (reasoning-gym's rule)
    ("The answer is yes.", "yes"),                 # no number: the last word, punctuation stripped
    ("", None),
    ("   ", None),
])
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("completion, ok", [
    ("42", True), (" -3\n", True), ("3.5", True), ("+7", True),
    ("42.", False), ("The answer is 42", False), ("1,000", False), ("<answer>4</answer>", False), ("", False),
])
def test_formatted_is_one_bare_number(completion, ok):
    assert formatted(completion) is ok


def test_formatted_answer_is_formatted():
    assert formatted(formatted_answer(" -56 ")) and formatted_answer(" -56 ") == "-56"


def test_prompt_is_the_question_and_instruction_as_a_user_message_or_text():
    assert prompt_of("Calculate 2 + 3.", " Answer with the number only.", True) == [
        {"role": "user", "content": "Calculate 2 + 3. Answer with the number only."}]
    assert prompt_of("Calculate 2 + 3.", "", False) == "Calculate 2 + 3."


def test_equal_seeds_are_refused_naming_both_fields():
    with pytest.raises(ConfigError, match=r"real_generate\.eval_seed: must differ from train_seed"):
        build_config(GymGenerateConfig, "real_generate", {"train_seed": 5, "eval_seed": 5}, "params.yaml")


@pytest.mark.parametrize("extra, message", [
    ({"name": "x", "task": "chain_sum", "size": 3}, r"missing key\(s\) \['seed'\]"),
    ({"name": "x", "task": "chain_sum", "size": 3, "seed": 1, "n": 2}, r"unknown key\(s\) \['n'\]"),
    ({"name": "Bad Name", "task": "chain_sum", "size": 3, "seed": 9}, r"extra_eval\[0\]\.name"),
    ({"name": "x", "task": "chain_sum", "size": 0, "seed": 9}, r"extra_eval\[0\]\.size: must be >= 1"),
    ({"name": "x", "task": "basic_arithmetic", "size": 3, "seed": 1}, r"extra_eval\[0\]\.seed: must differ"),
    ({"name": "x", "task": "chain_sum", "task_config": [1], "size": 3, "seed": 9}, r"extra_eval\[0\]\.task_config"),
])
def test_extra_eval_entries_are_checked(extra, message):
    with pytest.raises(ConfigError, match=message):
        GymGenerateConfig(extra_eval=[extra])


def test_extra_eval_names_are_unique():
    entry = {"name": "x", "task": "chain_sum", "size": 3, "seed": 9}
    with pytest.raises(ConfigError, match="names must be unique"):
        GymGenerateConfig(extra_eval=[entry, dict(entry)])


def test_shipped_real_generate_section_loads():
    cfg = load_config(GymGenerateConfig, "real_generate", REPO / "params.yaml")
    assert cfg.out_dir == "data/real" and cfg.train_seed != cfg.eval_seed
    assert [e["name"] for e in cfg.extra_eval] == ["second", "gsm"]


def test_missing_package_is_refused_with_the_make_target(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(ConfigError, match=r"reasoning-gym is not installed: run `make setup-real`"):
        reasoning_gym()
