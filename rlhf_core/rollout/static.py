"""Our own rollout engine: a static KV cache, CUDA graphs over the decode step, early stop.

Why not ``model.generate``: HF ``generate`` of a 0.4B model at batch 512 spends 20-30x longer per
decode step than the weights and KV cache need in memory traffic (BENCHMARKS.md, "Rollout decode"):
the step is bound by Python and kernel launches (a few hundred small kernels), not by the GPU. vLLM fixes that but cannot be
installed everywhere (not on the lent GPUs, for one). This engine does what vLLM's decode
does for one fixed batch, in plain torch:

* the cache is preallocated, ``(B, H_kv, P + R, D)`` per layer, and step ``t`` writes column ``P + t``
  (prompts are left-padded, so every row's new token shares a column); the decoder holding it (with the fused
  weight copies and the captured graphs) is kept for the next chunk of the same shape and sampling settings,
  its buffers reset and the current weights copied in (``SETTINGS.keep_decoder``), so a training run captures
  once;
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
  uniforms drawn up front; on a GPU, temperature sampling without top-k / top-p is one Triton kernel,
  :mod:`rlhf_core.models.fused_sampling`) and the eos bookkeeping are captured with the decode step, so a step is
  one replay; the loop stops once every row has emitted eos (checked every few steps so the host
  does not wait on the GPU each step);
* in parity mode (``rl.rollout.parity``: a policy made batch-invariant, :mod:`rlhf_core.models.parity`) the decode
  runs the model's own blocked projections, the canonical attention over the cache and the torch sampler, eagerly
  (no compiled layers, no CUDA graphs), so every sampled token's log-prob equals the trainer's recomputation bit
  for bit (:class:`rlhf_core.rollout.decode.decoder.Decoder`).

It runs the model's own modules (projections, norms, MLP, rotary embedding), so it holds no
weights of its own: :meth:`update_weights` copies into the model in place and captured graphs
stay valid (the fused copies are refreshed from the model before every chunk; a parameter given new storage
makes a new decoder). Architectures: the Llama family's decoder layer (``llama``, ``qwen2``, ``qwen3``
with its q/k norms, ``mistral`` within its sliding window), with or without peft LoRA adapters (a LoRA
policy's projections are merged, ``W + s B A``, into the per-call copies the decode step reads; the
prefill runs peft's own layers); :func:`supports` says why a model is refused, and
:func:`rlhf_core.trainers.rl_parts.build_rollout_engine` then falls back to HF ``generate``.

Log-probs follow the contract of :mod:`rlhf_core.rollout.engine`: ``log_softmax(logits / T)`` of the
sampled token, before top-k / top-p filtering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Sequence

import torch

from rlhf_core.models.parity import is_batch_invariant
from rlhf_core.rollout.decode.decoder import Decoder
from rlhf_core.rollout.decode.layer import attention_inputs, output_and_mlp
from rlhf_core.rollout.decode.sampling import Sampler, sampling_function
from rlhf_core.rollout.decode.settings import SETTINGS
from rlhf_core.rollout.engine import (HFGenerateEngine, RolloutBatch, SamplingParams, _left_pad, assemble_batch,
                                      response_mask_from_ids)

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# How often (in decode steps) the host asks whether every row has finished: on a GPU each ask waits
# for the device, so it asks every 16 steps there and every step on the CPU.
_EOS_CHECK_EVERY = {"cuda": 16}


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
    without DoRA or a LoRA bias (what :func:`rlhf_core.rollout.decode.layer.merged_weight` merges, or a module the
    decode step calls as is); otherwise why not."""
    try:
        from peft.tuners import lora  # lazy: peft (optional: LoRA)
        from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: peft (optional: LoRA)
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


