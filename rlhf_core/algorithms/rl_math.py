"""Pure online-RL math, one import away: policy and value losses, KL penalties, advantage estimators.

The functions live by concern: :mod:`~rlhf_core.algorithms.masked` (masked statistics, loss aggregation,
entropy), :mod:`~rlhf_core.algorithms.policy` (PPO's clipped surrogate, GSPO, CISPO, the value loss,
off-policy corrections), :mod:`~rlhf_core.algorithms.kl` (KL estimators and controllers) and
:mod:`~rlhf_core.algorithms.advantages` (advantage estimators, DAPO's sampling and shaping); the closed
choices are configuration vocabulary (:mod:`rlhf_core.config.choices`). This module re-exports all of them
under the path users' code imports (``rlhf_core.algorithms.rl_math``, and ``rlhf_core.rl_math`` through
``rlhf_core.MOVED``).

Plain tensor functions (torch and the standard library only; no Ray, DeepSpeed, vLLM,
Prefect or MLflow), so every formula can be checked against hand-made tensors
(``tests/unit/test_rl_math.py``) and runs the same inside or outside a Ray actor.

Conventions:

* Per-token tensors are ``(batch, response_len)``, aligned with the response tokens: entry
  ``[b, t]`` belongs to the ``t``-th generated token of row ``b`` (log-probs already shifted
  by the caller, see :mod:`rlhf_core.algorithms.losses`).
* ``mask`` is ``(batch, response_len)``, bool or 0/1 float, true on valid response tokens.
  Masked entries of every input may hold anything (padding garbage); outputs are 0 there.
* Group estimators see ``group_size`` samples per prompt laid out contiguously: rows
  ``[i * group_size, (i + 1) * group_size)`` are the samples of prompt ``i``.

Pipeline order inside an RL trainer: scores ``(batch,)`` -> :func:`compute_advantages` ->
:func:`policy_loss` (PPO's clipped surrogate, GSPO or CISPO; + :func:`clipped_value_loss` for PPO,
+ a KL or entropy term aggregated with :func:`aggregate_loss`).
"""

from rlhf_core.algorithms.advantages import (compute_advantages, discounted_returns, distill_advantages,
                                             dr_grpo_advantages, dynamic_sampling_keep, gae, grpo_advantages,
                                             overlong_penalty, reinforce_plus_plus, reverse_kl_token_rewards,
                                             rloo_advantages, token_level_rewards)
from rlhf_core.algorithms.kl import AdaptiveKLController, FixedKLController, KLController, kl_penalty
from rlhf_core.algorithms.masked import (aggregate_loss, aggregation_units, entropy_from_logits, masked_mean,
                                         masked_var, masked_whiten)
from rlhf_core.algorithms.policy import (PolicyLossStats, cispo_policy_loss, clipped_policy_loss, clipped_value_loss,
                                         explained_variance, gspo_policy_loss, policy_loss, sequence_is_mask,
                                         truncated_is_weights)
from rlhf_core.config.choices import AdvantageEstimator, KLEstimator, LossAggregation, PolicyObjective

__all__ = [
    "AdvantageEstimator", "KLEstimator", "LossAggregation", "PolicyObjective",
    "masked_mean", "masked_var", "masked_whiten", "aggregate_loss", "aggregation_units", "entropy_from_logits",
    "PolicyLossStats", "clipped_policy_loss", "gspo_policy_loss", "cispo_policy_loss", "policy_loss",
    "clipped_value_loss", "truncated_is_weights", "sequence_is_mask", "explained_variance",
    "kl_penalty", "KLController", "FixedKLController", "AdaptiveKLController",
    "token_level_rewards", "gae", "discounted_returns", "reinforce_plus_plus", "rloo_advantages", "grpo_advantages",
    "dr_grpo_advantages", "reverse_kl_token_rewards", "distill_advantages", "compute_advantages",
    "dynamic_sampling_keep", "overlong_penalty",
]
