"""Padding-free attention for packed rows: torch's variable-length flash attention behind transformers.

A packed batch (:func:`rlhf_core.data.tokenize.collate_packed`) is one row ``(1, T)`` of several
sequences whose ``position_ids`` restart at 0. Under transformers' SDPA path such a row gets a dense
``(T, T)`` block-diagonal mask, and the attention kernel still visits every masked block: on a GPU that
made packed rows slower than padded ones (BENCHMARKS.md). Flash attention's variable-length kernel takes
the sequence boundaries instead (``cu_seqlens``) and attends within each sequence only, so packing saves
the padded tokens' whole cost (a DPO batch of 0.5B-shaped pairs is about a third padding).

No attention library is installed on the GPU image (no ``flash-attn``, no hub kernels): the kernel here
is torch's own ``torch.nn.attention.varlen.varlen_attn`` (flash attention inside torch). This module only
adapts it to transformers' attention interface:

* :data:`VARLEN` is registered with ``AttentionInterface`` (the attention function) and
  ``AttentionMaskInterface`` (which builds no mask for rows without padding, so no ``(T, T)`` mask is
  ever made for a packed row);
* rows with a padding mask, or with a KV cache (generation), go to transformers' SDPA function with
  the mask SDPA would have had: only the training and scoring passes take the varlen path.

:func:`varlen_attention` is the one function both paths share; without CUDA (the CPU tests) it runs a
plain torch reference, causal SDPA per sequence, so a CPU test exercises the same dispatch and
segment bookkeeping the GPU runs. Run ``python bench/gpu_lm_head_check.py --parts packed`` on a GPU for
the kernel's comparison with padded SDPA (bf16 against fp32).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["VARLEN", "register", "available", "use_varlen", "segment_bounds", "varlen_attention",
           "attention_forward", "packed_forward_kwargs"]

VARLEN = "alignflow_varlen"


@functools.cache
def _kernel() -> Any | None:
    """torch's ``varlen_attn`` (torch >= 2.10 with CUDA), or ``None``."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # lazy: torch (optional: varlen_attn is in newer torch only)
    except ImportError:
        return None
    return varlen_attn


def available(device: torch.device) -> bool:
    """Whether the flash varlen kernel can run on ``device`` (CUDA and a torch that has it)."""
    return device.type == "cuda" and _kernel() is not None


def use_varlen(config: Any, device: torch.device, choice: str = "auto") -> bool:
    """Whether a model of ``config`` on ``device`` loads with :data:`VARLEN` attention.

    ``choice``: ``auto`` (when the kernel is available and the model has neither a sliding window nor
    attention dropout, which the kernel call here does not implement), ``varlen`` (force; on a CPU the
    torch reference runs: for tests) or ``sdpa`` (never).
    """
    if choice not in ("auto", "varlen", "sdpa"):
        raise ValueError(f"attention must be auto, varlen or sdpa, got {choice!r}")
    if choice != "auto":
        return choice == "varlen"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sliding = getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None)
    return available(device) and not sliding and not getattr(text, "attention_dropout", 0.0)


