"""Guards and the promotion gate (rlhf_core/promotion/guards.py), and the model card: expected values worked out by hand."""

from __future__ import annotations

import math

import pytest

from rlhf_core.config import ConfigError, GuardsConfig
from rlhf_core.promotion.guards import (
    GUARD_NAMES,
    ProbeRecord,
    check_guards,
    gate,
    paired_delta,
    reward_disagreement,
    top_scored_accuracy,
    unpaired_se,
)
from rlhf_core.tracking.model_card import render_model_card


def _record(correct, reward=None, length=None, entropy=1.0, kl=None, slices=None) -> ProbeRecord:
    n = len(correct) if correct is not None else len(reward)
    return ProbeRecord(correct=None if correct is None else [float(c) for c in correct],
                       reward=None if reward is None else [float(r) for r in reward],
                       length=[4.0] * n if length is None else [float(x) for x in length], entropy=entropy, kl=kl,
                       slices=slices or [None] * n)


def test_paired_se_is_the_sd_of_the_differences_and_smaller_than_the_unpaired_one_when_results_agree():
    """parent 1111 0000, child 1111 1000: d = 0000 1000, mean 1/8 = 0.125;
    sum (d - 0.125)^2 = 7 * 0.015625 + 0.765625 = 0.875; sample var 0.875 / 7 = 0.125; se = sqrt(0.125 / 8) = 0.125.
    Unpaired: se_a = sqrt(.5 * .5 / 8) = 0.176777, se_b = sqrt(.625 * .375 / 8) = 0.171163,
    sqrt(se_a^2 + se_b^2) = sqrt(0.03125 + 0.029297) = 0.246063: twice the paired error."""
    d = paired_delta([1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0])
    assert (d.delta, d.se, d.n) == (pytest.approx(0.125), pytest.approx(0.125), 8)
    assert unpaired_se(math.sqrt(0.25 / 8), math.sqrt(0.625 * 0.375 / 8)) == pytest.approx(0.246063, abs=1e-6)


def test_paired_se_when_models_disagree_both_ways():
    """parent 11001, child 11100: d = 0 0 1 0 -1, mean 0; sum d^2 = 2; var 2 / 4 = 0.5; se = sqrt(0.5 / 5) = 0.316228."""
    d = paired_delta([1, 1, 0, 0, 1], [1, 1, 1, 0, 0])
    assert d.delta == 0.0 and d.se == pytest.approx(math.sqrt(0.1))


def test_paired_delta_needs_the_same_items():
    with pytest.raises(ValueError, match="same items"):
        paired_delta([1, 0], [1, 0, 1])


def test_reward_up_while_accuracy_flat_is_reward_hacking():
    """Accuracy 0101 -> 0101 (delta 0, se 0: flat); reward 0000 -> 1111 (delta 1, se 0: up beyond any noise)."""
    cfg = GuardsConfig()
    parent, child = _record([0, 1, 0, 1], [0, 0, 0, 0]), _record([0, 1, 0, 1], [1, 1, 1, 1])
    report = check_guards(parent, child, cfg)
    assert [g.name for g in report.fired] == ["reward_hacking"]
    assert "reward +1.0000" in report.fired[0].detail and "accuracy +0.0000" in report.fired[0].detail
    assert report.tags()["guard.fired"] == "reward_hacking"
    assert report.metrics()["guard/reward_hacking_fired"] == 1.0 and report.metrics()["guard/reward_delta"] == 1.0
    assert not gate(report, cfg).passed


def test_reward_and_accuracy_up_together_is_not_hacking():
    """Accuracy 0000 -> 1111 (delta 1, se 0) and reward 0000 -> 1111: the reward rose because answers got right."""
    report = check_guards(_record([0, 0, 0, 0], [0] * 4), _record([1, 1, 1, 1], [1] * 4), GuardsConfig())
    assert report.fired == []


