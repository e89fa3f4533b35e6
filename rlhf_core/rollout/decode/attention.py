"""The decode step's attention over the static cache: which layout and kernel (:func:`use_flash`,
:func:`choose_row_kernel`, by ``SETTINGS.attention``) and the attention of each cache row's queries over that row's
filled keys (:func:`flash_layout_attention`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rlhf_core.models import decode_attention as row_attention
from rlhf_core.rollout.decode.settings import SETTINGS


def use_flash(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decode step attends over each row's filled keys (the row-contiguous cache layout, through
    :func:`choose_row_kernel`'s kernel) rather than masked SDPA over the whole cache (``SETTINGS.attention``;
    auto: a CUDA device of compute capability 8.0 or later, a bf16/fp16 cache, a head size the flash kernel takes)."""
    choice = SETTINGS.attention
    if choice not in ("auto", "triton", "flash", "sdpa"):
        raise ValueError(f"the decode attention (SETTINGS.attention) must be auto, triton, flash or sdpa, "
                         f"got {choice!r}")
    if choice != "auto":
        return choice in ("flash", "triton")  # on a CPU: the torch reference, or Triton's interpreter (tests)
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.cuda.get_device_capability(device)[0] >= 8 and _flash_takes_used_keys())


def choose_row_kernel(device: torch.device, head_dim: int, triton: bool = True) -> str:
    """The kernel of the row-contiguous layout: ``triton`` (:mod:`rlhf_core.models.decode_attention`) when chosen, or
    under auto on a CUDA device where Triton imports and the head size is a power of two of at least 16; else
    ``flash``. Auto takes it on Hopper (compute capability 9), where it was measured faster than torch's flash op
    (BENCHMARKS.md, "Rollout decode"), and leaves other cards on the flash op until
    measured there; it falls back to flash where the Triton kernel fails to build (``triton=False`` from then on:
    :meth:`rlhf_core.rollout.static.StaticCacheEngine._check_row_kernel`)."""
    if SETTINGS.attention == "triton":
        if not row_attention.available():
            raise ValueError("the decode attention triton needs Triton and a CUDA device (or Triton's "
                             "interpreter, TRITON_INTERPRET=1); use auto, flash or sdpa")
        return "triton"
    pow2 = head_dim >= 16 and not head_dim & (head_dim - 1)
    return "triton" if (triton and SETTINGS.attention == "auto" and device.type == "cuda" and pow2
                        and torch.cuda.get_device_capability(device)[0] == 9 and row_attention.available()) else "flash"


@functools.cache
def _flash_takes_used_keys() -> bool:
    """Whether this torch's flash op takes a per-row count of used keys (``seqused_k``)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and "seqused_k" in str(op.default._schema)


def flash_layout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      width: int, used: torch.Tensor, scale: float, kernel: str = "flash") -> torch.Tensor:
    """Each cache row's queries over that row's filled keys only (flash attention's variable-length form,
    Dao 2023).

    ``q (B Q, H_q, D)``: ``Q`` query rows a cache row (1: one per decode position, ``H_q = H``; or the ``G``
    query heads of each KV head folded into rows, ``H_q = H_kv``, so the kernel reads a row's keys once per KV
    head); ``k``, ``v (B W, H_kv, D)``: the rows' caches laid end to end, row ``b``'s keys
    ``k[cu_k[b] : cu_k[b] + used[b]]``; ``cu_q (B + 1,)`` = ``0, Q, 2Q ..``, ``cu_k (B + 1,)``, ``used (B,)``
    int32 on the device (``used`` grows in place each step, so one captured graph serves every step);
    ``width`` = ``W``, the most keys a row has. Returns ``(B Q, H_q, D)``; query head ``h`` reads KV head
    ``h // (H_q / H_kv)``. On a CPU (tests) the same keys go through SDPA with a mask. ``kernel="triton"``: our
    flash-decoding kernel (:func:`rlhf_core.models.decode_attention.decode_attention`) instead of torch's flash op.
    """
    if kernel == "triton":
        return row_attention.decode_attention(q, k, v, cu_k, used, scale)
    rows, heads, D = q.shape
    B = cu_k.shape[0] - 1
    Q = rows // B
    if q.is_cuda:
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, Q, width, 0.0, False, False,
                                                       scale=scale, seqused_k=used)[0]
    cols = torch.arange(width, device=q.device)
    index = (cu_k[:-1, None].long() + cols).clamp(max=k.shape[0] - 1)  # (B, W)
    keys, values = k[index].transpose(1, 2), v[index].transpose(1, 2)  # (B, H_kv, W, D)
    mask = (cols < used[:, None])[:, None, None]  # (B, 1, 1, W)
    o = F.scaled_dot_product_attention(q.view(B, Q, heads, D).transpose(1, 2), keys, values, attn_mask=mask,
                                       scale=scale, enable_gqa=heads != k.shape[1])  # (B, H_q, Q, D)
    return o.transpose(1, 2).reshape(rows, heads, D)

