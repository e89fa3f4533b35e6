"""The embedded task's reward file: 1.0 for an exact answer, 0.0 otherwise.

Name it in a config as ``rlhf_core/embedded/reward.py:reward`` (reward kind ``function``);
a reward file of your own follows the same signature. Loaded by file path, so it imports
only what a standalone file can. ``prompts`` arrive as the policy read them: a conversational
prompt rendered with its chat template (role markers and all), a standard one as written;
``completions`` are the decoded answers without special tokens.
"""

from __future__ import annotations

from typing import Sequence

from rlhf_core.embedded.tasks import rule_reward


def reward(prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str | None]) -> list[float]:
    """Exact-match reward against each sample's label (every sample needs one)."""
    missing = [i for i, y in enumerate(labels) if y is None]
    if missing:
        raise ValueError(f"sample {missing[0]} has no label; the embedded rule reward compares against it")
    return rule_reward(prompts, completions, [str(y) for y in labels])
