"""Our own rollout engine: a static KV cache, CUDA graphs over the decode step, early stop.

Why not ``model.generate``: HF ``generate`` of a 0.4B model at batch 512 spends 20-30x longer per
decode step than the weights and KV cache need in memory traffic (BENCHMARKS.md, "Rollout decode"):
the step is bound by Python and kernel launches (a few hundred small kernels), not by the GPU. vLLM fixes that but cannot be
installed everywhere (not on the lent GPUs, for one). This engine does what vLLM's decode
does for one fixed batch, in plain torch:

* the cache is preallocated once per call, ``(B, H_kv, P + R, D)`` per layer, and step ``t``
  writes column ``P + t`` (prompts are left-padded, so every row's new token shares a column);
* one decode step has fixed shapes and touches only preallocated buffers (the token, its
  position, the column and a key mask are updated in place), so on CUDA it is captured once
  into a ``torch.cuda.CUDAGraph`` and replayed: one launch per step instead of hundreds;
* grouped-query attention needs no copy of the shared K/V heads: at one query position, the
  ``G = H / H_kv`` query heads of a KV head are the ``G`` query rows of one SDPA call over that
  head's cache (``q: (B, H_kv, G, D)``), exact and memory-bound;
* on a GPU (bf16/fp16), attention reads each row's filled keys only, through our Triton flash-decoding
  kernel (:mod:`rlhf_core.models.decode_attention`; torch's varlen flash kernel where Triton is missing), with a
  per-row count of used keys the graph advances in place: one graph serves every step and a step's
  attention grows with its column instead of always reading the whole cache;
* on a GPU the decoder layer's pieces around attention (norm, fused projections, rotary; residual, norm,
  gated MLP) are compiled with ``torch.compile`` (inductor fuses their ~20 small elementwise kernels a
  layer into a few) and captured like the rest, compiled once per process and reused by every layer;
* sampling (temperature, top-k, top-p; inverse-CDF with the call's own generator, every step's
  uniforms drawn up front) and the eos bookkeeping are captured with the decode step, so a step is
  one replay; the loop stops once every row has emitted eos (checked every few steps so the host
  does not wait on the GPU each step).

It runs the model's own modules (projections, norms, MLP, rotary embedding), so it holds no
weights of its own: :meth:`update_weights` copies into the model in place and captured graphs
stay valid. Architectures: the Llama family's decoder layer (``llama``, ``qwen2``, ``qwen3``
with its q/k norms, ``mistral`` within its sliding window), with or without peft LoRA adapters (a LoRA
policy's projections are merged, ``W + s B A``, into the per-call copies the decode step reads; the
prefill runs peft's own layers); :func:`supports` says why a model is refused, and
:func:`rlhf_core.trainers.rl.build_rollout_engine` then falls back to HF ``generate``.

Log-probs follow the contract of :mod:`rlhf_core.rollout.engine`: ``log_softmax(logits / T)`` of the
sampled token, before top-k / top-p filtering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from rlhf_core.models import decode_attention as row_attention
from rlhf_core.models.layer_compile import INDUCTOR_OPTIONS
from rlhf_core.models.loading import has_lora
from rlhf_core.rollout.engine import (HFGenerateEngine, RolloutBatch, SamplingParams, _left_pad, assemble_batch,
                               response_mask_from_ids)

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# How often (in decode steps) the host asks whether every row has finished: on a GPU each ask waits
# for the device, so it asks every 16 steps there and every step on the CPU.
_EOS_CHECK_EVERY = {"cuda": 16}
# The eager decode (the CPU's) drops finished rows from its batch once this share or fewer of them still run
# (_decode_eagerly): each drop copies the live rows' caches, so it waits for a quarter of the rows to finish.
_COMPACT_BELOW = 0.75
# Columns between the cache widths of the decode graphs (see _Decoder.width_buckets); 0: one graph over
# the whole cache. Measured (512 x 256, BENCHMARKS.md): eight 32-column graphs
# were ~25% slower than one graph: graphs are captured per generate call, and the
# extra captures cost more than the narrower attention saves. Kept for graphs kept across calls.
_WIDTH_BUCKET = 0
# SDPA backends a decode step may use (None: torch's choice, cuDNN on Hopper), by name of
# torch.nn.attention.SDPBackend; bench/gpu_engine.py's static_cuda_graphs_<backend> engines A/B them.
_DECODE_SDPA: tuple[str, ...] | None = None
# The decode step's attention: triton (our flash-decoding kernel over each row's filled keys,
# rlhf_core/models/decode_attention.py: a GPU with Triton), flash (torch's varlen flash kernel over the same keys: a GPU,
# bf16/fp16), sdpa (SDPA over the whole cache with a key mask) or auto (triton on Hopper where it builds, else flash where
# it runs, else sdpa: _row_kernel). triton and flash share the cache layout; on a CPU, flash is the torch reference of that layout (tests) and
# triton runs under Triton's interpreter (TRITON_INTERPRET=1). Environment override ALIGNFLOW_DECODE_ATTENTION, for
# A/Bs; bench/gpu_engine.py sets it per engine.
_DECODE_ATTENTION = os.environ.get("ALIGNFLOW_DECODE_ATTENTION", "auto")
# Whether the decode step's layer pieces are compiled (torch.compile): auto (with CUDA graphs on a GPU),
# on, off. Environment override ALIGNFLOW_DECODE_COMPILE (auto / 1 / 0), for A/Bs.
_DECODE_COMPILE = os.environ.get("ALIGNFLOW_DECODE_COMPILE", "auto")
# With compiled layers, whether sampling's weights (log-softmax, filters, exponential) are compiled too; and whether the
# flash call folds each KV head's query heads into its query rows (the kernel then reads a row's keys once per
# KV head, not once per query head). bench/gpu_engine.py A/Bs both.
_COMPILE_SAMPLER = True
_FLASH_GROUPED = True


def supports(model: Any) -> str | None:
    """``None`` when this engine can run ``model``; otherwise the reason it cannot."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {SUPPORTED}"
    if hasattr(model, "peft_config"):
        reason = _adapter_reason(model)
        if reason:
            return reason
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model does not have the Llama-family layout (model.embed_tokens/layers/norm/rotary_emb)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if kind == "qwen2" and getattr(cfg, "use_sliding_window", False):
        return "Qwen2 sliding-window attention"
    return None