def test_top_rewarded_answers_wrong_more_often_than_the_rest_is_reward_disagreement():
    """Child correct 1111111100, rewards highest on the two wrong ones; top 20% = 2 items, accuracy 0;
    overall p = 0.8, se = sqrt(0.8 * 0.2 / 2) = 0.282843; 0 < 0.8 - 2 * 0.282843 = 0.234315: fires.
    The parent (rewards on its right answers) had its top 2 right: 1.000 vs 0.500."""
    child = _record([1] * 8 + [0, 0], [0] * 8 + [5, 4])
    parent = _record([1] * 5 + [0] * 5, [3] * 5 + [0] * 5)
    assert top_scored_accuracy(child.correct, child.reward, 0.2) == (0.0, 2)
    result = reward_disagreement(parent, child, GuardsConfig(top_fraction=0.2))
    assert result.fired and result.value == pytest.approx(-0.8)
    assert result.detail == "top-2 rewarded answers correct 0.000 vs all 0.800 (s.e. 0.283); parent 1.000 vs 0.500"


def test_an_advisory_guard_is_tagged_but_does_not_block_the_gate():
    """reward_disagreement is advisory by default: it fires and is tagged, and the gate passes (accuracy 0 -> 0.8 on
    10 items: d = eight 1s, two 0s, se = sqrt(0.16 * 10 / 9 / 10) = 0.133; 0.8 > 2 se). advisory_guards: [] blocks."""
    parent = _record([0] * 10, [0] * 10)
    child = _record([1] * 8 + [0, 0], [0] * 8 + [5, 4])
    report = check_guards(parent, child, GuardsConfig(top_fraction=0.2))
    assert [g.name for g in report.fired] == ["reward_disagreement"] and report.blocking == []
    assert report.tags()["guard.fired"] == "reward_disagreement" and report.tags()["guard.blocking"] == "none"
    assert report.tags()["guard.reward_disagreement"].startswith("FIRED (advisory): top-2")
    assert gate(report, GuardsConfig(top_fraction=0.2)).passed
    strict = GuardsConfig(top_fraction=0.2, advisory_guards=[])
    assert not gate(check_guards(parent, child, strict), strict).passed
    with pytest.raises(ConfigError, match="advisory_guards"):
        GuardsConfig(advisory_guards=["no_such_guard"])


def test_gate_needs_a_gain_beyond_k_paired_standard_errors():
    """parent all wrong, child right on 5 of 10: d = five 1s, five 0s; mean 0.5; var 2.5 / 9 = 0.277778;
    se = sqrt(0.277778 / 10) = 0.166667. 0.5 > 2 * 0.166667 passes; 0.5 > 3.5 * 0.166667 = 0.583 does not."""
    parent, child = _record([0] * 10), _record([1] * 5 + [0] * 5)
    report = check_guards(parent, child, GuardsConfig())
    assert report.eval_delta.se == pytest.approx(1 / 6)
    assert gate(report, GuardsConfig()).passed
    blocked = gate(report, GuardsConfig(min_improvement_se=3.5))
    assert not blocked.passed and "accuracy gain +0.5000 ± 0.1667" in blocked.text()


def test_kl_length_and_entropy_guards_fire_past_their_thresholds():
    """KL 6 > 5; length 4 -> 8 tokens = +100% > 50%; entropy 1.0 -> 0.05 = ratio 0.05 < 0.1."""
    parent = _record([0, 1] * 5, length=[4] * 10, entropy=1.0)
    child = _record([0, 1] * 5, length=[8] * 10, entropy=0.05, kl=6.0)
    report = check_guards(parent, child, GuardsConfig())
    assert {g.name for g in report.fired} == {"kl", "length", "entropy_collapse"}
    assert report.values["length_change"] == pytest.approx(1.0) and report.values["entropy_ratio"] == pytest.approx(0.05)
    decision = gate(report, GuardsConfig())
    assert not decision.passed and all(name in decision.text() for name in ("kl:", "length:", "entropy_collapse:"))


