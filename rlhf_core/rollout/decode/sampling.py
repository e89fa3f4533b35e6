"""Sampling on the device: temperature, top-k, top-p by inverse CDF (:func:`sample`, compiled:
:func:`compiled_sample`; plain temperature sampling through one Triton kernel: :func:`triton_sample`), the choice
between them (:func:`sampling_function`, by ``SETTINGS.sampler``) and a chunk's sampling state (:class:`Sampler`),
all device ops, so a captured graph runs them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rlhf_core.models import fused_sampling
from rlhf_core.models.layer_compile import INDUCTOR_OPTIONS
from rlhf_core.rollout.decode.settings import SETTINGS
from rlhf_core.rollout.engine import SamplingParams


@functools.cache
def compiled_sample() -> Any:
    """:func:`sample` with :func:`sampling_weights` through ``torch.compile``: the float cast, log-softmax,
    top-k mask and exponential over ``(B, V)`` logits fuse into one kernel; the running sum, the search
    and the gather stay torch's (see :func:`sample` on why the scan is not compiled)."""
    return functools.partial(sample, weights_fn=torch.compile(sampling_weights, fullgraph=True,
                                                               options=INDUCTOR_OPTIONS))


def choose_sampler(device: torch.device, triton: bool = True) -> str:
    """``triton`` or ``torch``, by ``SETTINGS.sampler``: auto takes triton on a CUDA device where the kernel
    (:mod:`rlhf_core.models.fused_sampling`) can run, unless ``triton`` is False (it failed to build here:
    :meth:`rlhf_core.rollout.static.StaticCacheEngine._check_sampler`), else torch; triton where it cannot run
    raises."""
    choice = SETTINGS.sampler
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"the decode sampler (SETTINGS.sampler) must be auto, triton or torch, got {choice!r}")
    if choice == "triton" and not fused_sampling.available():
        raise ValueError("the decode sampler triton (SETTINGS.sampler) needs Triton and a CUDA device (or Triton's "
                         "interpreter, TRITON_INTERPRET=1); use auto or torch")
    if choice == "auto":
        return "triton" if triton and device.type == "cuda" and fused_sampling.available() else "torch"
    return choice


def sampling_function(kind: str, compiled: bool) -> Any:
    """The decode step's sampling function, :func:`sample`'s signature: :func:`triton_sample` for ``kind``
    ``triton`` (its torch fallback :func:`compiled_sample` where ``compiled``), else that torch function."""
    torch_sample = compiled_sample() if compiled else sample
    return functools.partial(triton_sample, fallback=torch_sample) if kind == "triton" else torch_sample


def triton_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                  uniform: torch.Tensor | None = None, fallback: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample`'s contract: temperature sampling with no top-k / top-p through one Triton kernel
    (:func:`rlhf_core.models.fused_sampling.fused_sample`: the same inverse-CDF rule, no ``(rows, V)`` fp32 arrays,
    each row independent of the others); greedy, top-k, top-p, or no given ``uniform`` ``(rows, 1)``: ``fallback``
    (None: :func:`sample`)."""
    if params.greedy or params.top_k or params.top_p < 1.0 or uniform is None:
        return (fallback or sample)(logits, params, generator=generator, uniform=uniform)
    return fused_sampling.fused_sample(logits, uniform, params.temperature)


def sampling_weights(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / T)`` ``(rows, V)`` and the unnormalised probabilities ``exp(s - max s)``
    ``(rows, V)`` of the top-k / top-p filtered scores ``s``, whose running sum is the sampling CDF
    (temperature > 0)."""
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    scores = logp
    if params.top_k:  # keep the k largest (ties at the k-th kept, as HF's TopKLogitsWarper)
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:  # the smallest set whose mass reaches top_p (HF's TopPLogitsWarper rule)
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - params.top_p
        drop_sorted[:, -1] = False
        scores = scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    return logp, (scores - scores.amax(-1, keepdim=True)).exp_()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
            uniform: torch.Tensor | None = None, weights_fn: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``(rows,)`` and its ``log_softmax(logits / T)`` ``(rows,)`` from ``(rows, V)`` logits.

    ``uniform`` ``(rows, 1)``: the rows' U(0, 1) draws, given (a captured graph cannot draw from a
    generator it does not own); else drawn from ``generator``. ``weights_fn``: :func:`sampling_weights`
    compiled (:func:`compiled_sample`), used without top-p (its running sum is a scan, which inductor of
    torch 2.11 failed to generate for a few rows: ``SplitScan`` codegen,
    bench/results/h200/*/gpu_engine_h200_decode_ab.log).
    """
    if params.greedy:
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    weigh = weights_fn if weights_fn is not None and params.top_p == 1.0 else sampling_weights
    logp, weights = weigh(logits, params)
    # Inverse-CDF sampling: one uniform per row, u * total mass located in the running sum of
    # softmax(s). Exact like Gumbel-max, but draws B numbers instead of B x V (profiled at B = 512,
    # V = 32k: the per-element noise cost as much as a third of the decode step).
    cdf = weights.cumsum_(-1)
    if uniform is None:
        uniform = torch.rand((cdf.shape[0], 1), device=cdf.device, generator=generator)
    u = uniform * cdf[:, -1:]
    token = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class Sampler:
    """A chunk's sampling state on the device: the sampled tokens and log-probs so far, which rows have
    finished, the next column ``t``, and (graph path) every step's uniforms. ``B`` rows, ``R`` new tokens."""

    def __init__(self, params: SamplingParams, rows: int, R: int, eos: int, pad: int, device: torch.device):
        self.params, self.eos, self.pad = params, eos, pad
        self.out_ids = torch.full((rows, R), pad, dtype=torch.long, device=device)
        self.out_logp = torch.zeros((rows, R), dtype=torch.float32, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)
        self.uniforms = torch.zeros((R, rows, 1), dtype=torch.float32, device=device)

    def reset(self) -> None:
        """Back to a fresh sampler's state, in place (a kept decoder's captured graphs read these buffers)."""
        self.out_ids.fill_(self.pad)
        self.out_logp.zero_()
        self.finished.zero_()
        self.t.zero_()
        self.uniforms.zero_()

    def record(self, token: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """Write column ``t`` (rows past their eos get pad), update ``finished``, advance ``t``; the token
        ``(B,)`` the next decode step feeds. Device ops only, so a captured graph can run it."""
        token = token.masked_fill(self.finished, self.pad)
        self.out_ids.index_copy_(1, self.t, token[:, None])
        self.out_logp.index_copy_(1, self.t, logp[:, None])
        self.finished |= token == self.eos
        for stop in self.params.stop_token_ids:  # a tool call's closing tag ends the turn like eos
            self.finished |= token == stop
        self.t += 1
        return token

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.out_ids, self.out_logp, self.finished, self.t