def _adapter_reason(model: Any) -> str | None:
    """``None`` when every adapter layer peft injected into ``model`` is a LoRA linear or embedding layer
    without DoRA or a LoRA bias (what :func:`_weight` merges, or a module the decode step calls as is);
    otherwise why not."""
    try:
        from peft.tuners import lora
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return "the model carries peft adapters and peft cannot be imported"
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if not isinstance(module, (lora.Linear, lora.Embedding)):
            return f"adapter layer {name} is a {type(module).__name__} (LoRA linear and embedding layers only)"
        for adapter in module.active_adapters:
            for flag in ("use_dora", "lora_bias"):
                if getattr(module, flag, {}).get(adapter):
                    return f"adapter layer {name} uses {flag} (plain LoRA only)"
    return None


def _weight(linear: Any) -> torch.Tensor:
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


@dataclass
class _Shapes:
    rows: int
    width: int  # prompt width P + max_new_tokens R
    heads: int
    kv_heads: int
    head_dim: int


class StaticCacheEngine(HFGenerateEngine):
    """Rollouts from a Llama-family causal LM with our decode loop (see the module docstring).

    Weights, the bf16 sampling copy under mixed precision and :meth:`update_weights` are the HF
    engine's (in place, so captured graphs stay valid); only generation differs.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 256, autocast_dtype: torch.dtype | None = None,
                 cuda_graphs: bool = True, compile_layers: bool | None = None):
        """``compile_layers``: compile the decode layer's halves (:func:`_compiled_layer_halves`) where CUDA
        graphs are captured; ``None`` reads :data:`_DECODE_COMPILE` (auto: yes)."""
        reason = supports(model)
        if reason:
            raise ValueError(f"StaticCacheEngine: cannot run this model: {reason}")
        super().__init__(model, tokenizer, batch_size=batch_size, autocast_dtype=autocast_dtype)
        self.cuda_graphs = cuda_graphs
        if compile_layers is None:
            if _DECODE_COMPILE not in ("auto", "1", "0"):
                raise ValueError(f"ALIGNFLOW_DECODE_COMPILE must be auto, 1 or 0, got {_DECODE_COMPILE!r}")
            compile_layers = _DECODE_COMPILE != "0"
        self.compile_layers = compile_layers
        self.triton_attention = True  # auto's Triton decode attention; False once it failed to build here
        cfg = model.config
        self._window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
        # Seconds spent in each phase of generate (encode, decoder set-up, prefill, capture, decode, to_host,
        # assemble), summed over calls, when a caller sets this to a dict (bench/gpu_engine.py --phases): each phase
        # then waits for the device at its ends, so a timed run is a little slower. None (the default): no waits.
        self.phase_seconds: dict[str, float] | None = None

    @contextlib.contextmanager
    def _phase(self, name: str, device: torch.device):
        if self.phase_seconds is None:
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.perf_counter() - start

    @property
    def name(self) -> str:
        return "static"

    # ---- generate ---------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> RolloutBatch:
        """``params.n`` samples per prompt; see :class:`rlhf_core.rollout.engine.RolloutBatch` for the layout."""
        with self._phase("encode", torch.device("cpu")):
            encoded = self._encode(prompts)
        return self.generate_ids(encoded, params, prompts)

    @torch.no_grad()
    def generate_ids(self, encoded: Sequence[list[int]], params: SamplingParams,
                     prompts: Sequence[str] | None = None) -> RolloutBatch:
        """:meth:`generate` from token ids (one turn of a multi-turn rollout; see the HF engine's).

        A multi-turn rollout calls this once per turn with the whole trajectory so far as the prompt: each
        turn is a fresh prefill + decode, so the observation tokens an environment appends are written by the
        next prefill, never inside a captured decode graph. Within a turn the decode graphs apply as usual.
        """
        prompts = list(prompts) if prompts is not None else [""] * len(encoded)
        width = max(len(e) for e in encoded) + params.max_new_tokens
        if self._window and width > self._window:
            raise ValueError(f"StaticCacheEngine: prompt + max_new_tokens = {width} tokens exceeds the model's "
                             f"sliding window {self._window}; use rollout_engine hf")
        model = self._sampling_model
        device = next(model.parameters()).device
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(2**62, ()).item()))
        was_training = model.training
        model.eval()
        try:
            # Whole prompt groups per chunk: n copies of batch_size // n prompts.
            per_chunk = max(1, self.batch_size // params.n)
            chunks = [self._generate_chunk(encoded[s:s + per_chunk], params, device, generator)
                      for s in range(0, len(encoded), per_chunk)]
        finally:
            model.train(was_training)
        with self._phase("assemble", torch.device("cpu")):
            return assemble_batch(self.tokenizer, prompts, params.n, chunks)

    def _generate_chunk(self, encoded: Sequence[list[int]], params: SamplingParams, device: torch.device,
                        generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        ids, mask = _left_pad(encoded, pad)
        # Each prompt is prefilled once and its cache shared by its n samples (rows i*n .. i*n+n-1).
        graphs = self.cuda_graphs and device.type == "cuda"
        with self._phase("decoder_setup", device):
            decoder = _Decoder(self._sampling_model, ids.to(device), mask.to(device), params.max_new_tokens, params.n,
                               compiled=graphs and self.compile_layers, triton=self.triton_attention)
            self._check_row_kernel(decoder)
        with self._phase("prefill", device):
            logits = decoder.prefill()
        ids, mask = ids.repeat_interleave(params.n, dim=0), mask.repeat_interleave(params.n, dim=0)
        sampler = _Sampler(params, ids.shape[0], params.max_new_tokens, eos, pad, device)
        if graphs:
            with self._phase("capture", device):
                self._capture(decoder, sampler)
        with self._phase("decode", device):
            if decoder.graphs:
                steps = _decode_in_graphs(decoder, logits, sampler, generator)
            else:
                steps = _decode_eagerly(decoder, logits, sampler, generator)
        with self._phase("to_host", device):
            out_ids, out_logp = sampler.out_ids, sampler.out_logp
            decoder.release()
            response = out_ids[:, :steps].cpu()
            logprobs = out_logp[:, :steps].cpu()
            response_mask = response_mask_from_ids(response, eos, params.stop_token_ids)
            longest = max(int(response_mask.sum(-1).max()), 1)  # columns after every row's eos: dropped, as generate does
            response, response_mask, logprobs = response[:, :longest], response_mask[:, :longest], logprobs[:, :longest]
            response = response.masked_fill(response_mask == 0, pad)
        return ids, mask, response, response_mask, logprobs.masked_fill(response_mask == 0, 0.0)

    def _check_row_kernel(self, decoder: "_Decoder") -> None:
        """Build auto's Triton decode attention once, eagerly, before any graph captures it; where it fails (a
        Triton or driver this kernel does not build on), torch's flash kernel from now on."""
        if decoder.row_kernel != "triton" or _DECODE_ATTENTION != "auto":
            return
        try:
            decoder.run_row_kernel()
        except Exception as err:  # noqa: BLE001 - Triton's compile errors are of many kinds; all mean "not here"
            log.warning("StaticCacheEngine: the Triton decode attention failed (%s); torch's flash kernel from now "
                        "on", err)
            self.triton_attention = False
            decoder.row_kernel = "flash"

    def _capture(self, decoder: "_Decoder", sampler: "_Sampler") -> None:
        """Capture the decode graphs (each attempt restores every buffer it touched); when the compiled layer
        halves fail (compilation, or capturing their kernels), once more with the plain ones; when capture
        fails too (e.g. an op of this model/torch that graphs cannot capture), decode eagerly from now on."""
        if decoder.compiled:
            try:
                decoder.capture(sampler)
                return
            except Exception as err:  # noqa: BLE001 - inductor/triton raise many kinds; all mean "not here"
                log.warning("StaticCacheEngine: the compiled decode layers failed (%s); using the plain ones from "
                            "now on", err)
                self.compile_layers = decoder.compiled = False
                decoder.halves, decoder.sample = (_attention_inputs, _output_and_mlp), _sample
        try:
            decoder.capture(sampler)
        except RuntimeError as err:
            log.warning("StaticCacheEngine: CUDA graph capture failed (%s); decoding eagerly from now on", err)
            self.cuda_graphs = False


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


