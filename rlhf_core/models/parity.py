"""Batch-invariant forward passes: the rollout engine and the trainer compute the same log-probs bit for bit
(``rl.rollout.parity``).

The engine decodes a token at a time over a KV cache with whatever rows are still in its batch; the trainer scores
whole sequences in micro-batches of its own, and left padding puts a sequence's keys at other columns in each.
Floating-point sums depend on how their terms are grouped, so the two sides' log-probs of one token differ in the
last bits: the mismatch that ``rollout/logprob_mismatch`` logs and TIS corrects. Here every reduction a forward
makes is grouped the same way for a row whatever shares its batch (He et al. 2025, "Defeating Nondeterminism in
LLM Inference", batch invariance):

* :func:`blocked_linear`: each ``nn.Linear`` runs as one batched matmul over blocks of :data:`BLOCK_ROWS` rows
  (zero rows pad the last block), so a row meets the math library's kernel in a block of the same shape whether it
  is decoded alone or scored among thousands;
* :func:`canonical_attention`: a transformers attention that moves each row's keys to their logical positions (its
  left padding shifted out), pads them to a fixed ``key_length``, and computes scores and outputs as batched matmuls
  over blocks of :data:`BLOCK_ROWS` queries against all ``key_length`` slots: the same shapes for a query in a
  prefill, a cached decode step or a full forward;
* norms, rotary embeddings and the MLP's activation reduce within a row or act elementwise, and are left as they are.

Both in-process engines run it: HF ``generate`` calls the model's forward, and the static engine
(:class:`rlhf_core.rollout.decode.decoder.Decoder` in parity mode) runs the model's own modules and
:func:`canonical_attention` over its KV cache, decoding eagerly. The model-tier tests
(``tests/model/test_parity.py``, ``tests/model/test_parity_static.py``) check on a CPU that a batch of 64
left-padded sequences, each sequence alone and rows that ended early score the same bits, and that three GRPO steps
with either engine log a mismatch of exactly 0; ``bench/parity_probe.py`` and ``bench/gpu_grpo.py --parity`` check
the same on a GPU in bf16. What parity costs in each phase is in BENCHMARKS.md (``bench/parity_abba.sh`` on a CPU,
``bench/gpu_grpo.py --parity`` on a GPU).
The trainer's forward then runs the model's own modules too: ``rl.rollout.parity`` turns compiled layers and liger's
kernels off.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "alignflow_parity"
"""The ``attn_implementation`` name :func:`make_batch_invariant` registers and sets."""
BLOCK_ROWS = 16


def blocked_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T (+ b)`` for ``x (..., K)``, as one batched matmul over blocks of :data:`BLOCK_ROWS` rows."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded = F.pad(flat, (0, 0, 0, (-rows) % BLOCK_ROWS))
    blocks = padded.shape[0] // BLOCK_ROWS
    out = torch.bmm(padded.view(blocks, BLOCK_ROWS, -1), self.weight.t().unsqueeze(0).expand(blocks, -1, -1))
    out = out.reshape(-1, self.weight.shape[0])[:rows]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def canonical_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **_: Any) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention with every row's keys at their logical positions, padded to the model's
    ``config.parity_key_length``.

    query ``(B, H, Tq, D)``; key, value ``(B, Hkv, Tk, D)``; ``attention_mask``: transformers' boolean
    ``(B, 1, Tq, Tk)`` (True: attend) or None (no padding: causal over the last ``Tq`` positions). Returns
    ``(B, Tq, H, D)``. A padding query that may attend to nothing gets zeros (not NaN, which would reach real rows
    through the values)."""
    B, H, Tq, D = query.shape
    Tk, length = key.shape[2], module.config.parity_key_length
    if Tk > length:
        raise ValueError(f"parity attention: {Tk} keys, more than rl.max_length ({length}) the layout was fixed for")
    key = key.repeat_interleave(H // key.shape[1], dim=1)
    value = value.repeat_interleave(H // value.shape[1], dim=1)
    if attention_mask is None:
        allowed = (torch.arange(Tk).view(1, Tk) <= torch.arange(Tk - Tq, Tk).view(Tq, 1)).expand(B, 1, Tq, Tk)
    else:
        allowed = attention_mask.bool().expand(B, 1, Tq, Tk)
    allowed = allowed.to(query.device)
    shift = allowed[:, 0, -1, :].int().argmax(-1)  # each row's left padding: the first key its last query sees
    src = torch.arange(length, device=query.device).view(1, length) + shift.view(B, 1)  # slot i <- key i + shift
    inside = (src < Tk).view(B, 1, length, 1)
    src = src.clamp(max=Tk - 1)
    take = src.view(B, 1, length, 1).expand(B, H, length, D)
    key, value = torch.gather(key, 2, take) * inside, torch.gather(value, 2, take) * inside
    allowed = torch.gather(allowed, 3, src.view(B, 1, 1, length).expand(B, 1, Tq, length)) & inside.view(B, 1, 1, length)
    # queries in blocks of BLOCK_ROWS, each block one (BLOCK_ROWS x D) @ (D x length) and (BLOCK_ROWS x length) @
    # (length x D) matmul of a batch: the same shapes for a query decoded alone or scored among a whole sequence
    blocks = -(-Tq // BLOCK_ROWS)
    q = F.pad(query, (0, 0, 0, blocks * BLOCK_ROWS - Tq)).reshape(B * H * blocks, BLOCK_ROWS, D)
    k = key.unsqueeze(2).expand(B, H, blocks, length, D).reshape(B * H * blocks, length, D)
    v = value.unsqueeze(2).expand(B, H, blocks, length, D).reshape(B * H * blocks, length, D)
    scores = torch.bmm(q, k.transpose(1, 2)).view(B, H, blocks * BLOCK_ROWS, length)[:, :, :Tq]
    scores = scores * (scaling if scaling is not None else D ** -0.5)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    p = F.pad(probs, (0, 0, 0, blocks * BLOCK_ROWS - Tq)).reshape(B * H * blocks, BLOCK_ROWS, length)
    out = torch.bmm(p, v).view(B, H, blocks * BLOCK_ROWS, D)[:, :, :Tq]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface  # lazy: transformers (~1 s; with a model only)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # lazy: transformers (~1 s; with a model only)

    AttentionInterface.register(ATTENTION, canonical_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def make_batch_invariant(model: Any, key_length: int) -> Any:
    """Switch ``model`` (a transformers causal LM, peft adapters included: call it after they are injected) to the
    batch-invariant forward, in place; ``key_length``: the longest prompt + response it will see. Idempotent."""
    _register()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.parity_key_length = key_length
    base.set_attn_implementation(ATTENTION)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(blocked_linear, module)
    return model


def is_batch_invariant(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "_attn_implementation", None) == ATTENTION
