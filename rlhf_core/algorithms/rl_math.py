"""Pure online-RL math: policy and value losses, KL penalties, advantage estimators.

Plain tensor functions (torch and the standard library only; no Ray, DeepSpeed, vLLM,
Prefect or MLflow), so every formula here can be checked against hand-made tensors
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

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

# re-exported: the closed choices are configuration vocabulary (rlhf_core.config.choices); dispatched here
from rlhf_core.config.choices import AdvantageEstimator, KLEstimator, LossAggregation, PolicyObjective  # noqa: F401

# Log-ratios are clamped before ``exp`` in the policy loss: exp(20) ~ 5e8 is already far
# outside any trust region, and the clamp keeps one stale token from producing inf/NaN.
_LOG_RATIO_LIMIT = 20.0


def _check_shapes(reference: str, **tensors: torch.Tensor | None) -> None:
    """Raise a readable ValueError when tensors that must align do not."""
    shape = tensors[reference].shape
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but {reference} has shape {tuple(shape)}")


# --------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is true.

    Args:
        x: any shape, e.g. ``(batch, response_len)``.
        mask: same shape as ``x``, bool or 0/1.
        dim: reduce over this dimension only; ``None`` reduces over everything.

    Returns:
        scalar (``dim=None``) or ``x`` reduced along ``dim``. A slice with no valid entry
        gives 0, not NaN (the count is clamped to 1).
    """
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance (divide by ``n``, not ``n - 1``) of ``x`` over valid entries; scalar."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean) over the valid entries of the whole batch.

    ``x_hat = (x - mean) / sqrt(var + eps)``, statistics over all valid tokens of the batch
    (population variance, as OpenRLHF's global advantage normalisation). With
    ``shift_mean=False`` the mean is added back (TRL's ``masked_whiten`` convention): the
    scale changes but the sign information of e.g. rewards is kept.

    Args:
        x: ``(batch, response_len)``.
        mask: ``(batch, response_len)``.

    Returns:
        ``(batch, response_len)``, 0 at masked entries.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


# --------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, mode: LossAggregation | str,
                   max_len: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    * ``token_mean``: ``sum_{b,t} l_bt / sum_{b,t} m_bt``; every valid token weighs the same,
      so long responses are not down-weighted (DAPO, Yu et al. 2025, Sec. 3.3).
    * ``seq_mean_token_mean``: ``mean_b (sum_t l_bt / |o_b|)``; each sequence weighs the
      same (GRPO, Shao et al. 2024, Eq. 3). Biased towards short correct / long wrong answers.
    * ``seq_mean_token_sum_norm``: ``mean_b (sum_t l_bt / max_len)`` with ``max_len`` the
      fixed generation budget (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
      Training", Sec. 3): removes GRPO's length bias with a constant that does not depend
      on the batch.

    Sequence modes average over rows with at least one valid token; a fully masked row (e.g.
    a padding row that fills a micro-batch) is ignored rather than counted as a zero.

    Args:
        per_token_loss: ``(batch, response_len)``.
        mask: ``(batch, response_len)``.
        mode: a :class:`LossAggregation` (or its string value).
        max_len: the generation budget; required for ``seq_mean_token_sum_norm``. Not
            defaulted to ``response_len``: the padded width changes from batch to batch,
            which would bring back the length-dependent normaliser Dr.GRPO removes.

    Returns:
        scalar loss.
    """
    mode = LossAggregation(mode)
    _check_shapes("per_token_loss", per_token_loss=per_token_loss, mask=mask)
    m = mask.to(per_token_loss.dtype)
    if mode is LossAggregation.TOKEN_MEAN:
        return masked_mean(per_token_loss, m)
    tokens_per_row = m.sum(-1)
    has_tokens = (tokens_per_row > 0).to(per_token_loss.dtype)
    row_sums = (per_token_loss * m).sum(-1)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        row_losses = row_sums / tokens_per_row.clamp(min=1)
    elif mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        if max_len is None or max_len <= 0:
            raise ValueError(f"{mode.value} needs max_len, the positive generation budget; got {max_len}")
        row_losses = row_sums / max_len
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return (row_losses * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def aggregation_units(mask: torch.Tensor, mode: LossAggregation | str) -> torch.Tensor:
    """The denominator :func:`aggregate_loss` divides by: valid tokens, or rows with a valid token.

    Every mode is ``sum(row or token terms) / units``, so data-parallel shards combine exactly:
    the loss of the whole batch is ``sum_r units_r * loss_r / sum_r units_r`` over shards ``r``.

    Args:
        mask: ``(batch, response_len)``.

    Returns:
        scalar count (float).
    """
    mode = LossAggregation(mode)
    m = mask.float()
    if mode is LossAggregation.TOKEN_MEAN:
        return m.sum()
    return (m.sum(-1) > 0).float().sum()


# --------------------------------------------------------------------------------------
# Policy and value losses
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# KL penalty and controllers
# --------------------------------------------------------------------------------------


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: KLEstimator | str,
               clamp: float | None = None, k3_cap: float | None = None) -> torch.Tensor:
    """Per-token KL estimate (Schulman 2020, "Approximating KL Divergence", k1/k2/k3).

    Use it either as a reward penalty (``token_rewards = -beta * kl``, Ziegler et al. 2019,
    Sec. 2.2; k1 is the usual choice) or as a loss term aggregated with :func:`aggregate_loss`
    (GRPO, k3).

    Args:
        logp: ``(batch, response_len)`` log-probs of the sampled tokens under the policy.
        logp_ref: ``(batch, response_len)`` the same under the frozen reference.
        estimator: a :class:`KLEstimator` (or its string value).
        clamp: if set, ``log_ratio`` is clamped to ``[-clamp, clamp]`` first. k3 contains
            ``exp(-log_ratio)``, which explodes where the policy gives a token far less
            probability than the reference; clamping bounds k3 by ``e^clamp - 1 - clamp``
            (verl uses 20 on the log-ratio). ``None`` gives the exact estimator.
        k3_cap: k3 only: if set (> 0), each token's k3 value is clamped to at most ``k3_cap``
            after it is computed (verl's ``low_var_kl`` and OpenRLHF's k3 cap it at 10). The
            log-ratio clamp alone still lets one token at ``log pi - log pi_ref = -12`` add
            ``e^12 - 1 - 12 = 1.6e5`` (``4.9e8`` at -20), which swamps the whole batch's loss.
            Trade-off: where the cap binds, the value no longer depends on ``logp``, so the
            penalty's gradient there is zero: the token is no longer pulled back toward the
            reference (for k3, d k3 / d logp = 1 - pi_ref / pi, Schulman 2020), only the other
            tokens are. k3 >= 0 everywhere, capped or not. Ignored for k1 and k2.

    Returns:
        ``(batch, response_len)``; multiply by the mask before summing.
    """
    if k3_cap is not None and not k3_cap > 0:
        raise ValueError(f"k3_cap must be > 0 (or None for no cap), got {k3_cap}")
    estimator = KLEstimator(estimator)
    _check_shapes("logp", logp=logp, logp_ref=logp_ref)
    log_ratio = logp - logp_ref
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if estimator is KLEstimator.K1:
        return log_ratio
    if estimator is KLEstimator.K2:
        return 0.5 * log_ratio**2
    if estimator is KLEstimator.K3:
        # r = pi_ref / pi; (r - 1) - log r with log r = -log_ratio. expm1, not exp(.) - 1: near
        # log_ratio = 0 the subtraction cancels every digit (fp32, |log_ratio| < 1e-3: wrong by
        # orders of magnitude, and negative); expm1(-x) >= -x holds after rounding, so k3 >= 0.
        k3 = torch.expm1(-log_ratio) + log_ratio
        # an upper bound only, so k3 >= 0 still holds
        return k3 if k3_cap is None else k3.clamp(max=k3_cap)
    raise ValueError(f"unknown KL estimator {estimator!r}")  # pragma: no cover - the enum is closed


class KLController(Protocol):
    """The shape every KL-coefficient controller has; the trainer reads ``value`` each step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant KL coefficient ``beta``; ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        """``{"value": beta}`` for a checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore ``value`` from :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", Sec. 2.2).

    ``e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e_t * n_steps / horizon)``:
    a proportional controller that raises ``beta`` while the policy drifts past the target
    KL and lowers it while it stays below (the paper's ``K_beta = 0.1`` per step is
    ``n_steps / horizon`` here, as in TRL and OpenRLHF).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"target KL must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """One controller step after observing mean per-sequence KL ``current_kl`` over ``n_steps`` samples."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """``{"value": beta}``: target and horizon are configuration, not state, so a resumed
        run may change them."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore ``value`` from :meth:`state_dict`."""
        self.value = float(state["value"])


# --------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Entropy
# --------------------------------------------------------------------------------------


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each token's next-token distribution.

    ``H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v`` with ``p = softmax(z)``: the
    second form never takes the log of an underflowed probability, so it stays finite for
    large or peaked logits. Logged as ``train/entropy`` to watch for entropy collapse (the
    motivation of DAPO's clip-higher); as an optional bonus, subtract
    ``entropy_coef * aggregate_loss(entropy, mask, mode)`` from the loss (Mnih et al. 2016,
    "A3C"). Computed in float32 whatever the logits' dtype.

    Args:
        logits: ``(batch, response_len, vocab)``.

    Returns:
        ``(batch, response_len)`` entropies in nats, in ``[0, log vocab]``.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