# ---- the decode step's layer, as pure functions of tensors (what torch.compile compiles on a GPU) ------------

def _attention_inputs(x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor,
                      qkv_b: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                      kv_heads: int, contiguous_q: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-attention half of a Llama-family layer at one decode position: RMS norm, Q/K/V as one GEMM,
    rotary on the Q and K heads at once.

    ``x (B, 1, hidden)``, ``qkv_w ((H + 2 H_kv) D, hidden)``, ``cos``/``sin (B, 1, D)``; returns
    ``q (B, H, 1, D)`` (``contiguous_q``: laid out contiguously, as the flash call takes it), ``k``,
    ``v (B, H_kv, 1, D)``.
    """
    B, D = x.shape[0], cos.shape[-1]
    qkv = F.linear(_rms_norm(x, norm_w, eps), qkv_w, qkv_b).view(B, heads + 2 * kv_heads, 1, D)
    qk, _ = _rotate(qkv[:, :heads + kv_heads], qkv[:, :0], cos, sin)
    q = qk[:, :heads]
    return q.contiguous() if contiguous_q else q, qk[:, heads:], qkv[:, heads + kv_heads:]


def _output_and_mlp(x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                    norm_w: torch.Tensor, eps: float, gate_up_w: torch.Tensor, gate_up_b: torch.Tensor | None,
                    down_w: torch.Tensor, down_b: torch.Tensor | None) -> torch.Tensor:
    """Post-attention half: output projection and residual, RMS norm, the gated SiLU MLP (Shazeer 2020) with
    gate and up as one GEMM, residual. ``x (B, 1, hidden)``, ``o (B, 1, H D)``; returns ``(B, 1, hidden)``."""
    x = x + F.linear(o, o_w, o_b)
    gate, up = F.linear(_rms_norm(x, norm_w, eps), gate_up_w, gate_up_b).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w, down_b)


def _biases(linears: Sequence[Any]) -> list[torch.Tensor] | None:
    """The biases of ``linears`` (a LoRA layer's: its base layer's, peft's ``bias``; plain LoRA adds none);
    ``None`` when none has one (ValueError when only some do: that layout is left to the model's modules)."""
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("some projections have a bias and some do not")
    return biases


@functools.cache
def _compiled_layer_halves() -> tuple[Any, Any]:
    """:func:`_attention_inputs` and :func:`_output_and_mlp` through ``torch.compile`` (inductor), built once
    per process: every layer has the same shapes, so one compiled graph each serves all of them (recompiled
    only for a new row count). Why compile rather than hand-written kernels: the halves are chains of small
    elementwise ops around GEMMs (a profile counts ~120 elementwise kernels in a decode iteration; BENCHMARKS.md,
    "Rollout decode") that inductor fuses; the attention in between stays a
    kernel call of its own, outside the compiled graphs, and every cache write with it."""
    return (torch.compile(_attention_inputs, fullgraph=True, options=INDUCTOR_OPTIONS),
            torch.compile(_output_and_mlp, fullgraph=True, options=INDUCTOR_OPTIONS))


@functools.cache
def _compiled_sample() -> Any:
    """:func:`_sample` with :func:`_sampling_weights` through ``torch.compile``: the float cast, log-softmax,
    top-k mask and exponential over ``(B, V)`` logits fuse into one kernel; the running sum, the search
    and the gather stay torch's (see :func:`_sample` on why the scan is not compiled)."""
    return functools.partial(_sample, weights_fn=torch.compile(_sampling_weights, fullgraph=True,
                                                               options=INDUCTOR_OPTIONS))


def _use_flash(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decode step attends over each row's filled keys (the row-contiguous cache layout, through
    :func:`_row_kernel`'s kernel) rather than masked SDPA over the whole cache (:data:`_DECODE_ATTENTION`; auto: a
    CUDA device of compute capability 8.0 or later, a bf16/fp16 cache, a head size the flash kernel takes)."""
    choice = _DECODE_ATTENTION
    if choice not in ("auto", "triton", "flash", "sdpa"):
        raise ValueError(f"ALIGNFLOW_DECODE_ATTENTION must be auto, triton, flash or sdpa, got {choice!r}")
    if choice != "auto":
        return choice in ("flash", "triton")  # on a CPU: the torch reference, or Triton's interpreter (tests)
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.cuda.get_device_capability(device)[0] >= 8 and _flash_takes_used_keys())


def _row_kernel(device: torch.device, head_dim: int, triton: bool = True) -> str:
    """The kernel of the row-contiguous layout: ``triton`` (:mod:`rlhf_core.models.decode_attention`) when chosen, or
    under auto on a CUDA device where Triton imports and the head size is a power of two of at least 16; else
    ``flash``. Auto takes it on Hopper (compute capability 9), where it was measured faster than torch's flash op
    (BENCHMARKS.md, "Rollout decode"), and leaves other cards on the flash op until
    measured there; it falls back to flash where the Triton kernel fails to build (``triton=False`` from then on:
    :meth:`StaticCacheEngine._check_row_kernel`)."""
    if _DECODE_ATTENTION == "triton":
        if not row_attention.available():
            raise ValueError("ALIGNFLOW_DECODE_ATTENTION=triton needs Triton and a CUDA device (or Triton's "
                             "interpreter, TRITON_INTERPRET=1); use auto, flash or sdpa")
        return "triton"
    pow2 = head_dim >= 16 and not head_dim & (head_dim - 1)
    return "triton" if (triton and _DECODE_ATTENTION == "auto" and device.type == "cuda" and pow2
                        and torch.cuda.get_device_capability(device)[0] == 9 and row_attention.available()) else "flash"


@functools.cache
def _flash_takes_used_keys() -> bool:
    """Whether this torch's flash op takes a per-row count of used keys (``seqused_k``)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and "seqused_k" in str(op.default._schema)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
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


def _sampling_weights(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
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


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
            uniform: torch.Tensor | None = None, weights_fn: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``(rows,)`` and its ``log_softmax(logits / T)`` ``(rows,)`` from ``(rows, V)`` logits.

    ``uniform`` ``(rows, 1)``: the rows' U(0, 1) draws, given (a captured graph cannot draw from a
    generator it does not own); else drawn from ``generator``. ``weights_fn``: :func:`_sampling_weights`
    compiled (:func:`_compiled_sample`), used without top-p (its running sum is a scan, which inductor of
    torch 2.11 failed to generate for a few rows: ``SplitScan`` codegen, bench/results/gpu_engine_h200_decode_ab.log).
    """
    if params.greedy:
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    weigh = weights_fn if weights_fn is not None and params.top_p == 1.0 else _sampling_weights
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


class _Sampler:
    """A chunk's sampling state on the device: the sampled tokens and log-probs so far, which rows have
    finished, the next column ``t``, and (graph path) every step's uniforms. ``B`` rows, ``R`` new tokens."""

    def __init__(self, params: SamplingParams, rows: int, R: int, eos: int, pad: int, device: torch.device):
        self.params, self.eos, self.pad = params, eos, pad
        self.out_ids = torch.full((rows, R), pad, dtype=torch.long, device=device)
        self.out_logp = torch.zeros((rows, R), dtype=torch.float32, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)
        self.uniforms = torch.zeros((R, rows, 1), dtype=torch.float32, device=device)

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


def _decode_eagerly(decoder: "_Decoder", logits: torch.Tensor, sampler: _Sampler,
                    generator: torch.Generator) -> int:
    """Sample, record and decode step by step (the CPU path; a uniform a row drawn per step); the steps run.

    Where the decoder allows it (:attr:`_Decoder.compactable`), rows that have finished leave its batch once
    they are more than ``1 - _COMPACT_BELOW`` of it, so later steps compute live rows only (a CPU GRPO step's
    responses run 1-12 tokens around a median of 5: most of a fixed-batch decode's work went to finished rows).
    Uniforms are still drawn for every row, in the same order, and a row's logits do not depend on the others,
    so the samples are the whole batch's, their log-probs to an ulp (a smaller batch's GEMMs may round
    differently; ``tests/model/test_rollout_static.py``).
    """
    R, check_every = sampler.out_ids.shape[1], _EOS_CHECK_EVERY.get(logits.device.type, 1)
    rows, device = sampler.out_ids.shape[0], logits.device
    live = torch.arange(rows, device=device)  # the decoder's rows among all rows
    for t in range(R):
        uniform = None if sampler.params.greedy else torch.rand((rows, 1), device=device, generator=generator)
        token, logp = _sample(logits, sampler.params, uniform=None if uniform is None else uniform[live])
        if len(live) < rows:  # rows gone from the decoder record pad (they have finished: record pads them)
            token = torch.full((rows,), sampler.pad, dtype=token.dtype, device=device).index_copy_(0, live, token)
            logp = torch.zeros(rows, dtype=logp.dtype, device=device).index_copy_(0, live, logp)
        token = sampler.record(token, logp)
        if t == R - 1 or ((t + 1) % check_every == 0 and bool(sampler.finished.all())):
            return t + 1
        if decoder.compactable and (t + 1) % check_every == 0:  # where the host reads ``finished`` anyway
            running = ~sampler.finished[live]
            kept = int(running.sum())
            if kept <= _COMPACT_BELOW * len(live):
                keep = running.nonzero().squeeze(-1)
                decoder.keep(keep)
                live = live[keep]
        logits = decoder.step(token[live])
    return R


def _decode_in_graphs(decoder: "_Decoder", logits: torch.Tensor, sampler: _Sampler,
                      generator: torch.Generator) -> int:
    """The captured path: every step's uniforms drawn at once, the prefill's token sampled eagerly, then
    one replay per new token, each a whole iteration (decode, sample, record) with no host work between;
    the host reads ``finished`` every few steps only. The steps run."""
    R, check_every = sampler.out_ids.shape[1], _EOS_CHECK_EVERY.get(logits.device.type, 1)
    sampler.uniforms.copy_(torch.rand(sampler.uniforms.shape, device=logits.device, generator=generator))
    decoder.token.copy_(sampler.record(*decoder.sample(logits, sampler.params, uniform=sampler.uniforms[0])))
    for t in range(1, R):
        if t % check_every == 0 and bool(sampler.finished.all()):
            return t
        decoder.replay()
    return R


class _Decoder:
    """One chunk's decode state: the static cache and the buffers a captured step reads and writes.

    Shapes: ``B`` rows, ``P`` prompt width, ``W = P + R`` cache width, ``H``/``H_kv`` query/KV heads,
    ``D`` head size, ``V`` vocabulary.
    """

    def __init__(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, n: int,
                 compiled: bool = False, triton: bool = True):
        cfg = model.config
        self.model, self.inner = model, model.model
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // heads
        prompts, P = ids.shape
        B = prompts * n  # decode rows: n samples of each prompt, contiguous
        self.n = n
        self.shape = _Shapes(B, P + max_new_tokens, heads, kv_heads, head_dim)
        self.scaling = getattr(attn, "scaling", head_dim ** -0.5)
        self.rope = _rotate
        dtype = next(model.parameters()).dtype
        device = ids.device
        W = self.shape.width
        # Cache layout: (B, W, H_kv, D) for the flash kernel (a row's keys contiguous), else (B, H_kv, W, D).
        self.flash = _use_flash(device, dtype, head_dim)
        self.row_kernel = _row_kernel(device, head_dim, triton) if self.flash else "sdpa"
        layout = (B, W, kv_heads, head_dim) if self.flash else (B, kv_heads, W, head_dim)
        self.k = [torch.zeros(layout, dtype=dtype, device=device) for _ in self.layers]
        self.v = [torch.zeros(layout, dtype=dtype, device=device) for _ in self.layers]
        # rotary tables for positions 0 .. W-1, from the model's own rotary module (any rope scaling)
        probe = torch.zeros(1, W, head_dim, dtype=dtype, device=device)
        cos, sin = self.inner.rotary_emb(probe, torch.arange(W, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]  # (W, D)
        self.ids, self.prompt_mask = ids, mask  # (prompts, P): one row per prompt
        # decode-step buffers (updated in place, read by the captured graph), one row per sample
        row_mask = mask.repeat_interleave(n, dim=0)
        self.valid = torch.zeros(B, W, dtype=torch.bool, device=device)  # keys a row may attend to
        self.valid[:, :P] = row_mask.bool()
        self.token = torch.zeros(B, dtype=torch.long, device=device)
        self.pos = (row_mask.sum(-1) - 1).clamp(min=0)  # position of the last prompt token; advanced before a step
        self.col = torch.tensor([P - 1], dtype=torch.long, device=device)
        # flash: row b's keys start at its first prompt token (left padding) and run ``used[b]`` columns
        start = P - row_mask.sum(-1)
        # flash, grouped (_FLASH_GROUPED): KV head j's G query heads are G query rows; the fused weights then put
        # Q's heads (and o_proj's columns) in (g, j) order, so the projection writes those rows directly
        self.grouped = self.flash and _FLASH_GROUPED and heads > kv_heads
        self.cu_q = torch.arange(B + 1, dtype=torch.int32, device=device) * (heads // kv_heads if self.grouped else 1)
        self.cu_k = torch.cat([torch.arange(B, device=device) * W + start,
                               torch.tensor([B * W], device=device)]).to(torch.int32)
        self.used = (P - start).to(torch.int32)
        self.decode_steps, self.step_index = max_new_tokens, 0
        self.graphs: list[tuple[int, Any]] = []  # (cache width, CUDA graph of a whole iteration)
        self.fused = self._fuse_weights()
        self.heads_regrouped = self.grouped and self.fused is not None
        self.compiled = compiled and self.fused is not None
        self.halves = _compiled_layer_halves() if self.compiled else (_attention_inputs, _output_and_mlp)
        self.sample = _compiled_sample() if self.compiled and _COMPILE_SAMPLER else _sample

    def _grouped_q(self, w: torch.Tensor) -> torch.Tensor:
        """Q projection rows ``(H D, ..)`` from head order ``h = j G + g`` to ``(g, j)`` order (grouped flash
        layout); unchanged otherwise."""
        if not self.grouped:
            return w
        s = self.shape
        G = s.heads // s.kv_heads
        return w.reshape(s.kv_heads, G, s.head_dim, *w.shape[1:]).transpose(0, 1).reshape(w.shape)

    def _copies_fit(self) -> bool:
        """Whether the fused copies (Q/K/V and gate/up always; the output projection in the grouped layout; all
        seven projections, merged, for a LoRA policy) fit in half of the GPU's free memory. A 32B policy's
        replica holding the base and adapters would copy every projection, 62 GB beside its 65.5 GB base, more than a
        141 GB card holds (BENCHMARKS.md): there the model's own modules (peft's for the adapters)
        run instead, slower but without copies. Always on a CPU."""
        device = self.cos.device
        if device.type != "cuda":
            return True
        lora = has_lora(self.layers[0])
        names = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") + (("o_proj",) if self.grouped or lora else ()) \
            + (("down_proj",) if lora else ())
        need = len(self.layers) * self.cos.element_size() * sum(
            (m.get_base_layer() if hasattr(m, "get_base_layer") else m).weight.numel()
            for name, m in self.layers[0].named_modules() if name.rsplit(".", 1)[-1] in names)
        free, _ = torch.cuda.mem_get_info(device)
        if need <= free // 2:
            return True
        log.warning("StaticCacheEngine: the fused projection copies (%.1f GB) exceed half the free GPU memory "
                    "(%.1f GB); decoding through the model's own modules", need / 2**30, free / 2**30)
        return False

    def _fuse_weights(self) -> list[dict[str, Any]] | None:
        """Per layer, Q/K/V and gate/up projections concatenated into one matrix each (decode only).

        A decode step at batch 512 is a chain of ~40 small kernels per layer (a profile in
        BENCHMARKS.md, "Rollout decode"); one GEMM for Q, K and V, one for gate and up, rotary
        embedding applied once to the Q and K heads together and a fused RMS norm cut that chain by
        about a third. Copies of this call's weights, so they are rebuilt with the decoder (per call).
        ``None`` (use the model's modules) for layouts this does not cover (Qwen3's q/k norms), and on a GPU
        where the copies would take more than half the free memory (:meth:`_copies_fit`).
        """
        if not self._copies_fit():
            return None
        fused = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if hasattr(attn, "q_norm") or not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")) \
                    or not all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm,
                                                                         layer.post_attention_layernorm)):
                return None
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            try:
                qkv_bias, gate_up_bias = _biases(projections), _biases((mlp.gate_proj, mlp.up_proj))
            except ValueError:
                return None  # some projections biased, some not
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            o_proj = _weight(attn.o_proj)
            fused.append({  # the model's own tensors (LoRA: merged copies), except the two concatenations
                "ln1": ln1.weight, "eps1": ln1.variance_epsilon, "ln2": ln2.weight, "eps2": ln2.variance_epsilon,
                "qkv": torch.cat([self._grouped_q(_weight(attn.q_proj)), _weight(attn.k_proj), _weight(attn.v_proj)]),
                "qkv_bias": None if qkv_bias is None else torch.cat([self._grouped_q(qkv_bias[0]), *qkv_bias[1:]]),
                "o": self._grouped_q(o_proj.T).T.contiguous() if self.grouped else o_proj, "o_bias": attn.o_proj.bias,
                "gate_up": torch.cat([_weight(mlp.gate_proj), _weight(mlp.up_proj)]),
                "gate_up_bias": None if gate_up_bias is None else torch.cat(gate_up_bias),
                "down": _weight(mlp.down_proj), "down_bias": mlp.down_proj.bias,
            })
        return fused

    # ---- the math -----------------------------------------------------------------------------

    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write: Any,
               attend: Any) -> torch.Tensor:
        """One decoder layer on ``x (B, T, hidden)``: the model's modules, our cache handling."""
        layer = self.layers[i]
        attn = layer.self_attn
        s = self.shape
        B, T, _ = x.shape
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(B, T, s.heads, s.head_dim)
        k = attn.k_proj(h).view(B, T, s.kv_heads, s.head_dim)
        v = attn.v_proj(h).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm of each head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H, T, D), (B, H_kv, T, D)
        write(i, k, v)
        o = attend(i, q)  # (B, T, H * D)
        x = x + attn.o_proj(o)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.inner.norm(x))

    # ---- prefill: the prompts, every position at once --------------------------------------------

    def prefill(self) -> torch.Tensor:
        """Run each prompt once, fill cache columns ``0 .. P-1`` of its ``n`` rows; ``(B, V)`` next-token logits."""
        B, P = self.ids.shape  # B prompts here
        pos = (self.prompt_mask.cumsum(-1) - 1).clamp(min=0)  # as generate: counted from the first real token
        cos, sin = self.cos[pos], self.sin[pos]  # (B, P, D)
        keys = self.prompt_mask.bool()
        causal = torch.ones(P, P, dtype=torch.bool, device=self.ids.device).tril()
        allowed = causal[None] & keys[:, None, :]  # (B, P, P)
        allowed |= torch.eye(P, dtype=torch.bool, device=self.ids.device)[None]  # pad queries: no empty rows
        s = self.shape

        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            kv[i] = (k, v)
            if self.flash:
                self.k[i][:, :P] = k.transpose(1, 2).repeat_interleave(self.n, dim=0)
                self.v[i][:, :P] = v.transpose(1, 2).repeat_interleave(self.n, dim=0)
            else:
                self.k[i][:, :, :P] = k.repeat_interleave(self.n, dim=0)
                self.v[i][:, :, :P] = v.repeat_interleave(self.n, dim=0)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            k, v = kv.pop(i)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=self.scaling,
                                               enable_gqa=s.heads != s.kv_heads)
            return o.transpose(1, 2).reshape(B, P, s.heads * s.head_dim)

        x = self.inner.embed_tokens(self.ids)
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin, write, attend)
        return self._head(x[:, -1]).repeat_interleave(self.n, dim=0)

    # ---- decode: one new token per row, fixed shapes -----------------------------------------------

    def _write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one decode position's ``k``, ``v (B, H_kv, 1, D)`` into layer ``i``'s cache at column ``col``."""
        if self.flash:
            self.k[i].index_copy_(1, self.col, k.transpose(1, 2))
            self.v[i].index_copy_(1, self.col, v.transpose(1, 2))
        else:
            self.k[i].index_copy_(2, self.col, k)
            self.v[i].index_copy_(2, self.col, v)

    def _attend(self, i: int, q: torch.Tensor, key_mask: torch.Tensor | None, width: int) -> torch.Tensor:
        """Layer ``i``'s attention of ``q (B, H, 1, D)`` over the cache; ``(B, 1, H D)``."""
        s = self.shape
        B, G, D = s.rows, s.heads // s.kv_heads, s.head_dim
        if self.flash:
            regroup = self.grouped and not self.heads_regrouped  # the model's own q_proj: heads in (j, g) order
            if regroup:
                q = q.reshape(B, s.kv_heads, G, D).transpose(1, 2)
            rows = q.reshape(B * G, s.kv_heads, D) if self.grouped else q.reshape(B, s.heads, D)
            o = _decode_attention(rows, self.k[i].view(-1, s.kv_heads, D), self.v[i].view(-1, s.kv_heads, D),
                                  self.cu_q, self.cu_k, s.width, self.used, self.scaling, self.row_kernel)
            if regroup:
                o = o.view(B, G, s.kv_heads, D).transpose(1, 2)
        else:  # the G query heads of each KV head as G query rows over that head's cache: no K/V copies
            o = F.scaled_dot_product_attention(q.reshape(B, s.kv_heads, G, D), self.k[i][:, :, :width],
                                               self.v[i][:, :, :width], attn_mask=key_mask, scale=self.scaling)
        return o.reshape(B, 1, s.heads * D)

    def run_row_kernel(self) -> None:
        """One call of the decode attention on layer 0's cache with zero queries (builds a JIT kernel eagerly;
        the result is dropped, no buffer changes)."""
        s = self.shape
        self._attend(0, torch.zeros(s.rows, s.heads, 1, s.head_dim, dtype=self.k[0].dtype, device=self.k[0].device),
                     None, s.width)

    def _fused_layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     key_mask: torch.Tensor | None, width: int) -> torch.Tensor:
        """:meth:`_layer` for one decode position ``x (B, 1, hidden)`` with the fused projections: the two
        halves around attention (compiled on a GPU, see :func:`_compiled_layer_halves`), the cache write and
        attention between them."""
        w, s = self.fused[i], self.shape
        attention_inputs, output_and_mlp = self.halves
        q, k, v = attention_inputs(x, w["ln1"], w["eps1"], w["qkv"], w["qkv_bias"], cos, sin, s.heads, s.kv_heads,
                                   self.flash)
        self._write(i, k, v)
        o = self._attend(i, q, key_mask, width)
        return output_and_mlp(x, o, w["o"], w["o_bias"], w["ln2"], w["eps2"], w["gate_up"], w["gate_up_bias"],
                              w["down"], w["down_bias"])

    def _step(self, width: int | None = None) -> torch.Tensor:
        """Reads ``token``, ``pos``, ``col``, ``valid``; writes the cache at ``col``; ``(B, V)`` logits.

        Attention reads cache columns ``0 .. width-1`` only (default: all ``W``); any ``width > col``
        gives the same result, since later columns are masked out.
        """
        if _DECODE_SDPA is not None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, name) for name in _DECODE_SDPA]):
                return self._decode(width)
        return self._decode(width)

    def _decode(self, width: int | None) -> torch.Tensor:
        width = width or self.shape.width
        cos, sin = self.cos[self.pos][:, None], self.sin[self.pos][:, None]  # (B, 1, D)
        key_mask = None if self.flash else self.valid[:, None, None, :width]  # (B, 1, 1, width)
        x = self.inner.embed_tokens(self.token[:, None])
        if self.fused is not None:
            for i in range(len(self.layers)):
                x = self._fused_layer(i, x, cos, sin, key_mask, width)
        else:
            def attend(i: int, q: torch.Tensor) -> torch.Tensor:
                return self._attend(i, q, key_mask, width)

            for i in range(len(self.layers)):
                x = self._layer(i, x, cos, sin, self._write, attend)
        return self._head(x[:, 0])

    def _advance(self) -> None:
        self.pos += 1
        self.col += 1
        if self.flash:
            self.used += 1
        else:
            self.valid.index_fill_(1, self.col, True)

    @property
    def compactable(self) -> bool:
        """Whether :meth:`keep` may shrink the batch: the SDPA cache layout (not the flash one, whose sequence
        bounds would need rebuilding) and no captured graphs (they hold the buffers)."""
        return not self.flash and not self.graphs

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (positions in the current batch): their caches and step buffers."""
        if not self.compactable:
            raise RuntimeError("the decode batch can shrink only in the SDPA layout without captured graphs")
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.valid, self.token, self.pos = (t.index_select(0, rows) for t in (self.valid, self.token, self.pos))
        self.shape = dataclasses.replace(self.shape, rows=len(rows))

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed ``token (B,)``; the next ``(B, V)`` logits (eager decode: the CPU path, and the fallback when
        graphs cannot be captured; the captured path is :meth:`replay`)."""
        self.token.copy_(token)
        self._advance()
        self.step_index += 1
        return self._step()

    def _iteration(self, sampler: _Sampler, width: int) -> None:
        """One whole decode iteration on device buffers (what a graph captures): feed ``token``, decode,
        sample with this column's uniforms, record, and leave the sampled token in ``token``."""
        self._advance()
        logits = self._step(width)
        uniform = sampler.uniforms.index_select(0, sampler.t)[0]  # (B, 1): column t's draws
        self.token.copy_(sampler.record(*self.sample(logits, sampler.params, uniform=uniform)))

    def replay(self) -> None:
        """Replay the captured iteration for the next column. ``self.step_index`` counts steps on the host
        (the column is a device tensor a graph reads), so the graph of the narrowest width bucket that
        covers this step's column is picked without a sync."""
        self.step_index += 1
        needed = self.shape.width - self.decode_steps + self.step_index  # columns 0 .. col (col = P - 1 + steps)
        next(graph for width, graph in self.graphs if width >= needed).replay()

    def width_buckets(self) -> list[int]:
        """Cache widths of the captured decode graphs: every :data:`_WIDTH_BUCKET` columns past the prompt,
        and the whole cache. Attention over the filled prefix only: its cost grows with the step instead of
        always paying for the whole ``W`` (at 512 rows, ~30% of a full-width step)."""
        W, P = self.shape.width, self.shape.width - self.decode_steps
        if not _WIDTH_BUCKET:
            return [W]
        return sorted({min(W, P + b) for b in range(_WIDTH_BUCKET, self.decode_steps + _WIDTH_BUCKET, _WIDTH_BUCKET)})

    def capture(self, sampler: _Sampler) -> None:
        """Capture :meth:`_iteration` into one CUDA graph per width bucket (after warm-up runs on a side
        stream, as torch requires), sharing one memory pool: they replay one at a time, in capture order.

        Sampling, recording and the eos bookkeeping are inside the graph, so a decode step is one replay
        with no host work between steps (the sampling's dozen kernels used to be launched from Python
        after each replay). Warm-up and capture write cache column ``P`` and the sampler's buffers: every
        buffer they touch is restored afterwards, also when capture fails, and the first real step
        rewrites that column.
        """
        buffers = (self.token, self.pos, self.col, self.valid, self.used, *sampler.buffers())
        saved = [b.clone() for b in buffers]
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            widths = self.width_buckets()
            with torch.cuda.stream(stream):
                for width in widths:
                    for _ in range(2):
                        self._iteration(sampler, width)
            torch.cuda.current_stream().wait_stream(stream)
            pool = torch.cuda.graph_pool_handle()
            self.graphs = []
            for width in widths:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._iteration(sampler, width)
                self.graphs.append((width, graph))
        except RuntimeError:
            self.graphs = []
            raise
        finally:
            for buf, value in zip(buffers, saved):
                buf.copy_(value)

    def release(self) -> None:
        self.graphs, self.fused = [], None
        self.k = self.v = []
