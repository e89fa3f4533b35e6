"""Masked statistics and reductions over response tokens: means, variances, whitening, loss aggregation, entropy.

Plain tensor functions (torch only). Tensor conventions (shapes, masks, group layout):
:mod:`rlhf_core.algorithms.rl_math`.
"""

from __future__ import annotations

import torch

from rlhf_core.config.choices import LossAggregation


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
