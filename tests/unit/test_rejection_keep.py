"""Best-of-n keeping: a prompt's best candidate is kept only when it scores at least ``min_score``."""

from __future__ import annotations

from rlhf_core.config import RejectionConfig
from rlhf_core.data.formats import PromptExample
from rlhf_core.rollout.rejection import _keep


def test_rejection_keeps_a_best_candidate_only_at_min_score():
    examples = [PromptExample("1+1=", "2", 1), PromptExample("2+2=", "4", 2)]
    flat = ["2", "3", "5", "6"]  # two candidates per prompt; only the first prompt has a right one
    scores = [1.0, 0.0, 0.0, 0.0]
    best, pairs, kept = _keep(RejectionConfig(n_samples=2), examples, scores, flat)
    assert [row["completion"] for row in best] == ["2", "5"] and len(pairs) == 1  # -inf: every prompt's best
    best, pairs, kept = _keep(RejectionConfig(n_samples=2, min_score=1.0), examples, scores, flat)
    assert [row["completion"] for row in best] == ["2"] and kept == [(0, "2")] and len(pairs) == 1
