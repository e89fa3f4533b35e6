"""The closed choices of the stage configs: each enum-valued field's allowed values and what they imply.

They are configuration vocabulary, so they live beside the configs that validate them (``RLConfig``
checks ``rl.algorithm.estimator`` against :class:`AdvantageEstimator` without importing torch); the modules that
dispatch on them re-export each one under its old path (``rlhf_core.algorithms.rl_math.AdvantageEstimator``,
``rlhf_core.rewards.sources.RewardKind``, ``rlhf_core.rollout.environments.ToolMessages``,
``rlhf_core.distributed.weight_sync.WeightSync``).
"""

from __future__ import annotations

from enum import Enum


class AdvantageEstimator(str, Enum):
    """The closed set of advantage estimators (``rl.algorithm.estimator``), dispatched in
    :func:`rlhf_core.algorithms.advantages.compute_advantages`."""

    GAE = "gae"
    REINFORCE_PP = "reinforce++"
    REINFORCE_PP_BASELINE = "reinforce++-baseline"
    RLOO = "rloo"
    GRPO = "grpo"
    DR_GRPO = "dr-grpo"
    DISTILL = "distill"

    @property
    def needs_critic(self) -> bool:
        """Only GAE bootstraps from a learned value function."""
        return self is AdvantageEstimator.GAE

    @property
    def needs_teacher(self) -> bool:
        """On-policy distillation: a frozen teacher scores the policy's sampled tokens."""
        return self is AdvantageEstimator.DISTILL

    @property
    def takes_token_rewards(self) -> bool:
        """Estimators built on per-token rewards (a KL term folded in, the teacher's reverse KL);
        rloo, grpo and dr-grpo score whole sequences only."""
        return self in (AdvantageEstimator.GAE, AdvantageEstimator.REINFORCE_PP,
                        AdvantageEstimator.REINFORCE_PP_BASELINE, AdvantageEstimator.DISTILL)

    @property
    def needs_groups(self) -> bool:
        """Baselines built from several samples of the same prompt (``group_size >= 2``)."""
        return self in (AdvantageEstimator.REINFORCE_PP_BASELINE, AdvantageEstimator.RLOO,
                        AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO)


class KLEstimator(str, Enum):
    """Monte-Carlo estimators of ``KL(pi || pi_ref)`` from tokens sampled by ``pi`` (Schulman 2020;
    ``rl.kl.estimator``, computed by :func:`rlhf_core.algorithms.kl.kl_penalty`).

    With ``log_ratio = log pi - log pi_ref`` and ``r = pi_ref / pi = exp(-log_ratio)``:
    ``k1 = log_ratio`` (unbiased, high variance, can be negative);
    ``k2 = 0.5 * log_ratio^2`` (biased, low variance, >= 0);
    ``k3 = (r - 1) - log r`` (unbiased, low variance, >= 0; GRPO's choice, Shao et al. 2024, Eq. 4).
    """

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class LossAggregation(str, Enum):
    """How per-token losses become one scalar (``rl.algorithm.loss_aggregation``); the closed set dispatched in
    :func:`rlhf_core.algorithms.masked.aggregate_loss`."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"

    @property
    def needs_max_len(self) -> bool:
        """Only Dr.GRPO's constant normaliser needs the generation budget."""
        return self is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM


class PolicyObjective(str, Enum):
    """The policy-gradient surrogate (``rl.algorithm.policy_objective``); the closed set dispatched in
    :func:`rlhf_core.algorithms.policy.policy_loss`.

    * ``ppo_clip``: token ratios clipped inside PPO's pessimistic min (``clipped_policy_loss``);
    * ``gspo``: one length-normalised ratio per sequence, clipped the same way with much
      smaller bounds (``gspo_policy_loss``, Zheng et al. 2025);
    * ``cispo``: REINFORCE weighted by the clipped, stop-gradient token ratio; no token loses
      its gradient (``cispo_policy_loss``, MiniMax 2025).
    """

    PPO_CLIP = "ppo_clip"
    GSPO = "gspo"
    CISPO = "cispo"

    @property
    def supports_dual_clip(self) -> bool:
        """Dual clip bounds the unclipped branch of a min; CISPO has no such branch."""
        return self is not PolicyObjective.CISPO


class RewardKind(str, Enum):
    """Where rewards come from (config field ``reward_kind``; :func:`rlhf_core.rewards.sources.build_reward_source`)."""

    MODEL = "model"
    FUNCTION = "function"
    HTTP = "http"

    @property
    def loads_model(self) -> bool:
        """Whether the source holds model weights in this process (and wants a device)."""
        return self is RewardKind.MODEL

    @property
    def reads_labels(self) -> bool:
        """Whether the prompt file's labels must be there, so its gate is ``prompts``, not ``prompt-only``.

        A function gets each label and is usually a verifier (the embedded rule compares against it).
        A model never sees labels. A server gets ``label or None`` by protocol (the labels field may be
        absent, an item null) and ``alignflow serve-rm`` is a reward model, so a server that wants labels
        must already refuse ``None`` itself: requiring them here would only bar prompt-only files."""
        return self is RewardKind.FUNCTION


class ToolMessages(str, Enum):
    """How an observation joins a trajectory (``rl.environment.tool_messages``;
    :mod:`rlhf_core.rollout.environments`)."""

    AUTO = "auto"
    """chat where the prompts are conversations and the tokenizer has a chat template of its own, else text."""
    TEXT = "text"
    """The observation's text appended as is, inside the model's turn; a turn that ends at eos ends the episode."""
    CHAT = "chat"
    """The observation as a chat-template ``tool`` message, then the next assistant turn's generation prompt."""


class WeightSync(str, Enum):
    """``rl.distribution.weight_sync``: how rollout replicas under Ray get the learner's weights
    (:mod:`rlhf_core.distributed.weight_sync`'s docstring)."""

    AUTO = "auto"
    OBJECT_STORE = "object_store"
    COLLECTIVE = "collective"
