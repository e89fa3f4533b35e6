"""Rejection sampling on the tiny model: n candidates, scored, best kept, pairs where scores differ."""

from __future__ import annotations

import json

from rlhf_core.config import RejectionConfig
from rlhf_core.rollout.rejection import rejection_sample


def test_rule_scored_rejection_sampling(micro_model, micro_data, tmp_path):
    cfg = RejectionConfig(policy_path=str(micro_model), prompts_file=str(micro_data["prompts"]), scorer="rule",
                          n_samples=4, max_prompts=30, output_file=str(tmp_path / "best.jsonl"),
                          pairs_file=str(tmp_path / "pairs.jsonl"), temperature=1.5)
    result = rejection_sample(cfg, show_progress=False)
    best = [json.loads(x) for x in result.output_file.read_text().splitlines()]
    pairs = [json.loads(x) for x in result.pairs_file.read_text().splitlines()]
    assert 0 < len(best) <= 30 and {"prompt", "completion", "score"} <= set(best[0])
    # best-of-n by rule can only be at least as accurate as a random sample
    assert result.metrics["rejection/kept_accuracy"] >= result.metrics["rejection/sample_accuracy"]
    for p in pairs:
        assert p["chosen"] != p["rejected"] and p["margin"] > 0


def test_reward_model_scored_rejection_sampling(micro_model, micro_data, tmp_path):
    from rlhf_core.config import RewardConfig
    from rlhf_core.trainers.reward import train_reward_model

    rm = train_reward_model(RewardConfig(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                                         output_dir=str(tmp_path / "rm"), max_steps=5, batch_size=16),
                            show_progress=False)
    cfg = RejectionConfig(policy_path=str(micro_model), prompts_file=str(micro_data["prompts"]),
                          scorer="reward_model", reward_model_path=str(rm.output_dir), n_samples=4, max_prompts=20,
                          output_file=str(tmp_path / "best.jsonl"), pairs_file=str(tmp_path / "pairs.jsonl"))
    result = rejection_sample(cfg, show_progress=False)
    best = [json.loads(x) for x in result.output_file.read_text().splitlines()]
    assert len(best) > 0 and all(isinstance(r["score"], float) for r in best)
    assert result.metrics["rejection/best_score_mean"] >= result.metrics["rejection/score_mean"]
