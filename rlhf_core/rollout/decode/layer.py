"""The decode step's layer as pure functions of tensors (what torch.compile compiles on a GPU), and the
weights it reads: a projection's weight with its LoRA adapters merged (:func:`merged_weight`), biases.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from rlhf_core.models.fp8 import fp8_linear
from rlhf_core.models.layer_compile import INDUCTOR_OPTIONS


def weight_scale(linear: Any) -> torch.Tensor | None:
    """An FP8 layer's per-output-channel weight scale ``(N, 1)`` (:class:`rlhf_core.models.fp8.Fp8Linear`); ``None``
    for a layer of another dtype."""
    return getattr(linear, "weight_scale", None)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            scale: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, or with an e4m3 ``weight`` and its ``scale (N, 1)`` the FP8 product
    (:func:`rlhf_core.models.fp8.fp8_linear`)."""
    return F.linear(x, weight, bias) if scale is None else fp8_linear(x, weight, scale, bias)


def merged_weight(linear: Any) -> torch.Tensor:
    """A projection's weight as the layer applies it: a LoRA layer's base weight plus each active adapter's
    ``s B A`` (peft's ``get_delta_weight``, Hu et al. 2021 Eq. 3) unless the adapters are off or already merged;
    a plain layer's own weight (the same tensor, no copy)."""
    if not hasattr(linear, "get_base_layer"):
        return linear.weight
    weight = linear.get_base_layer().weight
    if linear.disable_adapters or linear.merged:
        return weight
    for adapter in linear.active_adapters:
        if adapter in linear.lora_A:
            # peft keeps adapters in fp32 over a bf16 base (autocast_adapter_dtype): the sum stays the base's dtype
            weight = weight + linear.get_delta_weight(adapter).to(weight.dtype)
    return weight



def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021, Eq. 34) as the Llama family's ``apply_rotary_pos_emb``:
    ``x cos + rotate_half(x) sin`` on ``(B, heads, T, D)`` with ``cos``/``sin`` ``(B, T, D)``.

    Ours rather than the model module's: liger-kernel (``fused_kernels``) replaces that module function
    with a Triton kernel that needs q and k of one shape, and the decode step rotates Q and K heads in one
    call and K alone in another (an empty-tensor call).
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama-family RMSNorm (statistics in float32, scaled in the input dtype) as one fused op."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)



def attention_inputs(x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor,
                      qkv_b: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                      kv_heads: int, contiguous_q: bool = False,
                      qkv_s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-attention half of a Llama-family layer at one decode position: RMS norm, Q/K/V as one GEMM,
    rotary on the Q and K heads at once.

    ``x (B, 1, hidden)``, ``qkv_w ((H + 2 H_kv) D, hidden)``, ``cos``/``sin (B, 1, D)``; returns
    ``q (B, H, 1, D)`` (``contiguous_q``: laid out contiguously, as the flash call takes it), ``k``,
    ``v (B, H_kv, 1, D)``. ``qkv_s ((H + 2 H_kv) D, 1)``: ``qkv_w``'s per-channel scale where it is e4m3 (:func:`project`).
    """
    B, D = x.shape[0], cos.shape[-1]
    qkv = project(_rms_norm(x, norm_w, eps), qkv_w, qkv_b, qkv_s).view(B, heads + 2 * kv_heads, 1, D)
    qk, _ = rotate(qkv[:, :heads + kv_heads], qkv[:, :0], cos, sin)
    q = qk[:, :heads]
    return q.contiguous() if contiguous_q else q, qk[:, heads:], qkv[:, heads + kv_heads:]


def output_and_mlp(x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                    norm_w: torch.Tensor, eps: float, gate_up_w: torch.Tensor, gate_up_b: torch.Tensor | None,
                    down_w: torch.Tensor, down_b: torch.Tensor | None, o_s: torch.Tensor | None = None,
                    gate_up_s: torch.Tensor | None = None, down_s: torch.Tensor | None = None) -> torch.Tensor:
    """Post-attention half: output projection and residual, RMS norm, the gated SiLU MLP (Shazeer 2020) with
    gate and up as one GEMM, residual. ``x (B, 1, hidden)``, ``o (B, 1, H D)``; returns ``(B, 1, hidden)``.
    ``*_s``: the weights' per-channel scales where they are e4m3 (:func:`project`)."""
    x = x + project(o, o_w, o_b, o_s)
    gate, up = project(_rms_norm(x, norm_w, eps), gate_up_w, gate_up_b, gate_up_s).chunk(2, dim=-1)
    return x + project(F.silu(gate) * up, down_w, down_b, down_s)


def biases(linears: Sequence[Any]) -> list[torch.Tensor] | None:
    """The biases of ``linears`` (a LoRA layer's: its base layer's, peft's ``bias``; plain LoRA adds none);
    ``None`` when none has one (ValueError when only some do: that layout is left to the model's modules)."""
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("some projections have a bias and some do not")
    return biases


@functools.cache
def compiled_layer_halves() -> tuple[Any, Any]:
    """:func:`attention_inputs` and :func:`output_and_mlp` through ``torch.compile`` (inductor), built once
    per process: every layer has the same shapes, so one compiled graph each serves all of them (recompiled
    only for a new row count). Why compile rather than hand-written kernels: the halves are chains of small
    elementwise ops around GEMMs (a profile counts ~120 elementwise kernels in a decode iteration; BENCHMARKS.md,
    "Rollout decode") that inductor fuses; the attention in between stays a
    kernel call of its own, outside the compiled graphs, and every cache write with it."""
    return (torch.compile(attention_inputs, fullgraph=True, options=INDUCTOR_OPTIONS),
            torch.compile(output_and_mlp, fullgraph=True, options=INDUCTOR_OPTIONS))