class StaticCacheEngine(HFGenerateEngine):
    """Rollouts from a Llama-family causal LM with our decode loop (see the module docstring).

    Weights, the bf16 sampling copy under mixed precision and :meth:`update_weights` are the HF
    engine's (in place, so captured graphs stay valid); only generation differs.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 256, autocast_dtype: torch.dtype | None = None,
                 cuda_graphs: bool = True, compile_layers: bool | None = None, fp8: bool = False):
        """``compile_layers``: compile the decode layer's halves
        (:func:`rlhf_core.rollout.decode.layer.compiled_layer_halves`) where CUDA graphs are captured; ``None`` reads
        ``SETTINGS.compile_layers`` (:data:`rlhf_core.rollout.decode.settings.SETTINGS`). ``fp8``: the HF engine's
        (an e4m3 sampling copy; the prefill and the fused decode projections run its FP8 products)."""
        reason = supports(model)
        if reason:
            raise ValueError(f"StaticCacheEngine: cannot run this model: {reason}")
        super().__init__(model, tokenizer, batch_size=batch_size, autocast_dtype=autocast_dtype, fp8=fp8)
        self.cuda_graphs = cuda_graphs
        self.compile_layers = SETTINGS.compile_layers if compile_layers is None else compile_layers
        self.triton_attention = True  # auto's Triton decode attention; False once it failed to build here
        self.triton_sampler = True  # auto's Triton sampler; False once it failed to build here
        cfg = model.config
        self._window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
        # Seconds spent in each phase of generate (encode, decoder set-up, prefill, capture, decode, to_host,
        # assemble), summed over calls, when a caller sets this to a dict (bench/gpu_engine.py --phases): each phase
        # then waits for the device at its ends, so a timed run is a little slower. None (the default): no waits.
        self.phase_seconds: dict[str, float] | None = None
        # The last chunk's (key, decoder, sampler), kept for the next chunk of the same key (SETTINGS.keep_decoder)
        self._kept: tuple[tuple, Decoder, Sampler] | None = None

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

    @property
    def _parity(self) -> bool:
        """Whether the model sampled from runs the batch-invariant forward (``rl.rollout.parity``)."""
        return is_batch_invariant(self._sampling_model)

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
        # Each prompt is prefilled once and its cache shared by its n samples (rows i*n .. i*n+n-1). Parity mode
        # decodes eagerly: its attention reads the cache's filled prefix, one more column each step.
        graphs = self.cuda_graphs and device.type == "cuda" and not self._parity
        with self._phase("decoder_setup", device):
            decoder, sampler = self._decoder_for(ids.to(device), mask.to(device), params, device, graphs)
        with self._phase("prefill", device):
            logits = decoder.prefill()
        ids, mask = ids.repeat_interleave(params.n, dim=0), mask.repeat_interleave(params.n, dim=0)
        if graphs and not decoder.graphs:
            with self._phase("capture", device):
                self._check_sampler(decoder, sampler, logits)
                self._capture(decoder, sampler)
        with self._phase("decode", device):
            if decoder.graphs:
                steps = _decode_in_graphs(decoder, logits, sampler, generator)
            else:
                steps = _decode_eagerly(decoder, logits, sampler, generator)
        with self._phase("to_host", device):
            if not SETTINGS.keep_decoder:
                self.release_decoder()
            response = sampler.out_ids[:, :steps].to("cpu", copy=True)  # copies: a kept sampler's buffers are reused
            logprobs = sampler.out_logp[:, :steps].to("cpu", copy=True)
            response_mask = response_mask_from_ids(response, eos, params.stop_token_ids)
            longest = max(int(response_mask.sum(-1).max()), 1)  # columns after every row's eos: dropped, as generate does
            response, response_mask, logprobs = response[:, :longest], response_mask[:, :longest], logprobs[:, :longest]
            response = response.masked_fill(response_mask == 0, pad)
        return ids, mask, response, response_mask, logprobs.masked_fill(response_mask == 0, 0.0)

    def _decoder_for(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, device: torch.device,
                     graphs: bool) -> tuple[Decoder, Sampler]:
        """The chunk's decoder and sampler: the kept ones, reset for these prompts with the weights copied in
        afresh, where everything their captured graphs depend on is unchanged (:meth:`_decoder_key`); else new
        ones (the kept ones dropped first, so two never hold memory together)."""
        key = self._decoder_key(ids, params, device, graphs)
        if self._kept is not None and self._kept[0] == key and self._kept[1].shape.rows == ids.shape[0] * params.n:
            _, decoder, sampler = self._kept  # rows: the eager decode may have shrunk it (Decoder.keep)
            decoder.load_prompts(ids, mask)
            decoder.refresh_weights()
            sampler.reset()
            return decoder, sampler
        self.release_decoder()
        decoder = Decoder(self._sampling_model, ids, mask, params.max_new_tokens, params.n,
                          compiled=graphs and self.compile_layers, triton=self.triton_attention,
                          triton_sampler=self.triton_sampler, parity=self._parity)
        self._check_row_kernel(decoder)
        sampler = Sampler(params, ids.shape[0] * params.n, params.max_new_tokens, self.tokenizer.eos_token_id,
                          self.tokenizer.pad_token_id, device)
        self._kept = (key, decoder, sampler)
        return decoder, sampler

    def _decoder_key(self, ids: torch.Tensor, params: SamplingParams, device: torch.device, graphs: bool) -> tuple:
        """What a kept decoder's buffers and captured graphs were made for: the prompts' shape, the sampling settings
        but the seed (the graph samples with them), the decode switches and parity mode, and the weights' storage (a
        graph reads their addresses: a parameter given new storage, e.g. a rollout replica's weights released and
        refilled under rl.rollout.sleep, makes a new decoder) and LoRA adapters' switches (the unfused path runs peft's
        layers as captured)."""
        model = self._sampling_model
        adapters = tuple((m.disable_adapters, m.merged, tuple(m.active_adapters)) for m in model.modules()
                         if hasattr(m, "get_base_layer")) if hasattr(model, "peft_config") else ()
        return (device, tuple(ids.shape), dataclasses.replace(params, seed=None), graphs, self._parity,
                self.compile_layers, self.triton_attention, self.triton_sampler, dataclasses.astuple(SETTINGS),
                adapters, tuple(p.data_ptr() for p in model.parameters()))

    def release_decoder(self) -> None:
        """Drop the kept decoder and sampler (cache, fused weight copies, captured graphs): their memory goes back
        to the allocator. The next chunk builds new ones."""
        if self._kept is not None:
            self._kept[1].release()
            self._kept = None

    def _check_row_kernel(self, decoder: Decoder) -> None:
        """Build auto's Triton decode attention once, eagerly, before any graph captures it; where it fails (a
        Triton or driver this kernel does not build on), torch's flash kernel from now on."""
        if decoder.row_kernel != "triton" or SETTINGS.attention != "auto":
            return
        try:
            decoder.run_row_kernel()
        except Exception as err:  # noqa: BLE001 - Triton's compile errors are of many kinds; all mean "not here"
            log.warning("StaticCacheEngine: the Triton decode attention failed (%s); torch's flash kernel from now "
                        "on", err)
            self.triton_attention = False
            decoder.row_kernel = "flash"

    def _check_sampler(self, decoder: Decoder, sampler: Sampler, logits: torch.Tensor) -> None:
        """Build auto's Triton sampler once, eagerly, on the prefill's logits ``(B, V)`` (zero uniforms: the call's
        generator is not drawn from) before any graph captures it; where it fails, torch's sampling from now on."""
        if decoder.sampler != "triton" or SETTINGS.sampler != "auto":
            return
        try:
            decoder.sample(logits, sampler.params, uniform=torch.zeros((logits.shape[0], 1), device=logits.device))
        except Exception as err:  # noqa: BLE001 - Triton's compile errors are of many kinds; all mean "not here"
            log.warning("StaticCacheEngine: the Triton sampler failed (%s); torch's sampling from now on", err)
            self.triton_sampler = False
            decoder.sampler = "torch"
            decoder.sample = sampling_function("torch", decoder.compiled and SETTINGS.compile_sampler)

    def _capture(self, decoder: Decoder, sampler: Sampler) -> None:
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
                decoder.halves = (attention_inputs, output_and_mlp)
                decoder.sample = sampling_function(decoder.sampler, compiled=False)
        try:
            decoder.capture(sampler)
        except RuntimeError as err:
            log.warning("StaticCacheEngine: CUDA graph capture failed (%s); decoding eagerly from now on", err)
            self.cuda_graphs = False



