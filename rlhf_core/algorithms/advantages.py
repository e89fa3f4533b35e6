"""Advantage estimators of online RL (GAE, REINFORCE++, RLOO, GRPO, Dr.GRPO, on-policy distillation), dispatched
in :func:`compute_advantages`, and DAPO's dynamic sampling and overlong reward shaping.

Plain tensor functions (torch only). Tensor conventions (shapes, masks, group layout):
:mod:`rlhf_core.algorithms.rl_math`.
"""

from __future__ import annotations

import torch

from rlhf_core.algorithms.masked import _check_shapes, masked_whiten
from rlhf_core.config.choices import AdvantageEstimator


def _last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """``(batch,)`` index of each row's last valid token (0 for a row with none)."""
    positions = torch.arange(1, mask.size(-1) + 1, device=mask.device)
    return (mask.long() * positions).argmax(-1)


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor,
                        token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """Place each sequence score on its last valid token, plus optional per-token terms.

    ``R_bt = score_b * [t = last_b] + token_rewards_bt`` (Ziegler et al. 2019, Sec. 2.2; with
    ``token_rewards = -beta * KL_t`` this is RLHF's KL-shaped reward).

    Args:
        scores: ``(batch,)`` sequence-level rewards.
        mask: ``(batch, response_len)``.
        token_rewards: ``(batch, response_len)`` or ``None``.

    Returns:
        ``(batch, response_len)``, 0 at masked entries.
    """
    if scores.dim() != 1 or scores.size(0) != mask.size(0):
        raise ValueError(f"scores must have shape (batch,) = ({mask.size(0)},), got {tuple(scores.shape)}")
    m = mask.to(scores.dtype)
    rewards = torch.zeros_like(m)
    rewards.scatter_(1, _last_valid_index(mask).unsqueeze(1), scores.unsqueeze(1))
    if token_rewards is not None:
        _check_shapes("mask", mask=mask, token_rewards=token_rewards)
        rewards = rewards + token_rewards
    return rewards * m


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using GAE", Eq. 16).

    ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``, ``A_t = sum_l (gamma lam)^l delta_{t+l}``,
    computed backwards as ``A_t = delta_t + gamma * lam * A_{t+1}``; returns ``R_t = A_t + V(s_t)``
    are the critic's targets. The episode ends after each row's last valid token
    (``V = 0`` beyond it). Masked tokens are skipped, not treated as steps: ``V(s_{t+1})``
    is the value at the next *valid* token, so interior masks (e.g. tool output in a
    multi-turn response) pass through.

    Args:
        rewards: ``(batch, response_len)`` token-level rewards (see :func:`token_level_rewards`).
        values: ``(batch, response_len)`` critic values ``V(s_t)`` at rollout time.
        mask: ``(batch, response_len)``.
        gamma: discount, in ``[0, 1]``.
        lam: GAE ``lambda``, in ``[0, 1]`` (1: Monte-Carlo returns minus V; 0: one-step TD).

    Returns:
        ``(advantages, returns)``, both ``(batch, response_len)`` and 0 at masked entries.
        Not whitened: PPO implementations usually apply :func:`masked_whiten` to the
        advantages of the whole batch.
    """
    _check_shapes("mask", mask=mask, rewards=rewards, values=values)
    valid = mask.bool()
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    last_adv = rewards.new_zeros(batch)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_adv = torch.where(valid[:, t], delta + gamma * lam * last_adv, last_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = last_adv
    m = mask.to(rewards.dtype)
    return advantages * m, (advantages + values) * m


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens, ``G = 0`` after the last one.

    Args:
        rewards: ``(batch, response_len)``.
        mask: ``(batch, response_len)``; masked tokens are skipped like in :func:`gae`.
        gamma: discount in ``[0, 1]``.

    Returns:
        ``(batch, response_len)``, 0 at masked entries.
    """
    _check_shapes("mask", mask=mask, rewards=rewards)
    valid = mask.bool()
    running = rewards.new_zeros(rewards.size(0))
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.size(1))):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask.to(rewards.dtype)


