"""The single place every trainer gets response log-probs from a model.

A batch holds ``input_ids``, ``attention_mask`` (or ``position_ids`` when packed) and
``labels`` with ``-100`` outside the response; the result is each row's summed (or
per-token mean) log-probability of its labelled tokens. How the LM head is run (chunked,
liger's fused kernel, or whole logits) is the trainer's :class:`rlhf_core.lm_head.LMHead`.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.lm_head import MODEL_INPUTS, LMHead, labelled_token_logprobs
from rlhf_core.losses import IGNORE_INDEX

__all__ = ["MODEL_INPUTS", "response_logprobs", "reference_logprobs"]


def response_logprobs(model: Any, batch: dict[str, torch.Tensor], *, average: bool = False,
                      head: LMHead = LMHead()) -> torch.Tensor:
    """``(batch,)`` log pi(response | prompt) under ``model`` (sum over tokens, or mean if ``average``).

    ``log pi(y | x) = sum_{t: y_t != -100} log p(y_t | x, y_{<t})`` (Rafailov et al. 2023, Eq. 7).
    """
    logps = labelled_token_logprobs(model, batch, head).sum(-1)  # (B,)
    if average:
        logps = logps / (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1).to(logps.device)
    return logps


@torch.no_grad()
def reference_logprobs(model: Any, batches: list[dict[str, torch.Tensor]], *, average: bool = False,
                       head: LMHead = LMHead()) -> torch.Tensor:
    """Concatenated ``response_logprobs`` of a frozen model over ``batches`` (no graph kept)."""
    was_training = model.training
    model.eval()
    out = torch.cat([response_logprobs(model, b, average=average, head=head).cpu() for b in batches])
    model.train(was_training)
    return out