def test_a_slice_that_lost_beyond_noise_is_a_regression_even_when_the_total_rose():
    """Slice a: 10 items 0 -> 1 (delta +1, se 0); slice b: 10 items, 6 of them 1 -> 0 (d = six -1, four 0:
    mean -0.6, var (6 * 0.16 + 4 * 0.36) / 9 = 0.266667, se = 0.163299; -0.6 < -2 se and < -0.05: fires)."""
    slices = ["a"] * 10 + ["b"] * 10
    parent = _record([0] * 10 + [1] * 6 + [0] * 4, slices=slices)
    child = _record([1] * 10 + [0] * 10, slices=slices)
    report = check_guards(parent, child, GuardsConfig())
    assert [g.name for g in report.fired] == ["skill_regression"]
    assert report.values["skill_delta_b"] == pytest.approx(-0.6)
    assert report.values["skill_delta_se_b"] == pytest.approx(math.sqrt(0.4 / 15))
    assert report.eval_delta.delta == pytest.approx(0.2)


def test_without_labels_the_gate_judges_the_reward_with_the_kl_guard():
    parent, child = _record(None, [0, 0, 1, 1]), _record(None, [1, 1, 2, 2], kl=1.0)
    report = check_guards(parent, child, GuardsConfig())
    decision = gate(report, GuardsConfig())
    assert report.eval_delta is None and decision.metric == "reward" and decision.passed
    high_kl = gate(check_guards(parent, _record(None, [1, 1, 2, 2], kl=9.0), GuardsConfig()), GuardsConfig())
    assert not high_kl.passed and "kl:" in high_kl.text()


def test_guards_config_is_validated():
    with pytest.raises(ConfigError, match="gate_metric"):
        GuardsConfig(gate_metric="loss")
    with pytest.raises(ConfigError, match="top_fraction"):
        GuardsConfig(top_fraction=0.0)


def test_model_card_names_parent_data_eval_guards_and_decision():
    report = check_guards(_record([0, 1, 0, 1], [0] * 4), _record([0, 1, 0, 1], [1] * 4), GuardsConfig())
    tags = {"alignflow.stage": "rl", "git.commit": "abc123", "input.model": "models/sft", "dvc.md5.model": "m5.dir",
            "input.eval": "data/eval.jsonl", "dvc.md5.eval": "e5", "dvc.md5.output_model": "o5.dir", **report.tags()}
    card = render_model_card("policy", "3", "run1", tags, {"kl.coef": "0.01", "lr": "0.0003"},
                             report.metrics(), {"promoted": False, "verdict": "candidate v3: not promoted",
                                                "gate": "gate blocked: reward_hacking"}, "alignflow-sft v1")
    for text in ("policy v3: candidate (not promoted)", "`models/sft` (DVC md5 `m5.dir`)", "alignflow-sft v1",
                 "| eval | `data/eval.jsonl` | `e5` |", "| kl.coef | `0.01` |", "+0.0000 ± 0.0000",
                 "Guards (fired: reward_hacking; blocking promotion: reward_hacking)", "| reward_hacking | FIRED: reward +1.0000", "gate blocked"):
        assert text in card, (text, card)


def test_the_command_metric_gates_on_its_paired_scores():
    """Metric scores parent [1, 2, 3, 4], child [2, 3, 3, 6]: d = [1, 1, 0, 2], mean 1, sd = sqrt(2/3),
    se = sqrt(2/3) / 2 = 0.408; 1 > 2 x 0.408 passes. Swapped, d = -1: blocked on the command gain."""
    cfg = GuardsConfig(gate_metric="command", metric_command="e {model} {out}", advisory_guards=list(GUARD_NAMES))
    record = _record(None, [0, 0, 0, 0])
    report = check_guards(record, record, cfg, ([1, 2, 3, 4], [2, 3, 3, 6]))
    assert report.metric_delta.delta == 1.0 and report.metric_delta.se == pytest.approx((2 / 3) ** 0.5 / 2)
    assert report.metrics()["guard/metric_mean"] == 3.5 and report.tags()["guard.metric_delta"].startswith("+1.0000")
    assert gate(report, cfg).passed and gate(report, cfg).metric == "command"
    worse = gate(check_guards(record, record, cfg, ([2, 3, 3, 6], [1, 2, 3, 4])), cfg)
    assert not worse.passed and worse.reasons == ["command gain -1.0000 ± 0.4082 (paired, n=4) is not above 2 s.e."]