@torch.no_grad()
def reinforce_plus_plus(token_rewards: torch.Tensor, mask: torch.Tensor,
                        gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++", arXiv:2501.03262): discounted returns of
    the token-level rewards, whitened over all valid tokens of the batch.

    ``A_t = (G_t - mean(G)) / std(G)``, ``G_t = sum_{s >= t} gamma^{s-t} r_s``; the global
    (not per-prompt) normalisation is what distinguishes it from GRPO.

    Args:
        token_rewards: ``(batch, response_len)``, e.g. :func:`token_level_rewards` of the
            scores with a ``-beta * KL`` term.
        mask: ``(batch, response_len)``.
        gamma: discount.

    Returns:
        ``(advantages, returns)``: whitened advantages and the raw returns ``G``,
        ``(batch, response_len)``, 0 at masked entries.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


def _grouped(scores: torch.Tensor, group_size: int, who: str) -> torch.Tensor:
    """View ``(batch,)`` scores as ``(n_prompts, group_size)``, with readable errors."""
    if scores.dim() != 1:
        raise ValueError(f"{who}: scores must have shape (batch,), got {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(f"{who} needs group_size >= 2 samples per prompt to build a baseline, got {group_size}")
    if scores.numel() % group_size != 0:
        raise ValueError(f"{who}: batch of {scores.numel()} rows is not divisible by group_size={group_size}; "
                         "rows [i*group_size:(i+1)*group_size] must be the samples of prompt i")
    return scores.view(-1, group_size)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline
    for Free!"; Ahmadian et al. 2024, "Back to Basics").

    ``A_i = r_i - (1 / (n - 1)) sum_{j != i} r_j`` within each prompt's group of ``n``:
    the baseline is the mean of the *other* samples, so it is independent of ``r_i`` and the
    estimator stays unbiased. Equals ``n / (n - 1) * (r_i - mean(r))``.

    Args:
        scores: ``(batch,)``, ``batch = n_prompts * group_size``, groups contiguous.
        group_size: ``n >= 2``.

    Returns:
        ``(batch,)`` sequence-level advantages.
    """
    g = _grouped(scores, group_size, "rloo")
    baseline = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


@torch.no_grad()
def grpo_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2):
    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` within each prompt's group.

    ``std`` is the sample standard deviation (``n - 1``), as in TRL, OpenRLHF and verl. A
    group whose rewards are all equal gets all-zero advantages (``0 / eps``): it carries no
    learning signal (see :func:`dynamic_sampling_keep`).

    Args:
        scores: ``(batch,)``, groups contiguous.
        group_size: ``n >= 2``.
        eps: added to the std so zero-variance groups give 0, not NaN.

    Returns:
        ``(batch,)``.
    """
    g = _grouped(scores, group_size, "grpo")
    centred = g - g.mean(-1, keepdim=True)
    return (centred / (g.std(-1, keepdim=True) + eps)).reshape(-1)


@torch.no_grad()
def dr_grpo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr.GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training", Sec. 3):
    ``A_i = r_i - mean(r)`` within each group, without GRPO's division by the std (which
    over-weights prompts that are nearly always solved or nearly always failed).

    Args:
        scores: ``(batch,)``, groups contiguous.
        group_size: ``n >= 2``.

    Returns:
        ``(batch,)``.
    """
    g = _grouped(scores, group_size, "dr-grpo")
    return (g - g.mean(-1, keepdim=True)).reshape(-1)


@torch.no_grad()
def reverse_kl_token_rewards(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                             clamp: float | None = None) -> torch.Tensor:
    """On-policy distillation's per-token reward: the negative reverse KL, one sample per token.

    ``r_t = -(log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t))`` on the token ``y_t`` the
    student sampled: a one-sample (k1, Schulman 2020) estimate of ``-KL(pi_student || pi_teacher)`` at
    step ``t`` (Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD), arXiv:2306.13649,
    Sec. 3 with the reverse KL; Lu / Thinking Machines 2025, "On-Policy Distillation"). Positive where the
    teacher likes the token more than the student does. Detached (a reward, not a loss): the gradient
    reaches the student through the policy-gradient loss only.

    Args:
        student_logp: ``(batch, response_len)`` the student's log-probs of its sampled tokens (pi_old).
        teacher_logp: ``(batch, response_len)`` the teacher's log-probs of the same tokens.
        mask: ``(batch, response_len)``.
        clamp: if set, the log-ratio is clamped to ``[-clamp, clamp]`` first (one token the teacher all
            but rules out must not swamp the batch's advantages).

    Returns:
        ``(batch, response_len)``, 0 at masked entries.
    """
    _check_shapes("mask", mask=mask, student_logp=student_logp, teacher_logp=teacher_logp)
    log_ratio = student_logp - teacher_logp
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    return -log_ratio * mask.to(log_ratio.dtype)


@torch.no_grad()
def distill_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, scores: torch.Tensor,
                       score_coef: float = 0.0) -> torch.Tensor:
    """On-policy distillation's advantages: each token's own reward, plus optionally the sequence's score.

    ``A_t = r_t + score_coef * score_b`` on valid tokens. The dense term uses discount 0: token ``t``
    is credited with its own reverse-KL reward only, not the later ones (Thinking Machines 2025, "On-Policy
    Distillation": a zero discount trains each step for its next token and worked as well as longer
    horizons). The sequence score, a reward at the end of the response, enters as its undiscounted return,
    the same on every token (REINFORCE, Williams 1992); no baseline is subtracted from either term: the
    teacher's reward already compares the token with the teacher (Agarwal et al. 2024, Sec. 3.2 mixes
    GKD with an RL reward the same way).

    Args:
        token_rewards: ``(batch, response_len)``, :func:`reverse_kl_token_rewards` (plus any other
            per-token term, e.g. ``-beta * KL`` to a reference).
        mask: ``(batch, response_len)``.
        scores: ``(batch,)`` sequence rewards.
        score_coef: weight of the sequence reward; 0 is pure distillation.

    Returns:
        ``(batch, response_len)``, 0 at masked entries.
    """
    _check_shapes("mask", mask=mask, token_rewards=token_rewards)
    m = mask.to(token_rewards.dtype)
    return (token_rewards + score_coef * scores.to(token_rewards.dtype).unsqueeze(1)) * m


def compute_advantages(
    estimator: AdvantageEstimator | str,
    *,
    scores: torch.Tensor,
    mask: torch.Tensor,
    group_size: int = 1,
    values: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    distill_reward_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one place an :class:`AdvantageEstimator` is dispatched.

    * ``gae``: :func:`gae` on :func:`token_level_rewards` (score at the last token plus
      ``token_rewards``) and ``values``;
    * ``reinforce++``: :func:`reinforce_plus_plus` on the same token-level rewards;
    * ``reinforce++-baseline``: the score minus its group mean (Hu 2025), then as
      ``reinforce++`` (token rewards, returns, global whitening);
    * ``rloo`` / ``grpo`` / ``dr-grpo``: :func:`rloo_advantages`, :func:`grpo_advantages`,
      :func:`dr_grpo_advantages`, one number per sequence broadcast over its valid tokens.
      These take no ``token_rewards``: put a KL term in the loss instead (GRPO, Eq. 3).
    * ``distill``: :func:`distill_advantages` of ``token_rewards`` (required: the teacher's
      :func:`reverse_kl_token_rewards`, discount 0) plus ``distill_reward_coef`` x the score.

    Args:
        estimator: which estimator (enum or string value).
        scores: ``(batch,)`` sequence-level rewards (e.g. verifier score + overlong penalty).
        mask: ``(batch, response_len)``.
        group_size: samples per prompt; rows ``[i*group_size:(i+1)*group_size]`` are prompt ``i``.
        values: ``(batch, response_len)`` critic values; required for ``gae``.
        token_rewards: ``(batch, response_len)`` per-token reward terms such as ``-beta * kl_penalty(...)``.
        gamma, lam: discount and GAE ``lambda`` (``lam`` is used by ``gae`` only; ``distill`` ignores both).
        eps: GRPO's std epsilon.
        distill_reward_coef: ``distill`` only: weight of the sequence score in each token's advantage.

    Returns:
        ``(advantages, returns)``: advantages ``(batch, response_len)``, 0 at masked entries;
        returns are the critic targets for ``gae``, the un-whitened discounted returns for the
        ``reinforce++`` variants (for logging), ``None`` for the sequence-level estimators and ``distill``.
    """
    estimator = AdvantageEstimator(estimator)
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape (batch, response_len), got {tuple(mask.shape)}")
    if scores.dim() != 1 or scores.size(0) != mask.size(0):
        raise ValueError(f"scores must have shape (batch,) = ({mask.size(0)},), got {tuple(scores.shape)}")
    scores = scores.float() if not scores.is_floating_point() else scores
    if estimator.needs_groups:
        # validate the grouping before anything else so every group estimator fails alike
        _grouped(scores, group_size, estimator.value)
    if token_rewards is not None and not estimator.takes_token_rewards:
        raise ValueError(f"{estimator.value} works on sequence scores only and takes no token_rewards; "
                         "add the KL term to the loss instead")

    if estimator is AdvantageEstimator.GAE:
        if values is None:
            raise ValueError("gae needs values (batch, response_len) from a critic; "
                             "use a critic-free estimator such as grpo or reinforce++ otherwise")
        return gae(token_level_rewards(scores, mask, token_rewards), values, mask, gamma, lam)
    if estimator is AdvantageEstimator.REINFORCE_PP:
        return reinforce_plus_plus(token_level_rewards(scores, mask, token_rewards), mask, gamma)
    if estimator is AdvantageEstimator.REINFORCE_PP_BASELINE:
        centred = dr_grpo_advantages(scores, group_size)
        return reinforce_plus_plus(token_level_rewards(centred, mask, token_rewards), mask, gamma)
    if estimator is AdvantageEstimator.DISTILL:
        if token_rewards is None:
            raise ValueError("distill needs token_rewards (batch, response_len): the teacher's "
                             "reverse_kl_token_rewards of the sampled tokens")
        return distill_advantages(token_rewards, mask, scores, distill_reward_coef), None

    if estimator is AdvantageEstimator.RLOO:
        per_sequence = rloo_advantages(scores, group_size)
    elif estimator is AdvantageEstimator.GRPO:
        per_sequence = grpo_advantages(scores, group_size, eps)
    elif estimator is AdvantageEstimator.DR_GRPO:
        per_sequence = dr_grpo_advantages(scores, group_size)
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return per_sequence.unsqueeze(1) * mask.to(per_sequence.dtype), None


