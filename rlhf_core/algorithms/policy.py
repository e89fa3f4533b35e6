"""Policy and value losses of online RL: PPO's clipped surrogate, GSPO, CISPO, the clipped value loss, and the
off-policy corrections (truncated importance weights, sequence-level masking).

Plain tensor functions (torch only). Tensor conventions (shapes, masks, group layout):
:mod:`rlhf_core.algorithms.rl_math`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlhf_core.algorithms.masked import _check_shapes, aggregate_loss, masked_mean, masked_var
from rlhf_core.config.choices import LossAggregation, PolicyObjective


# Log-ratios are clamped before ``exp`` in the policy loss: exp(20) ~ 5e8 is already far
# outside any trust region, and the clamp keeps one stale token from producing inf/NaN.
_LOG_RATIO_LIMIT = 20.0


@dataclass
class PolicyLossStats:
    """Detached scalar diagnostics of one policy-loss call (tensors, so logging needs no GPU sync here)."""

    clip_frac: torch.Tensor
    """Fraction of valid tokens where the objective's clip binds: ppo_clip and gspo, the clipped surrogate
    is chosen (zero gradient); cispo, the token's IS weight is truncated (gradient kept, reweighted)."""
    dual_clip_frac: torch.Tensor
    """Fraction of valid tokens where the dual-clip bound ``c * |A|`` binds (0 without dual clip)."""
    approx_kl: torch.Tensor
    """k3 estimate of ``KL(pi_old || pi)`` over valid tokens: ``mean((r - 1) - log r)``, ``r = pi / pi_old``
    per token, whatever the objective."""
    ratio_mean: torch.Tensor
    """Mean over valid tokens of the ratio the objective uses: the token ratio ``pi / pi_old`` (ppo_clip,
    cispo) or the token's sequence ratio ``s_i`` (gspo); 1 on the first epoch of fresh rollouts."""


def _check_clip(clip_low: float | None, clip_high: float, dual_clip: float | None) -> None:
    """Readable errors for clip bounds; ``clip_low`` None means no lower bound (cispo only)."""
    if clip_low is not None and not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) so that 1 - clip_low > 0, got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss at c * |A|), got {dual_clip}")


def _pessimistic_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                           dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``-min(r A, clip(r) A)`` (then dual clip) per entry; returns ``(loss, clipped, dual_clipped)``,
    all shaped like ``ratio``. Shared by :func:`clipped_policy_loss` and :func:`gspo_policy_loss`."""
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        dual_bound = -dual_clip * advantages  # positive where A < 0
        dual_clipped = (advantages < 0) & (per_token > dual_bound)
        per_token = torch.where(dual_clipped, dual_bound, per_token)
    return per_token, clipped, dual_clipped


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    max_len: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO's clipped surrogate with asymmetric (clip-higher) and optional dual clipping (``ppo_clip``).

    Per token, with ``r = exp(logp - logp_old)`` and advantage ``A``:

    * PPO (Schulman et al. 2017, Eq. 7), here with separate bounds (DAPO's clip-higher,
      Yu et al. 2025, Sec. 3.1: a larger ``clip_high`` lets low-probability tokens
      grow, against entropy collapse):
      ``l = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``;
    * dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"), only
      where ``A < 0``: ``l = min(l, -c A)``, bounding the loss of a token whose ratio has
      run far above 1 on a bad action.

    Args:
        logprobs: ``(batch, response_len)`` log-probs of the sampled tokens under the policy
            being trained (carries the gradient).
        old_logprobs: ``(batch, response_len)`` the same under the policy that sampled them.
        advantages: ``(batch, response_len)``, treated as constants.
        mask: ``(batch, response_len)``.
        clip_low, clip_high: ``epsilon_low``, ``epsilon_high``; ``clip_low`` in ``[0, 1)``.
        dual_clip: ``c > 1``, or ``None`` for no dual clip.
        aggregation, max_len: see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``: the scalar loss and :class:`PolicyLossStats`.
    """
    _check_shapes("logprobs", logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    _check_clip(clip_low, clip_high, dual_clip)

    advantages = advantages.detach()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    per_token, clipped, dual_clipped = _pessimistic_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)

    loss = aggregate_loss(per_token, mask, aggregation, max_len)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_frac=masked_mean(clipped.to(ratio.dtype), mask),
            dual_clip_frac=masked_mean(dual_clipped.to(ratio.dtype), mask),
            approx_kl=masked_mean((ratio - 1.0) - log_ratio, mask),
            ratio_mean=masked_mean(ratio, mask),
        )
    return loss, stats