def _decode_eagerly(decoder: Decoder, logits: torch.Tensor, sampler: Sampler,
                    generator: torch.Generator) -> int:
    """Sample, record and decode step by step (the CPU path; a uniform a row drawn per step); the steps run.

    Where the decoder allows it (:attr:`Decoder.compactable`), rows that have finished leave its batch once
    they are more than ``1 - SETTINGS.compact_below`` of it, so later steps compute live rows only (a CPU GRPO
    step's responses run 1-12 tokens around a median of 5: most of a fixed-batch decode's work went to finished
    rows).
    Uniforms are still drawn for every row, in the same order, and a row's logits do not depend on the others,
    so the samples are the whole batch's, their log-probs to an ulp (a smaller batch's GEMMs may round
    differently; ``tests/model/test_rollout_static.py``).
    """
    R, check_every = sampler.out_ids.shape[1], _EOS_CHECK_EVERY.get(logits.device.type, 1)
    rows, device = sampler.out_ids.shape[0], logits.device
    live = torch.arange(rows, device=device)  # the decoder's rows among all rows
    for t in range(R):
        uniform = None if sampler.params.greedy else torch.rand((rows, 1), device=device, generator=generator)
        token, logp = decoder.sample(logits, sampler.params, uniform=None if uniform is None else uniform[live])
        if len(live) < rows:  # rows gone from the decoder record pad (they have finished: record pads them)
            token = torch.full((rows,), sampler.pad, dtype=token.dtype, device=device).index_copy_(0, live, token)
            logp = torch.zeros(rows, dtype=logp.dtype, device=device).index_copy_(0, live, logp)
        token = sampler.record(token, logp)
        if t == R - 1 or ((t + 1) % check_every == 0 and bool(sampler.finished.all())):
            return t + 1
        if decoder.compactable and (t + 1) % check_every == 0:  # where the host reads ``finished`` anyway
            running = ~sampler.finished[live]
            kept = int(running.sum())
            if kept <= SETTINGS.compact_below * len(live):
                keep = running.nonzero().squeeze(-1)
                decoder.keep(keep)
                live = live[keep]
        logits = decoder.step(token[live])
    return R


def _decode_in_graphs(decoder: Decoder, logits: torch.Tensor, sampler: Sampler,
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

