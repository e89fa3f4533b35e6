"""reasoning-gym as a task source, with the package (the real-model extra: `make setup-real`): the files
``gym-generate`` writes (disjoint, deterministic, through the gate), its refusals, the data report refusing a
hand-made overlap, and the verifier's reward on right, wrong and unformatted answers. Slow tier; each test FAILS,
never skips, when reasoning-gym is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, GymGenerateConfig
from rlhf_core.data.gym_answers import formatted, parse_label
from rlhf_core.data.quality import normalize, text_of
from rlhf_core.data.report import data_report
from rlhf_core.data.validate import validate_dataset
from rlhf_core.rewards import load_function
from rlhf_core.stages.wrappers import gym_generate

pytestmark = pytest.mark.slow
REWARD = "rlhf_core/rewards/gym.py:reward"
EXTRA = [{"name": "chain", "task": "chain_sum", "size": 10, "seed": 500},
         {"name": "gsm", "task": "gsm_symbolic", "size": 6, "seed": 900}]


@pytest.fixture(autouse=True)
def reasoning_gym_installed():
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        pytest.fail("reasoning-gym is not installed: these tests need the real-model extra (make setup-real)")


def _cfg(out: Path, **kw) -> GymGenerateConfig:
    values = dict(out_dir=str(out), task="basic_arithmetic", task_config={"max_terms": 2, "max_digits": 2},
                  train_seed=1, eval_seed=40, train_size=60, eval_size=40, extra_eval=EXTRA)
    return GymGenerateConfig(**{**values, **kw})


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_files_are_disjoint_deterministic_and_pass_the_gate(tmp_path):
    # eval_seed 40 with train_seed 1: train indices 39.. repeat eval items (reasoning-gym draws item i from
    # seed + i), so the overlap is real and must be skipped
    result = gym_generate(_cfg(tmp_path / "a"))
    out = tmp_path / "a"
    assert set(result.outputs) == {"prompts", "eval", "sft", "eval_chain", "eval_gsm", "manifest"}
    prompts, held = _rows(out / "prompts.jsonl"), _rows(out / "eval.jsonl")
    assert (len(prompts), len(held)) == (60, 40)
    train_keys = {normalize(text_of(r["prompt"])) for r in prompts}
    assert len(train_keys) == 60 and not train_keys & {normalize(text_of(r["prompt"])) for r in held}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dropped"]["train_in_heldout"] > 0
    assert manifest["version"] and manifest["items"] == {"prompts": 60, "sft": 60, "eval": 40, "eval_chain": 10,
                                                         "eval_gsm": 6}
    assert (manifest["task"], manifest["train_seed"], manifest["eval_seed"]) == ("basic_arithmetic", 1, 40)
    sft = _rows(out / "sft.jsonl")
    assert [r["prompt"] for r in sft] == [r["prompt"] for r in prompts]
    assert all(formatted(r["completion"][0]["content"]) for r in sft)
    assert [r["completion"][0]["content"] for r in sft] == [parse_label(r["label"]).answer for r in prompts]
    for name, kind in (("prompts", "prompts"), ("eval", "prompts"), ("eval_chain", "prompts"),
                       ("eval_gsm", "prompts"), ("sft", "sft")):
        assert validate_dataset(out / f"{name}.jsonl", kind).success, name
    assert data_report(out / "prompts.jsonl", "prompts", eval_file=out / "eval.jsonl").success

    gym_generate(_cfg(tmp_path / "b"))
    for name in result.outputs:
        path = Path(result.outputs[name])
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), name


def test_data_report_refuses_a_hand_made_overlap_naming_the_file(tmp_path):
    gym_generate(_cfg(tmp_path, extra_eval=[]))
    prompts, held = tmp_path / "prompts.jsonl", tmp_path / "eval.jsonl"
    with prompts.open("a") as f:
        f.write(held.read_text().splitlines()[3] + "\n")
    report = data_report(prompts, "prompts", eval_file=held)
    assert not report.success
    failure = next(f for f in report.failures if "found in the eval set" in f.message)
    assert str(held) in failure.message and failure.locations == [f"{prompts}:61"]


@pytest.mark.parametrize("kw, message", [
    ({"task": "productz"}, r"gym_generate\.task: unknown reasoning-gym task 'productz' \(close names: products"),
    ({"task": "products", "task_config": {"min_digits": 5, "max_digits": 2}},
     r"gym_generate\.task_config: task 'products' rejects .*max_digits must be >= min_digits"),
    ({"task_config": {"digits": 3}}, r"gym_generate\.task_config: task 'basic_arithmetic' rejects .*digits"),
    ({"extra_eval": [{"name": "x", "task": "gsm_symbolc", "size": 2, "seed": 3}]},
     r"gym_generate\.extra_eval\[0\]\.task: unknown reasoning-gym task 'gsm_symbolc' \(close names: gsm_symbolic"),
    ({"task": "chain_sum", "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
      "train_size": 500}, r"gym_generate\.train_size: task 'chain_sum' gave \d+ distinct items"),
])
def test_refusals_name_the_setting_and_write_nothing(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        gym_generate(_cfg(tmp_path / "out", **kw))
    assert not (tmp_path / "out").exists()


def test_equal_seeds_are_refused():
    with pytest.raises(ConfigError, match=r"eval_seed: must differ from train_seed"):
        _cfg(Path("unused"), eval_seed=1)


@pytest.mark.parametrize("task", ["basic_arithmetic", "products", "chain_sum", "gsm_symbolic"])
def test_reward_scores_right_wrong_and_unformatted_answers(tmp_path, task):
    gym_generate(GymGenerateConfig(out_dir=str(tmp_path), task=task, train_size=4, eval_size=4))
    _, _, reward = load_function(REWARD)
    rows = _rows(tmp_path / "eval.jsonl")
    labels = [r["label"] for r in rows]
    answers = [parse_label(y).answer for y in labels]
    n = len(rows)
    assert reward([""] * n, answers, labels) == [1.0] * n
    assert all(formatted(a) for a in answers)
    wrong = [str(int(float(a)) + 1) for a in answers]
    assert all(score < 1.0 for score in reward([""] * n, wrong, labels))
    chatty = [f"Let me think. The result is {a}." for a in answers]
    assert reward([""] * n, chatty, labels) == [1.0] * n and not any(formatted(c) for c in chatty)
    tagged = [f"<answer>{a}</answer> (check: {int(float(a)) + 1})" for a in answers]
    assert reward([""] * n, tagged, labels) == [1.0] * n
    assert reward([""] * n, ["I do not know"] * n, labels) == [0.0] * n
    _, _, strict = load_function("rlhf_core/rewards/gym.py:formatted_reward")
    assert strict([""] * n, answers, labels) == [1.0] * n
    assert strict([""] * n, chatty, labels) == [0.0] * n and strict([""] * n, tagged, labels) == [0.0] * n