def _token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_old`` per token, clamped, 0 (not NaN) where ``valid`` is false; carries the gradient."""
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return torch.where(valid, log_ratio, torch.zeros_like(log_ratio))


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    aggregation: LossAggregation | str = LossAggregation.SEQ_MEAN_TOKEN_MEAN,
    max_len: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

    * Sequence ratio (Sec. 4.1): ``s_i = (pi(y_i|x) / pi_old(y_i|x))^(1 / |y_i|)
      = exp(mean_t (logp_it - logp_old_it))`` over row ``i``'s valid tokens: one
      length-normalised ratio per response, so a long response is not pushed off-ratio by
      the product of its tokens' noise.
    * GSPO-token (Sec. 4.3): ``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]``: every token carries
      the value ``s_i``, and ``d s_it / d logp_it = s_i``; then PPO's pessimistic clip per token,
      ``l_it = -min(s_it A_it, clip(s_it, 1 - clip_low, 1 + clip_high) A_it)``. Since ``s_it``
      is the same for a whole row, a row with one advantage sign is clipped or kept as a whole.
    * With ``A_it = A_i`` and ``seq_mean_token_mean`` (the paper's ``1/G sum_i``; the default
      here), the gradient is GSPO's sequence objective's (Eq. 5):
      ``-(1/G) sum_i s_i A_i (1/|y_i|) sum_t grad logp_it`` on unclipped rows. Per-token
      advantages (e.g. TIS-weighted, ``w > 0`` factors out of the min) are what GSPO-token adds.

    The paper's bounds are ``clip_low = 3e-4``, ``clip_high = 4e-4`` (its experiments): ``s_i`` is a
    geometric mean, so it moves far less than a token ratio; PPO's 0.2 would almost never bind.

    Args:
        logprobs: ``(batch, response_len)`` log-probs under the policy being trained (gradient).
        old_logprobs: ``(batch, response_len)`` the same under the policy that sampled.
        advantages: ``(batch, response_len)``, treated as constants.
        mask: ``(batch, response_len)``; padding is left out of the mean in ``s_i``.
        clip_low, clip_high: GSPO's ``epsilon_low``, ``epsilon_high`` on ``s_i``.
        dual_clip: ``c > 1`` applied per token as in :func:`clipped_policy_loss`, or ``None``.
        aggregation, max_len: see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``; ``stats.ratio_mean`` averages ``s_i`` over valid tokens.
    """
    _check_shapes("logprobs", logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    _check_clip(clip_low, clip_high, dual_clip)
    valid = mask.bool()
    token_log_ratio = _token_log_ratio(logprobs, old_logprobs, valid)
    # log s_i = mean over valid tokens (a row without valid tokens gets 0, i.e. s_i = 1)
    seq_log_ratio = token_log_ratio.detach().sum(-1) / valid.sum(-1).clamp(min=1)
    # log s_it = sg[log s_i] + logp_it - sg[logp_it]: value log s_i, gradient that of logp_it
    own = torch.where(valid, logprobs - logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + own)
    per_token, clipped, dual_clipped = _pessimistic_surrogate(ratio, advantages.detach(), clip_low, clip_high,
                                                              dual_clip)
    loss = aggregate_loss(per_token, mask, aggregation, max_len)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_frac=masked_mean(clipped.to(ratio.dtype), mask),
            dual_clip_frac=masked_mean(dual_clipped.to(ratio.dtype), mask),
            approx_kl=masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask),
            ratio_mean=masked_mean(ratio, mask),
        )
    return loss, stats


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.28,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    max_len: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, Sec. 3.1: ``J_CISPO`` and its clipped weight).

    Per token, with ``r = exp(logp - logp_old)``, weight ``w = sg(clip(r, 1 - clip_low, 1 + clip_high))``
    (the paper's ``r_hat``) and advantage ``A``, the objective is ``w A log pi``, averaged over all tokens
    of the batch (``token_mean``): plain REINFORCE whose
    importance weight is truncated and detached. Unlike PPO's min, no token's gradient is switched
    off: a rare token whose ratio ran past the bound (often a "fork" token of a reasoning chain,
    the paper's motivation) still gets ``-w A grad logp``, only with a bounded weight.

    The loss is written ``-w A exp(logp - sg(logp))``: the same gradient as the paper's
    ``-w A logp``, but its value is ``-w A``, on the scale of ``ppo_clip``'s surrogate, so
    ``train/policy_loss`` stays comparable across objectives. The paper bounds only the top
    (``clip_low=None``: no lower bound; MiniMax sets ``epsilon_low`` large). Multiplying ``A``
    by truncated-IS weights (``w_tis > 0``) scales each token's term, as for ``ppo_clip``.

    Args:
        logprobs: ``(batch, response_len)`` log-probs under the policy being trained (gradient).
        old_logprobs: ``(batch, response_len)`` the same under the policy that sampled.
        advantages: ``(batch, response_len)``, treated as constants.
        mask: ``(batch, response_len)``.
        clip_low: ``epsilon_low`` in ``[0, 1)``, or ``None`` for no lower bound.
        clip_high: ``epsilon_high >= 0``: the weight is at most ``1 + clip_high``.
        aggregation, max_len: see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``; ``stats.clip_frac`` is the fraction of valid tokens whose weight was truncated.
    """
    _check_shapes("logprobs", logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    _check_clip(clip_low, clip_high, None)
    valid = mask.bool()
    log_ratio = _token_log_ratio(logprobs, old_logprobs, valid).detach()
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(None if clip_low is None else 1.0 - clip_low, 1.0 + clip_high)
    # exp(logp - sg(logp)) is 1 in value and has the gradient of logp (padding: 0, never NaN)
    unit = torch.exp(torch.where(valid, logprobs - logprobs.detach(), torch.zeros_like(logprobs)))
    per_token = -advantages.detach() * weight * unit
    loss = aggregate_loss(per_token, mask, aggregation, max_len)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_frac=masked_mean((weight != ratio).to(ratio.dtype), mask),
            dual_clip_frac=torch.zeros((), dtype=ratio.dtype, device=ratio.device),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            ratio_mean=masked_mean(ratio, mask),
        )
    return loss, stats


def policy_loss(
    objective: PolicyObjective | str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None,
    clip_high: float,
    dual_clip: float | None = None,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    max_len: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """The one place a :class:`PolicyObjective` is dispatched.

    ``ppo_clip`` -> :func:`clipped_policy_loss`, ``gspo`` -> :func:`gspo_policy_loss`, ``cispo`` ->
    :func:`cispo_policy_loss`; the clip bounds are the chosen objective's own (the caller picks them:
    GSPO's sequence ratio needs bounds ~1000x smaller than a token ratio's). ``clip_low`` may be ``None``
    only for cispo (no lower bound); ``dual_clip`` is refused for cispo (no unclipped branch to bound).

    Args:
        logprobs, old_logprobs, advantages, mask: ``(batch, response_len)``, as in :func:`clipped_policy_loss`.

    Returns:
        ``(loss, stats)``: the scalar loss and :class:`PolicyLossStats`.
    """
    objective = PolicyObjective(objective)
    if dual_clip is not None and not objective.supports_dual_clip:
        raise ValueError(f"dual_clip bounds PPO's unclipped branch; {objective.value} has none (set it off)")
    if clip_low is None and objective is not PolicyObjective.CISPO:
        raise ValueError(f"{objective.value} needs clip_low (only cispo may have no lower bound)")
    common = dict(aggregation=aggregation, max_len=max_len, clip_low=clip_low, clip_high=clip_high)
    if objective is PolicyObjective.PPO_CLIP:
        return clipped_policy_loss(logprobs, old_logprobs, advantages, mask, dual_clip=dual_clip, **common)
    if objective is PolicyObjective.GSPO:
        return gspo_policy_loss(logprobs, old_logprobs, advantages, mask, dual_clip=dual_clip, **common)
    if objective is PolicyObjective.CISPO:
        return cispo_policy_loss(logprobs, old_logprobs, advantages, mask, **common)
    raise ValueError(f"unknown policy objective {objective!r}")  # pragma: no cover - the enum is closed


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    max_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO2-style clipped critic loss.

    ``l = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)`` (OpenAI
    baselines ``ppo2``; discussed in Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients").
    The max makes the clip pessimistic: a value already moved more than ``eps`` away from
    ``V_old`` in the direction that lowers the error gets no further gradient.

    Args:
        values: ``(batch, response_len)`` current critic predictions (carry the gradient).
        old_values: ``(batch, response_len)`` predictions at rollout time.
        returns: ``(batch, response_len)`` regression targets (e.g. from :func:`gae`).
        mask: ``(batch, response_len)``.
        clip_eps: the clip range in value units, or ``None`` for the plain squared error.
        aggregation, max_len: see :func:`aggregate_loss`.

    Returns:
        ``(loss, clip_frac)``: scalar loss, and the detached fraction of valid tokens where
        the clipped error was the larger one.
    """
    _check_shapes("values", values=values, old_values=old_values, returns=returns, mask=mask)
    returns = returns.detach()
    err_unclipped = (values - returns) ** 2
    if clip_eps is None:
        per_token = 0.5 * err_unclipped
        clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        if clip_eps <= 0:
            raise ValueError(f"clip_eps must be > 0 or None, got {clip_eps}")
        old_values = old_values.detach()
        values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clipped = (values_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(err_unclipped, err_clipped)
        clip_frac = masked_mean((err_clipped > err_unclipped).to(values.dtype), mask).detach()
    return aggregate_loss(per_token, mask, aggregation, max_len), clip_frac


def truncated_is_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old / pi_sampler, cap)`` per token (TIS; Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").

    A fast rollout engine (vLLM, other kernels, lower precision) samples from a slightly different
    distribution than the trainer's ``pi_old``; weighting each token's policy-gradient term by this
    ratio corrects the bias, and the cap bounds the variance. Multiplying the advantages by the
    weights is the same thing for PPO's clipped objective, since ``w > 0`` factors out of its min.

    Args:
        old_logp, sampling_logp, mask: ``(batch, response_len)``; the log-probs of the trainer's
            policy before the update and of the engine that sampled.
        cap: upper bound ``C > 0`` on each weight.

    Returns:
        ``(batch, response_len)`` detached weights, 0 where ``mask`` is 0.
    """
    _check_shapes("old_logp", old_logp=old_logp, sampling_logp=sampling_logp, mask=mask)
    if not cap > 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0, got {cap}")
    return torch.exp(old_logp.detach() - sampling_logp.detach()).clamp(max=cap) * mask


def sequence_is_mask(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor,
                     threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level masked importance sampling (Seq-MIS): keep a response only if its sequence
    importance ratio ``rho(y) = pi_old(y) / pi_sampler(y) = exp(sum_t (log pi_old - log pi_sampler)(y_t))``
    lies in ``[1 / threshold, threshold]``; the others leave the loss entirely (mask, not truncate).

    Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch" (Seq-MIS: a response whose ``rho`` exceeds ``C`` is masked out,
    where token-level TIS (:func:`truncated_is_weights`, Yao et al. 2025) would only cap each token);
    the lower bound ``1 / C`` is two-sided masking as IcePop's token band (Ling Team 2025, Ring-1T)
    and verl's rollout rejection sampling. ``pi_sampler`` is whatever produced the tokens, so one ratio
    covers both an engine with other numerics and a rollout generated by a policy ``k`` versions old
    (asynchronous training). Used as a mask only; the per-token weighting stays TIS's.

    Worked example (``threshold = 2``, ``ln 2 = 0.693``): row 0's log-ratios ``0.1 + 0.2 = 0.3``,
    ``rho = e^0.3 = 1.35`` -> kept; row 1's ``0.5 + 0.4 = 0.9`` (the masked third token's 5.0 is
    ignored), ``rho = e^0.9 = 2.46 > 2`` -> masked; row 2's ``-0.9``, ``rho = 0.41 < 1/2`` -> masked;
    row 3 has no valid token, ``rho = e^0 = 1`` -> kept (it adds nothing to the loss anyway).

    Args:
        old_logp, sampling_logp, mask: ``(batch, response_len)``; the trainer's log-probs before the
            update (pi_old) and the log-probs of the engine that sampled.
        threshold: ``C > 1``.

    Returns:
        ``keep``: ``(batch,)`` float, 1.0 for a kept response, 0.0 for a masked one; ``rho``:
        ``(batch,)`` the sequence ratios (detached; the log-ratio sum clamped at +-20 before ``exp``).
    """
    _check_shapes("old_logp", old_logp=old_logp, sampling_logp=sampling_logp, mask=mask)
    if not threshold > 1:
        raise ValueError(f"sequence_is_mask: threshold must be > 1, got {threshold}")
    log_rho = ((old_logp.detach() - sampling_logp.detach()) * mask).sum(-1)
    log_c = math.log(threshold)
    keep = ((log_rho <= log_c) & (log_rho >= -log_c)).to(old_logp.dtype)
    return keep, torch.exp(log_rho.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[R - V] / Var[R]`` over valid tokens: 1 is a perfect critic, 0 no better than a constant.

    Args:
        values, returns, mask: ``(batch, response_len)``.

    Returns:
        detached scalar; NaN when the returns have zero variance (undefined, as in
        stable-baselines3).
    """
    _check_shapes("values", values=values, returns=returns, mask=mask)
    values, returns = values.detach(), returns.detach()
    var_returns = masked_var(returns, mask)
    if float(var_returns) == 0.0:
        return torch.full((), math.nan, dtype=values.dtype, device=values.device)
    return 1.0 - masked_var(returns - values, mask) / var_returns
