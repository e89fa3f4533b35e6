"""Decode-step attention over each cache row's filled keys, as one Triton kernel (the rollout engine's GPU path).

At a decode step each cache row has one new query position, and its ``G = H / H_kv`` query heads share each KV
head. The engine used torch's varlen flash forward with those ``G`` heads folded into ``G`` query rows of one
sequence (``rlhf_core.rollout.decode.attention.flash_layout_attention``): exact, but flash's tiles are 64-128
query rows tall, so a tile of 7 real rows does 9-18x the score work it needs, and its grid is one program per
(row, KV head, query tile). Profiled (Qwen2-0.5B shape, 512 rows, cache half full; BENCHMARKS.md, "Rollout decode"), it took
several times a layer's key and value traffic. This kernel is split-free flash-decoding (Dao et al. 2023,
"Flash-Decoding for long-context inference"; the online softmax of Milakov & Gimelshein 2018): one program per
(cache row, KV head) holds that head's ``G`` queries as one ``M``-row tile (``M`` = ``G`` rounded up to 16, the
smallest ``tl.dot``), walks the row's ``used[b]`` keys in blocks of ``BLOCK_N`` and keeps a running max, sum and
weighted value sum in fp32. ``B * H_kv`` programs (1,024 at 512 rows and 2 KV heads) fill the card without
splitting the keys, at the row counts a rollout runs.

Why a kernel of our own: no well-kept library on the lent GPUs' image has a decode kernel for this layout
(FlashInfer and vLLM's paged kernels are not installable there; liger-kernel has none; torch 2.11's flash op takes
no ``num_splits`` and pads query tiles). ``used`` is read on the device, so one CUDA graph serves every step as the
rows' caches fill. Triton is imported lazily: the module imports without it, and :func:`available` says whether
the kernel can run (a CUDA device and Triton). ``decode_attention_reference`` is the same contract in torch (the
CPU tests compare the kernel, run by Triton's interpreter, against it).
"""

from __future__ import annotations

import functools
import os

import torch


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_k: torch.Tensor,
                               used: torch.Tensor, width: int, scale: float) -> torch.Tensor:
    """The contract, in torch (fp32 softmax): ``q (B Q, H_q, D)`` — ``Q`` query rows a cache row, query head ``h``
    reading KV head ``h // (H_q / H_kv)``; ``k``, ``v (B W, H_kv, D)``, row ``b``'s keys at ``cu_k[b] ..
    cu_k[b] + used[b] - 1``; ``width``: the most keys a row has. Returns ``(B Q, H_q, D)`` in ``q``'s dtype."""
    rows, heads, D = q.shape
    B = cu_k.shape[0] - 1
    Q, kv_heads = rows // B, k.shape[1]
    cols = torch.arange(width, device=q.device)
    index = (cu_k[:-1, None].long() + cols).clamp(max=k.shape[0] - 1)  # (B, W)
    keys = k[index].float().repeat_interleave(heads // kv_heads, dim=2)  # (B, W, H_q, D)
    values = v[index].float().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bwhd->bhqw", q.view(B, Q, heads, D).float(), keys) * scale
    scores = scores.masked_fill(~(cols < used[:, None].long())[:, None, None, :], float("-inf"))
    o = torch.einsum("bhqw,bwhd->bqhd", scores.softmax(-1), values)
    return o.reshape(rows, heads, D).to(q.dtype)


@functools.cache
def _kernel():
    import triton  # lazy: triton (optional: GPU only)
    import triton.language as tl  # lazy: triton (optional: GPU only)

    @triton.jit
    def decode_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_k_ptr, used_ptr, scale,
                                stride_qr, stride_qh, stride_kr, stride_kh, stride_or, stride_oh,
                                Q: tl.constexpr, R: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                                BLOCK_N: tl.constexpr):
        # program (b, j): cache row b, KV head j; its M query vectors m = r * R + g (r < Q rows, g < R heads)
        b, j = tl.program_id(0), tl.program_id(1)
        m = tl.arange(0, M)
        d = tl.arange(0, D)
        live = m < Q * R
        q_rows, q_heads = b * Q + m // R, j * R + m % R
        q = tl.load(q_ptr + q_rows[:, None] * stride_qr + q_heads[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)
        first, n_keys = tl.load(cu_k_ptr + b), tl.load(used_ptr + b)
        top = tl.full((M,), float("-inf"), tl.float32)
        total = tl.zeros((M,), tl.float32)
        acc = tl.zeros((M, D), tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x log2 e)
        for start in range(0, n_keys, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            in_row = n < n_keys
            kv_off = (first + n).to(tl.int64)[:, None] * stride_kr + j * stride_kh + d[None, :]  # caches past 2^31
            keys = tl.load(k_ptr + kv_off, mask=in_row[:, None], other=0.0)
            s = tl.dot(q, tl.trans(keys)) * qk_scale  # (M, BLOCK_N), fp32
            s = tl.where(in_row[None, :], s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            p = tl.exp2(s - new_top[:, None])
            rescale = tl.exp2(top - new_top)
            total = total * rescale + tl.sum(p, 1)
            values = tl.load(v_ptr + kv_off, mask=in_row[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(values.dtype), values)
            top = new_top
        out = acc / total[:, None]
        tl.store(o_ptr + q_rows[:, None] * stride_or + q_heads[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=live[:, None])

    return decode_attention_kernel


@functools.cache
def available() -> bool:
    """Whether :func:`decode_attention` can run here: Triton importable and a CUDA device (or Triton's
    interpreter, ``TRITON_INTERPRET=1``, which runs the kernel on CPU tensors: the tests)."""
    try:
        import triton  # noqa: F401  # lazy: triton (optional: GPU only)
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_k: torch.Tensor, used: torch.Tensor,
                     scale: float, block_n: int = 64) -> torch.Tensor:
    """:func:`decode_attention_reference`'s contract through the Triton kernel (no ``width``: each program
    reads its row's ``used[b]`` keys). ``q``, ``k``, ``v``: last dimension contiguous, head size a power of two
    of at least 16; ``cu_k``, ``used`` int32. Captures in a CUDA graph (no host reads)."""
    rows, heads, D = q.shape
    B, kv_heads = cu_k.shape[0] - 1, k.shape[1]
    Q, R = rows // B, heads // kv_heads
    if D < 16 or D & (D - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"decode_attention: head size {D} (a power of two >= 16) and contiguous heads needed")
    if k.stride() != v.stride():
        raise ValueError("decode_attention: k and v must share one layout")
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as torch's flash op returns it
    M = max(16, 1 << (Q * R - 1).bit_length())
    _kernel()[(B, kv_heads)](q, k, v, o, cu_k, used, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             o.stride(0), o.stride(1), Q=Q, R=R, D=D, M=M, BLOCK_N=block_n,
                             num_warps=4, num_stages=2)
    return o
