"""The single place every trainer gets response log-probs from a model.

A batch holds ``input_ids``, ``attention_mask`` (or ``position_ids`` when packed) and
``labels`` with ``-100`` outside the response; the result is each sequence's summed (or
per-token mean) log-probability of its labelled tokens: one per row of a padded batch, one per
packed sequence of a padding-free one (:func:`sequence_sums`), in the order they were collated.
How the LM head is run (chunked, liger's fused kernel, or whole logits) is the trainer's
:class:`rlhf_core.models.lm_head.LMHead`.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.models.lm_head import MODEL_INPUTS, LMHead, labelled_token_logprobs, scored_logprobs, unwrap
from rlhf_core.algorithms.losses import IGNORE_INDEX, segment_sums

__all__ = ["MODEL_INPUTS", "response_logprobs", "reference_logprobs", "is_packed", "sequence_sums",
           "response_token_counts"]


def response_logprobs(model: Any, batch: dict[str, torch.Tensor], *, average: bool = False,
                      head: LMHead = LMHead()) -> torch.Tensor:
    """``(sequences,)`` log pi(response | prompt) under ``model`` (sum over tokens, or mean if ``average``).

    ``log pi(y | x) = sum_{t: y_t != -100} log p(y_t | x, y_{<t})`` (Rafailov et al. 2023, Eq. 7).
    """
    if "scored_sequence" in batch:
        logps = _tree_logprobs(model, batch, head)
    else:
        logps = sequence_sums(labelled_token_logprobs(model, batch, head), batch)
    if average:
        logps = logps / response_token_counts(batch).to(logps.device).clamp(min=1)
    return logps


def _tree_logprobs(model: Any, batch: dict[str, torch.Tensor], head: LMHead) -> torch.Tensor:
    """``(2B,)`` summed log-probs of pairs as prefix trees (:func:`rlhf_core.data.tokenize.collate_pair_tree`): one
    forward under the tree mask, each labelled token scored at the position its collator named, summed per
    sequence (a labelled token both sequences share is scored once a side)."""
    device = next(unwrap(model).parameters()).device
    inputs = {k: batch[k].to(device, non_blocking=True) for k in MODEL_INPUTS}
    positions, targets, sequence = (batch[k].to(device, non_blocking=True)
                                    for k in ("scored_positions", "scored_targets", "scored_sequence"))
    logp, _ = scored_logprobs(model, inputs, positions, targets, head)
    return torch.zeros(2 * int(batch["n_pairs"]), dtype=logp.dtype, device=device).index_add(0, sequence, logp)


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    """A padding-free batch (``collate_packed``): positions and no attention mask, so transformers
    builds a block-diagonal causal mask from where the positions restart."""
    return "attention_mask" not in batch and "position_ids" in batch


def sequence_sums(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(sequences,)`` sums of next-token ``values`` ``(rows, T-1)``: per row, or per packed sequence."""
    if not is_packed(batch):
        return values.sum(-1)
    return segment_sums(values, batch["position_ids"])  # bookkeeping on the collated (host) positions


def response_token_counts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(sequences,)`` labelled next-token targets of each sequence (long)."""
    if "scored_sequence" in batch:
        return torch.bincount(batch["scored_sequence"], minlength=2 * int(batch["n_pairs"]))
    return sequence_sums((batch["labels"][:, 1:] != IGNORE_INDEX).long(), batch)


@torch.no_grad()
def reference_logprobs(model: Any, batches: list[dict[str, torch.Tensor]], *, average: bool = False,
                       head: LMHead = LMHead()) -> torch.Tensor:
    """Concatenated ``response_logprobs`` of a frozen model over ``batches`` (no graph kept)."""
    was_training = model.training
    model.eval()
    out = torch.cat([response_logprobs(model, b, average=average, head=head).cpu() for b in batches])
    model.train(was_training)
    return out
