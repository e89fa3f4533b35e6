"""The evaluate stage's ``scorer`` and ``format_check`` options on a micro model: unset, the metrics are exact
match's as they were; set, the scorer judges correctness (>= 1.0) and the format figures follow the answers."""

from __future__ import annotations

import json
import math

from rlhf_core.config import EvalConfig, TrackingConfig
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.evaluate import evaluate_exact_match
from rlhf_core.stages import wrappers as stages

SCORERS = '''
def full(prompts, completions, labels):
    return [1.0 for _ in completions]

def almost(prompts, completions, labels):
    return [0.999 for _ in completions]

def starts_with_digit(completion):
    return completion[:1].isdigit()
'''


def _run(model_dir, eval_file, **options):
    return evaluate_exact_match(load_causal_lm(model_dir), load_tokenizer(model_dir), eval_file, max_items=16,
                                max_new_tokens=6, batch_size=16, **options)


def test_scorer_judges_correctness_and_format_check_adds_its_figures(micro_model, micro_data, tmp_path):
    (tmp_path / "judges.py").write_text(SCORERS)
    plain = _run(micro_model, micro_data["eval"])
    assert not [k for k in plain.metrics() if "format" in k]  # unset: exact match's metrics only
    assert {"eval/accuracy", "eval/accuracy_stderr", "eval/n_items"} <= set(plain.metrics())

    full = _run(micro_model, micro_data["eval"], label_check=f"{tmp_path}/judges.py:full")
    assert full.accuracy == 1.0 and full.answers.answers == plain.answers.answers  # the same greedy answers
    assert _run(micro_model, micro_data["eval"], label_check=f"{tmp_path}/judges.py:almost").accuracy == 0.0

    checked = _run(micro_model, micro_data["eval"], format_check=f"{tmp_path}/judges.py:starts_with_digit")
    answers = checked.answers.answers
    fmt = [a[:1].isdigit() for a in answers]
    correct = [s["correct"] == "True" for s in checked.samples]  # the first 8, as written in the samples
    rate = sum(fmt) / len(fmt)
    m = checked.metrics()
    assert checked.accuracy == plain.accuracy  # the format check judges nothing else
    assert m["eval/format_rate"] == rate and m["eval/n_formatted"] == sum(fmt)
    assert math.isclose(m["eval/format_rate_stderr"], math.sqrt(rate * (1 - rate) / len(fmt)))
    assert [s["formatted"] == "True" for s in checked.samples] == fmt[:len(correct)]
    assert 0.0 <= m["eval/accuracy_formatted"] <= 1.0 and "eval/accuracy_formatted_stderr" in m


def test_evaluate_stage_writes_the_format_figures(micro_model, micro_data, tmp_path, isolated_project):
    (tmp_path / "judges.py").write_text(SCORERS)
    out = tmp_path / "metrics.json"
    cfg = EvalConfig(model_path=str(micro_model), eval_file=str(micro_data["eval"]), output_file=str(out),
                     max_items=8, max_new_tokens=6, num_threads=1, label_check=f"{tmp_path}/judges.py:full",
                     format_check=f"{tmp_path}/judges.py:starts_with_digit")
    stages.evaluate(cfg, TrackingConfig(experiment="gym-eval", log_model=False))
    metrics = json.loads(out.read_text())
    assert metrics["eval/accuracy"] == 1.0 and metrics["eval/n_items"] == 8
    assert {"eval/format_rate", "eval/format_rate_stderr", "eval/n_formatted", "eval/accuracy_formatted",
            "eval/accuracy_formatted_stderr"} <= set(metrics)
