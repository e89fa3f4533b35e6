"""FP8 (e4m3) linear layers for a rollout engine's sampling copy (``rl.rollout.fp8``).

Decode is bound by the bytes of weights it reads each step; e4m3 weights are half of bf16's. The recipe is the
"row-wise" one of vLLM's and torchao's FP8 inference (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
for the format):

* each weight ``W (N, K)`` gets one scale per output channel: ``s_w[n] = max_k |W[n, k]| / 448`` (448 is e4m3's
  largest finite value), and ``W_q = round_e4m3(W / s_w)``;
* each input ``x (M, K)`` gets one scale per token (row), computed at every call: ``s_x[m] = max_k |x[m, k]| / 448``;
* ``y = (x_q W_q^T) * s_x s_w^T`` is one ``torch._scaled_mm`` (the matrix product in e4m3 on the tensor cores, fp32
  accumulation, the two scales applied to its output), plus the bias in the input's dtype.

Only the sampling copy is quantized; the trainer keeps its own weights and precision, and every weight sync
quantizes the new weights again (:func:`load_quantized`). The LM head and the embeddings stay in the copy's dtype.
The e4m3 matrix product needs compute capability 8.9 or newer (Ada, Hopper): :func:`fp8_unsupported` says why a
device cannot. On a CPU, torch runs ``_scaled_mm`` too (slowly): what tests check the math with.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""e4m3's largest finite magnitude (``torch.finfo(torch.float8_e4m3fn).max``)."""
_MIN_SCALE = 1e-12  # an all-zero row: any positive scale quantizes it to zeros


def fp8_unsupported(device: torch.device) -> str | None:
    """``None`` where ``device`` runs e4m3 matrix products (a CUDA GPU of compute capability >= 8.9); else why not."""
    if device.type != "cuda":
        return (f"FP8 matrix products need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); the engine "
                f"runs on the {device.type.upper()}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"FP8 matrix products need compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x (..., K)`` in e4m3 with a scale of its own: ``s = max|row| / 448``, ``q = round_e4m3(row / s)``.

    Returns ``q (..., K)`` (e4m3) and ``s (..., 1)`` (fp32), so that ``q * s`` approximates ``x`` (:func:`dequantize`).
    For a weight ``(N, K)`` the rows are its output channels; for an input ``(M, K)`` its tokens.
    """
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / E4M3_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q (..., K)`` e4m3 and ``scale (..., 1)`` back to fp32: ``q * scale``."""
    return q.float() * scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with an e4m3 weight: ``x (..., K)`` quantized per token, times ``weight (N, K)`` (e4m3, its
    ``weight_scale (N, 1)`` per output channel); returns ``(..., N)`` in ``x``'s dtype.

    ``y[m, n] = s_x[m] s_w[n] sum_k x_q[m, k] W_q[n, k] (+ b[n])``. On a GPU the product's output is bf16 (what
    torch's row-wise scaled product writes), cast to ``x``'s dtype.
    """
    shape = x.shape
    x_q, x_scale = quantize_rows(x.reshape(-1, shape[-1]))
    out_dtype = torch.bfloat16 if x.device.type == "cuda" else x.dtype
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t().contiguous(),
                           out_dtype=out_dtype).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


class Fp8Linear(torch.nn.Module):
    """A linear layer holding its weight in e4m3 with a scale per output channel (buffers ``weight`` ``(N, K)`` and
    ``weight_scale`` ``(N, 1)``, the bias in the layer's dtype); made from a trained layer by :meth:`from_linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_rows(weight)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Fp8Linear":
        return cls(linear.weight.detach(), linear.bias)

    @torch.no_grad()
    def load_(self, weight: torch.Tensor) -> None:
        """Quantize ``weight (N, K)`` (any float dtype, any device) into this layer, in place."""
        q, scale = quantize_rows(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def quantize_linears(model: Any) -> int:
    """Replace every ``nn.Linear`` of ``model`` but its output embeddings (the LM head) by an :class:`Fp8Linear`
    quantized from it, in place; returns how many were replaced."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and child is not head]
    for parent, name, child in swaps:
        setattr(parent, name, Fp8Linear.from_linear(child))
    return len(swaps)


@torch.no_grad()
def load_quantized(model: Any, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy named tensors (a source model's ``named_parameters()``, same names) into ``model``, in place: a weight of an
    :class:`Fp8Linear` is quantized again (:meth:`Fp8Linear.load_`), any other tensor copied (cast to its dtype)."""
    modules = dict(model.named_modules())
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for name, tensor in named:
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        if isinstance(module, Fp8Linear) and leaf == "weight":
            module.load_(tensor)
        else:
            targets[name].copy_(tensor)
