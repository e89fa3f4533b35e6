"""Log-probs of chosen tokens straight from the LM head, without a ``[tokens x vocab]`` logits tensor.

Every trainer but the reward model needs ``log p(y_t | x_{<t})`` of given tokens: SFT's NLL, the
preference losses' sequence sums, RL's per-token ratios. The plain path (``full``) runs the whole LM head,
keeps float32 logits of every position for backward (16k tokens x 152k vocabulary = 10 GB, twice
in backward) and then reads one entry per row. The alternatives, chosen by ``lm_head``:

* ``auto`` (the default): only the labelled positions go through the head: by ``liger`` where it can
  run and no entropy gradient is asked (a logged entropy is computed beside it, without one), else their
  logits whole while they stay small, else ``chunked`` (:class:`LMHead`).

* ``chunked`` (any device, any strategy): only the labelled positions go through the head, a chunk
  of ``chunk_tokens`` rows at a time, each chunk under activation checkpointing, so forward keeps
  no logits at all and backward rebuilds one chunk's logits at a time. Costs one extra head matmul
  per chunk (the recompute). It calls the head *module*, so DeepSpeed ZeRO-3's hooks gather its
  weight as for any layer; plain torch, so it is what the CPU tests run.
* ``liger`` (CUDA, liger-kernel installed, head weight whole on this rank): liger-kernel's fused
  linear cross-entropy (Triton; ``-loss`` with ``reduction='none'`` is the per-token log-prob), in
  chunks of about ``chunk_tokens`` rows (:func:`liger_chunk_mem_const`). Pinned at 0.8.5 or later:
  earlier versions scaled every token's gradient by the first token's upstream gradient under
  ``reduction='none'`` (linkedin/Liger-Kernel PR #1298), which an advantage-weighted loss would have
  silently broken.

Why not liger everywhere: it needs the head's weight as a tensor (ZeRO-3 holds shards), returns no
entropy (RL logs one: computed beside it without a gradient, :func:`resolve_kernel`; an entropy bonus in
the loss needs its gradient and so the chunked path), and does not run on a CPU. The decoder's own fused
kernels (RMSNorm: torch's own for the Llama family; RoPE, SwiGLU: liger's) are applied by
:func:`apply_fused_kernels`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from rlhf_core.models.attention import packed_forward_kwargs
from rlhf_core.models.layer_compile import compile_decoder_layers, use_compiled_layers

log = logging.getLogger(__name__)

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class LMHead:
    """How a trainer turns hidden states into token log-probs (resolved from ``lm_head``)."""

    kernel: str = "chunked"
    """auto, chunked, liger or full (see the module docstring)."""
    chunk_tokens: int = 4096
    """Rows of the head per chunk on the chunked and liger paths."""
    prefer_liger: bool = False
    """auto: liger's kernel wherever it runs (fused kernels on, the whole head on this rank) and no entropy gradient
    is asked (it returns no entropy; a logged one is computed beside it, :func:`resolve_kernel`). In chunks of 4,096
    rows it beat whole logits at every size measured, in time and memory (forward + backward of
    16,381 x 1,536 -> 151,936 at about an eighth of the whole logits' memory; BENCHMARKS.md, the LM-head check)."""
    whole_bytes: int = 2 * 2**30
    """auto without liger: float32 logits of the scored positions up to this size are made whole (one matmul,
    kept for backward: faster than chunked, whose recompute costs 2x at these sizes), past it chunked."""


# --------------------------------------------------------------------------------------
# Pure math: hidden states (N, H) and targets (N,) -> log-probs (N,)
# --------------------------------------------------------------------------------------


def _chunk_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float, with_entropy: bool,
                    entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(head(h) / T)[y]`` and the entropy of each row of one chunk: ``(n, H), (n,) -> (n,), (n,)``.

    ``log softmax(z)[y] = z_y - logsumexp(z)`` and ``H = logsumexp(z) - sum_v softmax(z)_v z_v``; the
    entropy carries a gradient only with ``entropy_grad`` (RL logs it; it enters the loss only with a coefficient).
    """
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, logp.new_zeros(())
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def chunked_token_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                           *, temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = True,
                           chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(N,)`` (and entropies ``(N,)``) of ``targets`` under ``head(hidden) / temperature``.

    Args:
        head: the LM head (``(n, H) -> (n, V)``), called once per chunk (and again per chunk in backward).
        hidden: ``(N, H)`` final hidden states, one row per scored token.
        targets: ``(N,)`` token ids.

    Each chunk runs under non-reentrant activation checkpointing when a gradient is needed, so no
    ``(chunk, V)`` tensor outlives its chunk: memory is one chunk's float32 logits instead of N rows'.
    """
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(
        p.requires_grad for p in getattr(head, "parameters", lambda: [])()))
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if grad:
            lp, ent = checkpoint(_chunk_logprobs, head, h, y, temperature, with_entropy, entropy_grad,
                                 use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(head, h, y, temperature, with_entropy, entropy_grad)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


def liger_chunk_mem_const(rows: int, hidden: int, vocab: int, chunk_rows: int) -> int:
    """liger's ``chunk_mem_const`` that splits ``rows`` scored tokens into chunks of about ``chunk_rows`` rows.

    liger-kernel 0.8.5 cuts the ``(rows, hidden)`` input into chunks of
    ``next_pow2(ceil(rows / ceil(vocab / (C * hidden))))`` rows (at most ``rows``). Its default ``C = 1``
    bounds a chunk's logits by the hidden states' size, which at a large vocabulary makes chunks tiny: 64
    rows for a 1.5B DPO micro-batch's 5.5k scored tokens at vocab 151,936 and hidden 1,536, so each of
    86 chunks runs four GEMMs that each stream the whole 467 MB head weight for 64 rows of work (about
    40% of the step's device time in a profile, BENCHMARKS.md).
    Asking for ``k = ceil(rows / chunk_rows)`` chunks, ``C = ceil(vocab / (k * hidden))`` gives
    ``ceil(vocab / (C * hidden)) <= k``: chunks of at least ``rows / k`` rows and at most twice ``chunk_rows``
    after the power-of-two rounding, or liger's default chunk where that is larger (``C`` cannot go below 1:
    a small vocabulary over many rows); ``tests/unit/test_lm_head.py`` checks both bounds.
    """
    chunks = max(1, -(-rows // max(1, chunk_rows)))
    return max(1, -(-vocab // (chunks * hidden)))


def liger_token_logprobs(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor, *,
                         temperature: float = 1.0, chunk_rows: int = 4096) -> torch.Tensor:
    """``(N,)`` log-probs of ``targets`` under ``hidden @ weight.T / temperature`` by liger's fused kernel.

    ``weight`` is ``(V, H)``; ``hidden`` ``(N, H)`` is cast to its dtype (the kernel wants one dtype).
    Dividing the hidden state by T divides the logits by T. ``chunk_rows``: rows of the head per chunk
    (:func:`liger_chunk_mem_const`; a chunk's transient logits are ``chunk x V`` in the weight's dtype);
    0 keeps liger's own default chunking.
    """
    from liger_kernel.transformers.functional import (  # lazy: liger_kernel (optional gpu extra)
        liger_fused_linear_cross_entropy)

    x = hidden.to(weight.dtype)
    if temperature != 1.0:
        x = x / temperature
    # The kernel takes the count of scored tokens as an int, which Triton specialises on (divisible by 16
    # or not): a new count class recompiles, ~1-2 s each, seen as step-time spikes. Padding to
    # a multiple of 16 with extra rows (zero hidden state, token 0) keeps one compiled variant; their
    # losses are dropped, so their upstream gradient is 0 and (per-token gradients, liger >= 0.8.5) so is
    # their contribution to the weight's gradient.
    n = x.shape[0]
    pad = -n % 16
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        targets = torch.cat([targets, targets.new_zeros(pad)])
    const = liger_chunk_mem_const(x.shape[0], x.shape[1], weight.shape[0], chunk_rows) if chunk_rows else 1
    # reduction="none": liger 0.8.5 keeps no gradient from forward and recomputes each chunk in backward,
    # where the per-token upstream gradient is known (linkedin/Liger-Kernel PR #1298)
    loss = liger_fused_linear_cross_entropy(x, weight, targets, ignore_index=-100, reduction="none",
                                            chunk_mem_const=const)
    return -loss[:n].float()


# --------------------------------------------------------------------------------------
# From a model: run the decoder, score the chosen positions
# --------------------------------------------------------------------------------------


def unwrap(model: Any) -> Any:
    """The model under a DDP or DeepSpeed wrapper (which hold it as ``.module``)."""
    return getattr(model, "module", model)


@contextmanager
def head_bypassed(model: Any) -> Iterator[Any]:
    """Within the block, ``model(...)`` returns the final hidden states as ``.logits``; yields the LM head.

    The head is swapped for ``Identity`` on the unwrapped model and put back after, so a DDP or
    DeepSpeed wrapper's forward (its gradient hooks, ZeRO's gathers) still runs around the decoder.
    """
    base = unwrap(model)
    head = base.get_output_embeddings()
    base.set_output_embeddings(torch.nn.Identity())
    try:
        yield head
    finally:
        base.set_output_embeddings(head)


def supports_head_bypass(model: Any) -> bool:
    """Whether the causal LM's logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping or
    logit scale after the head, which the bypass would skip), so the chunked/liger paths are exact."""
    cfg = unwrap(model).config
    return not any(getattr(cfg, name, None) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


def scored_logprobs(model: Any, inputs: dict[str, torch.Tensor], positions: torch.Tensor, targets: torch.Tensor,
                    head: LMHead, *, temperature: float = 1.0, with_entropy: bool = False,
                    **forward_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(N,)`` of ``targets`` predicted at ``positions`` (and entropies), for any ``head.kernel``.

    Args:
        inputs: ``input_ids`` etc., ``(B, T)``, on the model's device.
        positions: ``(B, T)`` bool mask of the positions whose next-token prediction is scored, or ``(N,)``
            their flat indices into ``B * T`` (increasing): selecting by index waits for nothing, where a
            bool mask on the device makes forward and backward each wait for the device (``nonzero``).
        targets: ``(N,)`` the token each scored position predicts (N = ``positions.sum()``), row-major.
    """
    if not bypasses_head(model, head):
        logits = _select(model(**inputs, use_cache=False, **forward_kwargs).logits, positions)  # (N, V)
        logp, entropy = _chunk_logprobs(torch.nn.Identity(), logits, targets, temperature, with_entropy)
        return logp, (entropy if with_entropy else None)
    with head_bypassed(model) as lm_head:
        hidden = _select(model(**inputs, use_cache=False, **forward_kwargs).logits, positions)  # (N, H)
    return head_logprobs(lm_head, hidden, targets, head, temperature=temperature, with_entropy=with_entropy)


def _select(out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of ``out`` ``(B, T, D)`` at ``positions`` (bool ``(B, T)`` or flat indices ``(N,)``): ``(N, D)``."""
    if positions.dtype == torch.bool:
        return out[positions]
    return out.flatten(0, 1).index_select(0, positions)


def bypasses_head(model: Any, head: LMHead) -> bool:
    """Whether ``head`` scores tokens from hidden states (chunked, liger) on this model, rather than
    from the model's own logits (``full``, or a model that post-processes its logits)."""
    return head.kernel != "full" and supports_head_bypass(model)


def head_logprobs(lm_head: Any, hidden: torch.Tensor, targets: torch.Tensor, head: LMHead, *, temperature: float = 1.0,
                  with_entropy: bool = False, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(N,)`` log-probs (and entropies) of ``targets`` from final hidden states ``(N, H)`` through
    ``lm_head`` by ``head.kernel`` (:func:`resolve_kernel`)."""
    needs_entropy_grad = with_entropy and entropy_grad and torch.is_grad_enabled()
    kernel = resolve_kernel(head, hidden.shape[0], lm_head.out_features, needs_entropy_grad)
    if kernel == "whole":  # only the scored positions, one matmul; autograd keeps their (N, V) logits
        logp, entropy = _chunk_logprobs(lm_head, hidden, targets, temperature, with_entropy, entropy_grad)
        return logp, (entropy if with_entropy else None)
    if kernel == "liger":
        logp = liger_token_logprobs(lm_head.weight, hidden, targets, temperature=temperature,
                                    chunk_rows=head.chunk_tokens)
        return logp, (detached_entropy(lm_head, hidden, temperature, head.chunk_tokens) if with_entropy else None)
    return chunked_token_logprobs(lm_head, hidden, targets, temperature=temperature, with_entropy=with_entropy,
                                  entropy_grad=entropy_grad, chunk_tokens=head.chunk_tokens)


def resolve_kernel(head: LMHead, rows: int, vocab: int, needs_entropy_grad: bool) -> str:
    """The path :func:`head_logprobs` takes for ``rows`` scored tokens over ``vocab``: whole, chunked or liger.

    liger returns log-probs only; an entropy that is merely logged (RL's diagnostic, no entropy bonus) is
    computed beside it without a gradient (:func:`detached_entropy`: one more head matmul in forward, none in
    backward). Forward + backward of a 0.5B GRPO micro-batch (32,768 x 896 -> 32,000) with a logged entropy is
    about a third faster this way than chunked (BENCHMARKS.md, the LM-head check).
    An entropy that enters the loss needs its gradient, which liger cannot give: the whole/chunked paths.
    """
    if head.kernel == "liger":
        return "chunked" if needs_entropy_grad else "liger"
    if head.kernel != "auto":
        return head.kernel
    if head.prefer_liger and not needs_entropy_grad:
        return "liger"
    return "whole" if rows * vocab * 4 <= head.whole_bytes else "chunked"


@torch.no_grad()
def detached_entropy(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, temperature: float,
                     chunk_tokens: int) -> torch.Tensor:
    """``(N,)`` entropy of ``softmax(head(h) / T)`` per row of ``hidden`` ``(N, H)``, without a gradient,
    ``chunk_tokens`` rows at a time (a chunk's float32 logits are the only ``V``-wide tensor alive)."""
    targets = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)  # unused: entropy only
    _, entropy = chunked_token_logprobs(lm_head, hidden.detach(), targets, temperature=temperature,
                                        with_entropy=True, chunk_tokens=chunk_tokens)
    return entropy


def labelled_token_logprobs(model: Any, batch: dict[str, torch.Tensor], head: LMHead) -> torch.Tensor:
    """``(B, T-1)`` log-prob of each labelled next token (``labels[:, 1:] != -100``), 0 elsewhere.

    Column ``t`` scores ``labels[:, t+1]`` from position ``t`` (Hugging Face's shift by one).
    The indices of the labelled positions are worked out where the batch was collated (the host) and
    copied over with the inputs, so neither pass waits for the device (:func:`scored_logprobs`); the
    packed-row bounds likewise (:func:`rlhf_core.models.attention.packed_forward_kwargs`).
    """
    device = next(unwrap(model).parameters()).device
    inputs = {k: batch[k].to(device, non_blocking=True) for k in MODEL_INPUTS if k in batch}
    extra = packed_forward_kwargs(model, batch["position_ids"], device) if "attention_mask" not in batch \
        and "position_ids" in batch else {}
    labels = batch["labels"][:, 1:]  # (B, T-1) where it was collated
    B, width = labels.shape
    scored = (labels != -100).flatten().nonzero().squeeze(1)  # (N,) into B x (T-1), row-major
    positions = scored + scored // width  # the same positions in B x T (the last column predicts nothing)
    targets = labels.flatten().index_select(0, scored)
    scored, positions, targets = (t.to(device, non_blocking=True) for t in (scored, positions, targets))
    logp, _ = scored_logprobs(model, inputs, positions, targets, head, **extra)
    return torch.zeros(B * width, dtype=logp.dtype, device=device).index_copy(0, scored, logp).view(B, width)


# --------------------------------------------------------------------------------------
# Choosing the kernels
# --------------------------------------------------------------------------------------


def liger_available() -> bool:
    """liger-kernel importable and a CUDA device present (its kernels are Triton, GPU only)."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def use_fused_kernels(setting: str, device: torch.device) -> bool:
    """Resolve ``fused_kernels`` (auto, on, off); ``on`` where they cannot run is an error, not a silent no."""
    if setting == "off":
        return False
    usable = device.type == "cuda" and liger_available()
    if setting == "on" and not usable:
        raise RuntimeError("fused_kernels: on needs a CUDA device and liger-kernel installed (pip install "
                           "'alignflow[gpu]'); use auto to fall back to plain torch")
    return usable


# Decoders whose RMSNorm is ``weight * normalize(x)`` (no offset on the weight, unlike Gemma's ``1 + weight``),
# where torch's own fused RMSNorm kernel replaces liger's (:func:`apply_fused_kernels`).
TORCH_RMS_NORM_TYPES = ("llama", "qwen2", "qwen3", "mistral")
TORCH_RMS_NORM = True
"""Whether those get torch's RMSNorm; False keeps liger's on them too (a bench A/B sets it by name)."""


def apply_fused_kernels(model: Any) -> None:
    """Fused RMSNorm, RoPE and SwiGLU in ``model``'s decoder (its LM head is left alone: the loss functions
    above decide how logits are made): liger-kernel's RoPE and SwiGLU, and torch's own fused RMSNorm
    (:func:`use_torch_rms_norm`) where the model type is one of :data:`TORCH_RMS_NORM_TYPES`, else liger's.
    A model type liger does not know is left as it is.

    Why not liger's RMSNorm everywhere: each call of it costs about 0.2 ms of host time (Triton's Python
    launcher; forward and backward alike, ``bench/results/h200/*/prof_h200_1p5b_grpo_update.json``) against
    0.01-0.03 ms of device time, so a 28-layer decoder's 57 norms spend ~23 ms of host time a micro-batch
    on them; torch's ``rms_norm`` is one ATen op with a fused CUDA kernel forward and backward.

    Not applied where the decoder layers are compiled (:mod:`rlhf_core.models.layer_compile`): inductor fuses a
    layer's norms, rotary and SwiGLU itself, and a forward replaced on each module instance is a different
    object in every layer, which the compiled graph's guards check by identity (a recompile per layer)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # lazy: liger_kernel (optional gpu extra)

    base = unwrap(model)
    torch_norm = TORCH_RMS_NORM and getattr(getattr(base, "config", None), "model_type", None) in TORCH_RMS_NORM_TYPES
    _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=not torch_norm, swiglu=True,
                                    cross_entropy=False, fused_linear_cross_entropy=False)
    if torch_norm:
        use_torch_rms_norm(base)


def _torch_rms_norm(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``weight * x / rms(x)`` by ``torch.nn.functional.rms_norm`` (one fused kernel on CUDA, forward and
    backward). The Llama-family module computes in float32 and rounds the normalised value to the input's
    dtype before the weight multiplies it; the fused kernel rounds once, after the product: the two differ
    by bf16 rounding (what liger's kernel differs by too). Mixed dtypes promote as the module does."""
    dtype = torch.promote_types(hidden_states.dtype, self.weight.dtype)
    return torch.nn.functional.rms_norm(hidden_states.to(dtype), self.weight.shape, self.weight.to(dtype),
                                        self.variance_epsilon)


def use_torch_rms_norm(model: Any) -> int:
    """Route every Llama-family RMSNorm module in ``model`` (``weight`` and ``variance_epsilon``, class
    name ending in ``RMSNorm``) through :func:`_torch_rms_norm`; returns how many. Parameters and their
    names stay as they are (only the instance's ``forward`` is replaced), so checkpoints do not change."""
    count = 0
    for module in unwrap(model).modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") \
                and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            module.forward = types.MethodType(_torch_rms_norm, module)
            count += 1
    return count


def resolve_lm_head(setting: str, chunk_tokens: int, *, fused: bool, head_whole: bool) -> LMHead:
    """Resolve ``lm_head`` (auto, chunked, liger, full). auto scores the labelled positions by liger where fused
    kernels are on and this rank holds the whole head (not ZeRO-3), else with whole logits while those stay
    under :attr:`LMHead.whole_bytes`, past it chunked; liger where it cannot run is an error."""
    if setting == "liger" and not (liger_available() and head_whole):
        raise RuntimeError("lm_head: liger needs CUDA, liger-kernel, and the whole head on each rank "
                           "(not parallel: zero3); use chunked")
    return LMHead(setting, chunk_tokens, prefer_liger=fused and head_whole)


def parallel_mode(cfg: Any) -> str:
    """How ``cfg``'s ranks share a step: ``none`` (one process, no DeepSpeed), ``ddp``, ``zero2`` or ``zero3``.

    ZeRO counts with one rank too: DeepSpeed wraps that rank's model all the same (its hooks; under ZeRO-3 the
    weights are empty placeholders outside a forward), so the choices that depend on it (the whole LM head for
    liger, compiled layers) must see it. Read as ``none``, a one-GPU ZeRO-3 GRPO would hand liger a size-0 head
    (a division by zero in its chunk sizing)."""
    parallel = getattr(cfg, "parallel", "ddp")
    if parallel.startswith("zero"):
        return parallel
    return parallel if getattr(cfg, "num_workers", 1) > 1 else "none"


def prepare_kernels(cfg: Any, *models: Any) -> LMHead:
    """Apply ``cfg.fused_kernels`` to each of ``models`` (policy, reference, teacher) and resolve
    ``cfg.lm_head``; logs both choices."""
    fused = prepare_decoder_kernels(cfg, *models)
    head_whole = parallel_mode(cfg) != "zero3"
    head = resolve_lm_head(cfg.lm_head, cfg.logit_chunk_tokens, fused=fused, head_whole=head_whole)
    rule = f"whole logits up to {head.whole_bytes / 2**30:.0f} GiB, else chunked"
    if head.prefer_liger:
        rule = (f"liger in chunks of {head.chunk_tokens} rows, a logged entropy beside it without gradient; "
                f"where an entropy gradient is asked {rule}")
    log.info("%s: fused kernels %s, LM head %s%s", cfg.section, "on (liger-kernel)" if fused else "off", head.kernel,
             f" ({rule})" if head.kernel == "auto" else "")
    return head


def prepare_decoder_kernels(cfg: Any, *models: Any) -> bool:
    """The decoder half of :func:`prepare_kernels` (a reward model has no LM head): attention backend on a
    GPU, and ``cfg.fused_kernels`` applied to each of ``models``; returns whether fused kernels are on."""
    device = next(models[0].parameters()).device
    if device.type == "cuda":
        # cuDNN's SDPA backend builds an execution plan for each new sequence length (padded batches vary
        # in width): training steps alternated between one and two times the fixed-shape step's time with
        # it (BENCHMARKS.md, the SFT profile). PyTorch's flash
        # backend serves every length without a plan.
        torch.backends.cuda.enable_cudnn_sdp(False)
    fused = use_fused_kernels(cfg.fused_kernels, device)
    compiled, why = use_compiled_layers(getattr(cfg, "compile_layers", "off"), device, parallel=parallel_mode(cfg),
                                        lora=getattr(cfg, "lora_rank", 0) > 0)
    layers = 0
    for model in models:
        if fused and not compiled:  # compiled layers get inductor's fusions instead
            apply_fused_kernels(model)
        if compiled:
            layers += compile_decoder_layers(model, getattr(cfg, "compile_backend", "inductor"))
    log.info("%s: decoder layers compiled: %s%s", cfg.section, why,
             f" ({layers} layers)" if compiled else "")
    return fused
