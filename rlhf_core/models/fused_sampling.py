"""Temperature sampling of a decode step's logits by inverse CDF, as one Triton kernel (the rollout engine's GPU path).

The contract (:func:`fused_sample`), for ``(rows, V)`` logits, temperature ``T > 0`` and one given uniform ``u`` in
``[0, 1)`` a row: ``x = logits.float() / T``, ``m = max_v x``, ``w_v = exp(x_v - m)``, ``S = sum_v w_v``; the token
is the first ``v`` whose running sum ``w_0 + .. + w_v`` exceeds ``u S`` (inverse-transform sampling, Devroye 1986,
"Non-Uniform Random Variate Generation", ch. 2.1: exact for the softmax distribution), its log-prob
``x_token - m - log S``. That is :func:`rlhf_core.rollout.decode.sampling.sample` without top-k / top-p, which builds
the same sums from torch ops over ``(rows, V)`` fp32 arrays (a log-softmax, an exponential, ``cumsum``,
``searchsorted``, gathers); the kernel reads the logits in their own dtype and writes two numbers a row.

One program a row, in two passes over the row in ``BLOCK``-wide chunks: an online max and sum (Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"), then the running sum, ``tl.cumsum`` within a chunk,
until the first index past ``u S`` (later chunks' loads are masked off, so the scan reads about half the row on
average). A row's result depends on that row's logits and uniform only, never on the batch size or on the other
rows: sampling is batch-invariant (what the parity mode of issue 54 needs).

Where rounding puts ``u S`` at or past the running sum's end (``u`` within float rounding of 1), the token is the
last one of nonzero weight; torch's ``searchsorted`` clamped to ``V - 1`` may then pick a masked (``-inf``) token.

Why a kernel of our own: no library in our pins has a fused inverse-CDF sampler that takes given uniforms and
captures in a CUDA graph (the engine draws every step's uniforms up front, from the call's own generator, so a graph
replays fresh draws). FlashInfer's samplers take probabilities and draw their own Philox numbers from a seed and
offset, which a captured graph bakes in, and its wheels are too large for the lent GPUs' 64 MiB carry; torch has no
such op. Triton is imported lazily: the module imports without it, and :func:`available` says whether the kernel can
run (a CUDA device and Triton, or Triton's interpreter: the CPU tests).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _kernel():
    import triton  # lazy: triton (optional: GPU only)
    import triton.language as tl  # lazy: triton (optional: GPU only)

    @triton.jit
    def inverse_cdf_kernel(logits_ptr, uniform_ptr, token_ptr, logp_ptr, n_cols, temperature,
                           stride_row, stride_uniform, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        lane = tl.arange(0, BLOCK)
        # pass 1: m = max x and S = sum exp(x - m), online over the chunks
        top = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), 0)
        total = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
        for start in range(0, n_cols, BLOCK):
            cols = start + lane
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) / temperature
            new_top = tl.maximum(top, tl.max(x, 0))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a chunk of masked tokens only: no nan
            total = total * tl.exp(top - shift) + tl.sum(tl.exp(x - shift), 0)
            top = new_top
        target = tl.load(uniform_ptr + row * stride_uniform) * total
        # pass 2: the first column whose running sum of w = exp(x - m) exceeds u S; once found, loads are masked off
        running = total * 0.0
        token = tl.min(tl.full((BLOCK,), n_cols, tl.int32), 0)  # n_cols: not found yet
        last = tl.max(tl.full((BLOCK,), -1, tl.int32), 0)  # the last column of nonzero weight
        for start in range(0, n_cols, BLOCK):
            cols = start + lane
            searching = cols < tl.where(token == n_cols, n_cols, 0)  # in the row, and not found yet
            x = tl.load(base + cols, mask=searching, other=float("-inf")).to(tl.float32) / temperature
            w = tl.exp(x - top)
            hit = (running + tl.cumsum(w, 0) > target) & searching
            first = tl.min(tl.where(hit, cols, n_cols), 0)
            token = tl.where(token == n_cols, first, token)
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), 0))
            running += tl.sum(w, 0)
        token = tl.where(token == n_cols, tl.maximum(last, 0), token)
        x_token = tl.load(base + token).to(tl.float32) / temperature
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, x_token - top - tl.log(total))

    return inverse_cdf_kernel


@functools.cache
def available() -> bool:
    """Whether :func:`fused_sample` can run here: Triton importable and a CUDA device (or Triton's interpreter,
    ``TRITON_INTERPRET=1``, which runs the kernel on CPU tensors: the tests)."""
    try:
        import triton  # noqa: F401  # lazy: triton (optional: GPU only)
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def fused_sample(logits: torch.Tensor, uniform: torch.Tensor, temperature: float,
                 block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``(rows,)`` int64 and its ``log_softmax(logits / T)`` ``(rows,)`` fp32 from ``(rows, V)`` logits (any
    float dtype, read as is) and ``uniform (rows, 1)`` fp32 draws in ``[0, 1)``, by the module's inverse-CDF rule.
    ``temperature > 0``; ``block``: columns a chunk, a power of two. Captures in a CUDA graph (no host reads; the
    two outputs are its only allocations)."""
    if not temperature > 0:
        raise ValueError(f"fused_sample: temperature must be > 0, got {temperature!r}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"fused_sample: block {block} must be a power of two >= 16")
    rows, V = logits.shape
    if uniform.shape[0] != rows:
        raise ValueError(f"fused_sample: {uniform.shape[0]} uniforms for {rows} rows")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    token = torch.empty(rows, dtype=torch.long, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _kernel()[(rows,)](logits, uniform, token, logp, V, float(temperature), logits.stride(0), uniform.stride(0),
                       BLOCK=block, num_warps=4)
    return token, logp