# --------------------------------------------------------------------------------------
# DAPO sampling and reward shaping
# --------------------------------------------------------------------------------------


@torch.no_grad()
def dynamic_sampling_keep(scores: torch.Tensor, group_size: int, atol: float = 0.0) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, Sec. 3.2): drop prompts whose samples all scored the same.

    Such a group has zero advantage under every group-baseline estimator, so it only
    dilutes the batch; DAPO keeps sampling until the batch is full of groups with
    ``0 < #correct < n``.

    Args:
        scores: ``(batch,)``, groups contiguous.
        group_size: ``n >= 2``.
        atol: scores within ``atol`` of each other count as equal (0: exact, right for 0/1 rewards).

    Returns:
        ``(batch,)`` bool, the same for every row of a group: index the rollout batch with it.
        ``keep.view(-1, group_size)[:, 0]`` is the per-group mask.
    """
    g = _grouped(scores, group_size, "dynamic_sampling_keep")
    spread = g.max(-1).values - g.min(-1).values
    return (spread > atol).repeat_interleave(group_size)


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, Sec. 3.4, Eq. 13), added to the score.

    With ``L`` the response length, ``L_max = max_len`` and ``L_cache = cache_len``::

        R(L) = 0                                   if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache    if L_max - L_cache < L <= L_max
             = -1                                  if L > L_max

    a linear ramp from 0 to -1 over the last ``cache_len`` tokens of the budget.

    Args:
        lengths: ``(batch,)`` response lengths in tokens (int or float).
        max_len: ``L_max``, the generation budget.
        cache_len: ``L_cache``, the width of the penalty ramp, ``0 < cache_len <= max_len``.

    Returns:
        ``(batch,)`` float penalties in ``[-1, 0]``.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = lengths.float()
    start = max_len - cache_len
    ramp = (start - lengths) / cache_len
    return torch.where(lengths <= start, torch.zeros_like(lengths),
                       torch.where(lengths <= max_len, ramp, torch.full_like(lengths, -1.0)))
