"""Rewards: sources a trainer scores completions with (a Python file, a reward model, an HTTP
server), the reward model itself and the server that serves it.

``rlhf_core.rewards`` keeps the names users' reward files import (``rlhf_core.rewards.sources``
holds them). May import ``rlhf_core.distributed`` and everything below it.
"""

from rlhf_core.rewards.sources import (DEFAULT_MAX_RESPONSE_BYTES, INSTALL_ROOT, FunctionRewardSource,
                                       HttpRewardSource, RewardError, RewardKind, RewardModelSource, RewardSource,
                                       build_reward_source, load_function, resolve_reward_file, validate_rewards)

__all__ = ["DEFAULT_MAX_RESPONSE_BYTES", "INSTALL_ROOT", "FunctionRewardSource", "HttpRewardSource", "RewardError",
           "RewardKind", "RewardModelSource", "RewardSource", "build_reward_source", "load_function",
           "resolve_reward_file", "validate_rewards"]
