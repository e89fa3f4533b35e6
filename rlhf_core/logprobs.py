"""The single place every trainer gets response log-probs from a model.

A batch holds ``input_ids``, ``attention_mask`` (or ``position_ids`` when packed) and
``labels`` with ``-100`` outside the response; the result is each row's summed (or
per-token mean) log-probability of its labelled tokens, computed by
:func:`rlhf_core.losses.sequence_logprobs`.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.losses import IGNORE_INDEX, sequence_logprobs

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def response_logprobs(model: Any, batch: dict[str, torch.Tensor], *, average: bool = False) -> torch.Tensor:
    """``(batch,)`` log pi(response | prompt) under ``model`` (sum over tokens, or mean if ``average``)."""
    device = next(model.parameters()).device
    inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
    labels = batch["labels"].to(device)
    logits = model(**inputs, use_cache=False).logits
    logps = sequence_logprobs(logits, labels)
    if average:
        logps = logps / (labels[:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1)
    return logps


@torch.no_grad()
def reference_logprobs(model: Any, batches: list[dict[str, torch.Tensor]], *, average: bool = False) -> torch.Tensor:
    """Concatenated ``response_logprobs`` of a frozen model over ``batches`` (no graph kept)."""
    was_training = model.training
    model.eval()
    out = torch.cat([response_logprobs(model, b, average=average).cpu() for b in batches])
    model.train(was_training)
    return out
