"""The single place every trainer gets response log-probs from a model.

A batch holds ``input_ids``, ``attention_mask`` (or ``position_ids`` when packed) and
``labels`` with ``-100`` outside the response; the result is each sequence's summed (or
per-token mean) log-probability of its labelled tokens: one per row of a padded batch, one per
packed sequence of a padding-free one (:func:`sequence_sums`), in the order they were collated.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.losses import IGNORE_INDEX, segment_sums, token_logprobs

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def response_logprobs(model: Any, batch: dict[str, torch.Tensor], *, average: bool = False) -> torch.Tensor:
    """``(batch,)`` log pi(response | prompt) under ``model`` (sum over tokens, or mean if ``average``)."""
    device = next(model.parameters()).device
    inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
    labels = batch["labels"].to(device)
    logits = model(**inputs, use_cache=False).logits
    logps = sequence_sums(token_logprobs(logits, labels), batch)
    if average:
        logps = logps / response_token_counts(batch).to(logps.device).clamp(min=1)
    return logps


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    """A padding-free batch (``collate_packed``): positions and no attention mask, so transformers
    builds a block-diagonal causal mask from where the positions restart."""
    return "attention_mask" not in batch and "position_ids" in batch


def sequence_sums(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(sequences,)`` sums of next-token ``values`` ``(rows, T-1)``: per row, or per packed sequence."""
    if not is_packed(batch):
        return values.sum(-1)
    return segment_sums(values, batch["position_ids"].to(values.device))


def response_token_counts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(sequences,)`` labelled next-token targets of each sequence (long)."""
    return sequence_sums((batch["labels"][:, 1:] != IGNORE_INDEX).long(), batch)


@torch.no_grad()
def reference_logprobs(model: Any, batches: list[dict[str, torch.Tensor]], *, average: bool = False) -> torch.Tensor:
    """Concatenated ``response_logprobs`` of a frozen model over ``batches`` (no graph kept)."""
    was_training = model.training
    model.eval()
    out = torch.cat([response_logprobs(model, b, average=average).cpu() for b in batches])
    model.train(was_training)
    return out
