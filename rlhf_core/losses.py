"""Pure loss math: plain tensor functions, no Ray, DeepSpeed, vLLM, Prefect or MLflow.

Label convention (Hugging Face): ``labels[b, t]`` is the token at position ``t`` itself, or
``-100`` where no loss is taken; the model's logits at ``t`` predict the token at ``t + 1``,
so every function here shifts by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_for_next_token(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align logits with the tokens they predict.

    Args:
        logits: ``(batch, seq_len, vocab)``.
        labels: ``(batch, seq_len)`` with ``-100`` where no loss is taken.

    Returns:
        ``(logits[:, :-1], labels[:, 1:])``: shapes ``(batch, seq_len-1, vocab)`` and
        ``(batch, seq_len-1)``.
    """
    return logits[:, :-1, :], labels[:, 1:]


def token_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token negative log-likelihood over the labelled tokens, and their count.

    ``NLL = - sum_{t: y_t != -100} log p(y_t | x_{<t})`` (the standard maximum-likelihood
    objective of supervised fine-tuning, e.g. Ouyang et al. 2022, "InstructGPT", Sec. 3.5).

    Returning the sum and the count (rather than a mean) lets a trainer normalise by the
    token count of the whole global batch, so gradient accumulation and data-parallel
    workers give the same gradient as one big batch.

    Args:
        logits: ``(batch, seq_len, vocab)``, unshifted.
        labels: ``(batch, seq_len)``, unshifted, ``-100`` where ignored.

    Returns:
        ``(nll_sum, n_tokens)``: a scalar tensor (differentiable) and a scalar long tensor.
    """
    logits, labels = shift_for_next_token(logits, labels)
    nll = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return nll, (labels != IGNORE_INDEX).sum()


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over labelled tokens of one batch (``(B, T, V)``, ``(B, T)`` -> scalar)."""
    nll, n = token_nll_sum(logits, labels)
    return nll / n.clamp(min=1)


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each sequence's labelled tokens.

    ``log pi(y | x) = sum_{t: y_t != -100} log p(y_t | x, y_{<t})``: the quantity DPO-family
    losses compare (Rafailov et al. 2023, Eq. 7).

    Args:
        logits: ``(batch, seq_len, vocab)``, unshifted.
        labels: ``(batch, seq_len)``, unshifted, ``-100`` where ignored.

    Returns:
        ``(batch,)`` summed log-probs (0 for a sequence with no labelled token).
    """
    logits, labels = shift_for_next_token(logits, labels)
    mask = labels != IGNORE_INDEX
    safe = labels.masked_fill(~mask, 0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1)
