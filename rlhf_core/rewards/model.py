"""Reward models: a causal-LM backbone with a scalar head read at the last non-pad token (of each row, or of
each sequence of a packed row).

Built on ``AutoModelForSequenceClassification(num_labels=1)`` — transformers' own scalar head
for Llama/Qwen2-style models, which already reads the logit at each row's last non-pad
token — so a reward model is an ordinary HF directory (safetensors + config.json) that any
HF tool loads. Normalisation statistics (mean and std of training rewards) are stored in its
``config.json`` as ``alignflow_reward_mean`` / ``alignflow_reward_std``; :func:`score`
returns normalised rewards, so PPO sees rewards of unit scale whatever the backbone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from rlhf_core.models.attention import packed_forward_kwargs
from rlhf_core.data.tokenize import collate_padded, tokenize_prompt_completion
from rlhf_core.algorithms.logprobs import is_packed
from rlhf_core.algorithms.losses import segment_last_index
from rlhf_core.models.loading import ModelLoadError, attn_implementation, pick_device

MEAN_KEY, STD_KEY = "alignflow_reward_mean", "alignflow_reward_std"


def load_reward_model(path: str | Path, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                      attention: str = "auto") -> Any:
    """A scalar-head model from an HF directory (a trained reward model, or an LM to start one from),
    its parameters in ``dtype`` and its attention as ``attention`` says (see
    :func:`rlhf_core.models.loading.load_causal_lm`)."""
    from transformers import AutoModelForSequenceClassification  # lazy: transformers (~1 s; with a model only)

    path = Path(path)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
    device = device or pick_device()
    implementation = attn_implementation(path, device, attention)
    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=dtype,
                                                               attn_implementation=implementation)
    if model.config.pad_token_id is None:
        raise ModelLoadError(f"{path}: config has no pad_token_id; the reward head needs it to find the last token")
    return model.to(device)


def pair_rewards(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(2B,)`` raw rewards of a :func:`rlhf_core.data.tokenize.collate_pairs` batch, padded or packed, or of a
    :func:`rlhf_core.data.tokenize.collate_pair_tree` batch.

    ``model`` may be wrapped (DDP, a DeepSpeed engine): it is always called through the wrapper,
    so data-parallel gradient reduction sees the forward.
    """
    device = next(model.parameters()).device
    if "last_index" in batch:  # pairs as prefix trees (collate_pair_tree): the tree mask, scores at each last token
        return packed_rewards(model, batch["input_ids"].to(device, non_blocking=True),
                              batch["position_ids"].to(device, non_blocking=True),
                              index=batch["last_index"].to(device, non_blocking=True),
                              attention_mask=batch["attention_mask"].to(device, non_blocking=True))
    if not is_packed(batch):
        return model(input_ids=batch["input_ids"].to(device, non_blocking=True),
                     attention_mask=batch["attention_mask"].to(device, non_blocking=True)).logits.squeeze(-1).float()
    # the read positions and the attention bounds from the collated (host) tensors: no wait for the device
    pad = getattr(model, "module", model).config.get_text_config().pad_token_id
    index = segment_last_index(batch["position_ids"], batch["input_ids"] != pad).to(device, non_blocking=True)
    extra = packed_forward_kwargs(model, batch["position_ids"], device)
    return packed_rewards(model, batch["input_ids"].to(device, non_blocking=True),
                          batch["position_ids"].to(device, non_blocking=True), index=index, **extra)


def packed_rewards(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                   index: torch.Tensor | None = None, **forward_kwargs: Any) -> torch.Tensor:
    """``(sequences,)`` scores of packed rows ``(rows, T)``, each read at its sequence's last non-pad token.

    The HF forward pools one score per row (its rightmost non-pad token), so it cannot serve a row
    holding several sequences. The ``score`` head's output at every position is taken from the
    same forward with a hook instead, and pooled per sequence with transformers' rule
    (:func:`rlhf_core.algorithms.losses.segment_last_index`). ``use_cache=False`` matters: with a cache
    transformers ignores ``position_ids`` when building the mask and the sequences would see
    each other. ``index``: those positions, when the caller already has them; ``forward_kwargs`` go to the
    model (:func:`rlhf_core.models.attention.packed_forward_kwargs`).
    """
    head = getattr(model, "module", model).score  # under DDP / DeepSpeed, the wrapped HF model's head
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    try:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **forward_kwargs)
    finally:
        hook.remove()
    scores = captured[-1].squeeze(-1).float().reshape(-1)  # (rows * T,)
    if index is None:
        pad = getattr(model, "module", model).config.get_text_config().pad_token_id
        index = segment_last_index(position_ids, input_ids != pad)
    return scores[index]


def set_normalisation(model: Any, mean: float, std: float) -> None:
    """Store reward statistics in the model config (saved with ``save_pretrained``)."""
    setattr(model.config, MEAN_KEY, float(mean))
    setattr(model.config, STD_KEY, float(max(std, 1e-6)))


@torch.no_grad()
def score(model: Any, tokenizer: Any, prompts: Sequence[str], completions: Sequence[str], *,
          batch_size: int = 64, max_length: int = 256, normalise: bool = True) -> list[float]:
    """Rewards of ``prompt + completion`` pairs (normalised with the stored statistics).

    ``prompts`` are the text the policy read, already rendered (a conversation with the chat template and
    its generation prompt, :func:`rlhf_core.data.formats.prompt_text`), and ``completions`` the decoded
    answers without special tokens: the eos appended here closes the turn as in training, where a
    conversational answer ends at its end-of-turn eos (:func:`rlhf_core.data.formats.completion_text`). So
    the score is read at the token training read it at, provided the reward model renders chats as the
    policy does (a reward model trained from the SFT model shares its template).
    """
    model.eval()
    device = next(model.parameters()).device
    mean = getattr(model.config, MEAN_KEY, 0.0) if normalise else 0.0
    std = getattr(model.config, STD_KEY, 1.0) if normalise else 1.0
    out: list[float] = []
    for start in range(0, len(prompts), batch_size):
        exs = [tokenize_prompt_completion(tokenizer, p, c, max_length)
               for p, c in zip(prompts[start:start + batch_size], completions[start:start + batch_size])]
        batch = collate_padded(exs, tokenizer.pad_token_id)
        raw = model(input_ids=batch["input_ids"].to(device),
                    attention_mask=batch["attention_mask"].to(device)).logits.squeeze(-1).float()
        out.extend(((raw - mean) / std).tolist())
    return out