def segment_bounds(position_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` ``(S + 1,)`` int32 and the longest sequence of ``rows`` rows of positions.

    A sequence starts where ``position_ids`` is 0 and at the start of every row (so unpadded rows
    whose positions are one shared ``(1, T)`` arange are ``rows`` sequences of ``T``).

    Args:
        position_ids: ``(1 or rows, T)``.
    """
    T = position_ids.shape[-1]
    starts = position_ids.expand(rows, T) == 0
    starts[:, 0] = True
    first = starts.flatten().nonzero().flatten()
    total = torch.tensor([rows * T], device=first.device, dtype=first.dtype)
    cu = torch.cat([first, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())  # one host read per forward (the bounds are cached per call)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float,
               gqa: bool) -> torch.Tensor:
    """Causal SDPA within each sequence: what the kernel computes, in plain torch (CPU tests)."""
    out = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # (H, L, D)
        out.append(F.scaled_dot_product_attention(*seg, is_causal=True, scale=scale,
                                                  enable_gqa=gqa).transpose(0, 1))
    return torch.cat(out)


@functools.cache
def _kernel_params() -> frozenset[str]:
    """The keyword parameters of this torch's ``varlen_attn`` (read once: it is called per layer)."""
    return frozenset(inspect.signature(_kernel()).parameters)


def _kernel_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                 scale: float) -> torch.Tensor:
    """``varlen_attn``, causal, across the torch releases' two signatures (``is_causal`` in 2.10-2.11,
    ``window_size`` later); K/V heads repeated for grouped-query models where ``enable_gqa`` is missing."""
    params = _kernel_params()
    kwargs: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return _kernel()(q, k, v, cu, cu, longest, longest, **kwargs)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                     scale: float) -> torch.Tensor:
    """Causal attention within each sequence of a packed token list.

    Args:
        q: ``(T, H, D)``; k, v: ``(T, H_kv, D)`` (``H`` a multiple of ``H_kv``).
        cu: ``(S + 1,)`` int32 sequence starts and ``T`` (:func:`segment_bounds`).
        longest: the longest sequence.
    Returns:
        ``(T, H, D)``.
    """
    if q.is_cuda and _kernel() is not None:
        return _kernel_call(q, k, v, cu, longest, scale)
    return _reference(q, k, v, cu, scale, q.shape[1] != k.shape[1])


# Layer calls by path since import (a benchmark's check that packed rows took the varlen kernel); calls from
# compiled layers (rlhf_core.models.layer_compile) are not counted.
calls = {"varlen": 0, "sdpa": 0}

# The bounds of the forward in progress: every layer gets the same position_ids tensor, so they are worked
# out (one host read) at the first layer only. Holding the tensor keeps its id from being reused.
_bounds_cache: dict[str, Any] = {"key": None}


def _bounds(position_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    key = (position_ids, rows)
    cached = _bounds_cache["key"]
    if cached is None or cached[0] is not position_ids or cached[1] != rows:
        _bounds_cache["key"], _bounds_cache["value"] = key, segment_bounds(position_ids, rows)
    return _bounds_cache["value"]


# Decoders (``config.model_type``) whose forward takes an already prepared mask per attention type as
# ``attention_mask`` (a dict; transformers then builds none): what :func:`packed_forward_kwargs` hands them.
MASK_MAPPING_TYPES = ("qwen2", "qwen3")


def _skips_mask_preparation(config: Any) -> bool:
    """Whether a packed row of this model may skip transformers' mask preparation: a decoder that takes a
    mask mapping, every layer full attention (a sliding window would be dropped with the mask)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (getattr(config, "model_type", None) in MASK_MAPPING_TYPES and not getattr(config, "use_sliding_window", False)
            and set(layer_types) == {"full_attention"})


def packed_forward_kwargs(model: Any, position_ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """Forward keyword arguments carrying a packed row's sequence bounds, worked out from ``position_ids``
    where they live (the collated batch's CPU tensor), for a model that attends with :data:`VARLEN`.

    Without them the first layer works the bounds out from the device's copy of the positions: a
    ``nonzero`` and a host read of the longest sequence, two waits for the device in every forward, each
    stopping the host from queueing work ahead of the device (the gaps of
    ``bench/results/h100/*/prof_h100_0p5b_gaps.json``). transformers passes a model's extra
    keyword arguments down to its attention function; the names are the ones its own flash-attention
    path reads (``cu_seq_lens_q`` ...). ``{}`` for any other model (it may not take them).

    For a decoder of :data:`MASK_MAPPING_TYPES` it also passes ``attention_mask`` as ``{attention type: None}``:
    the varlen kernel needs no mask, and building one for a packed row reads its positions on the host
    (transformers' ``find_packed_sequence_indices`` ends in a Python ``if (...).all()``), the one wait for the
    device left in such a forward (``bench/results/h200/*/census_h200_0p5b_grpo_after.json``). Other decoders
    (Llama,
    Mistral in transformers 5) build their mask themselves and keep that wait.
    """
    base = model
    while hasattr(base, "module"):  # DDP / DeepSpeed
        base = base.module
    if getattr(getattr(base, "config", None), "_attn_implementation", None) != VARLEN:
        return {}
    cu, longest = segment_bounds(position_ids, position_ids.shape[0])
    cu = cu.to(device, non_blocking=True)  # from pageable memory: staged at once, no wait for the device
    out = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if _skips_mask_preparation(base.config):
        out["attention_mask"] = {"full_attention": None}
    return out


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query (B, H, T, D)``, ``key/value (B, H_kv, S, D)``;
    returns ``(B, T, H, D)``. Varlen when there is no mask and no cache (``T == S``), else SDPA."""
    from transformers.integrations.sdpa_attention import (  # lazy: transformers (~1 s; with a model only)
        sdpa_attention_forward)

    position_ids = kwargs.get("position_ids")
    B, H, T, D = query.shape
    counted = not torch.compiler.is_compiling()  # a counter a compiled layer bumped would be a guard on its value
    if attention_mask is not None or position_ids is None or key.shape[2] != T:
        calls["sdpa"] += counted
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    calls["varlen"] += counted
    if kwargs.get("cu_seq_lens_q") is not None:  # worked out on the host (packed_forward_kwargs)
        cu, longest = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    else:
        cu, longest = _bounds(position_ids, B)
    flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (query, key, value)]  # (B*T, heads, D)
    out = varlen_attention(*flat, cu, longest, scaling if scaling is not None else D ** -0.5)
    return out.view(B, T, H, D), None


def _mask(**kwargs: Any) -> torch.Tensor | None:
    """No mask where :func:`attention_forward` takes the varlen path (no padding, no cache offset:
    the sequences come from ``position_ids``); SDPA's mask everywhere else (transformers' keyword
    arguments passed on unchanged). Causal LMs with extra mask terms (images, block overlays) are
    not among the models this is switched on for (:func:`use_varlen` callers: decoder-only text LMs)."""
    from transformers.masking_utils import sdpa_mask  # lazy: transformers (~1 s; with a model only)

    q_offset, kv_offset = kwargs.get("q_offset"), kwargs.get("kv_offset", 0)
    plain = (kwargs.get("attention_mask") is None and isinstance(q_offset, int) and isinstance(kv_offset, int)
             and q_offset == kv_offset == 0 and kwargs.get("q_length") == kwargs.get("kv_length"))
    return None if plain else sdpa_mask(**kwargs)


def register() -> str:
    """Register :data:`VARLEN` with transformers (idempotent); its name, for ``attn_implementation``."""
    from transformers import AttentionInterface  # lazy: transformers (~1 s; with a model only)
    from transformers.masking_utils import AttentionMaskInterface  # lazy: transformers (~1 s; with a model only)

    AttentionInterface.register(VARLEN, attention_forward)
    AttentionMaskInterface.register(VARLEN, _mask)
    return VARLEN
