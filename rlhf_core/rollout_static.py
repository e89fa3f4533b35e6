"""Our own rollout engine: a static KV cache, CUDA graphs over the decode step, early stop.

Why not ``model.generate``: on an H100, HF ``generate`` of a 0.4B model at batch 512 spends
14-20 ms per decode step (``../shared/device/ANCHORS.md``, ``bench/results``) where the weights
and KV cache need about 0.6 ms of memory traffic: the step is bound by Python and kernel
launches (a few hundred small kernels), not by the GPU. vLLM fixes that but cannot be
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
* sampling (temperature, top-k, top-p; inverse-CDF with the call's own generator, every step's
  uniforms drawn up front) and the eos bookkeeping are captured with the decode step, so a step is
  one replay; the loop stops once every row has emitted eos (checked every few steps so the host
  does not wait on the GPU each step).

It runs the model's own modules (projections, norms, MLP, rotary embedding), so it holds no
weights of its own: :meth:`update_weights` copies into the model in place and captured graphs
stay valid. Architectures: the Llama family's decoder layer (``llama``, ``qwen2``, ``qwen3``
with its q/k norms, ``mistral`` within its sliding window); :func:`supports` says why a model is
refused, and :func:`rlhf_core.trainers.rl.build_rollout_engine` then falls back to HF ``generate``.

Log-probs follow the contract of :mod:`rlhf_core.rollout`: ``log_softmax(logits / T)`` of the
sampled token, before top-k / top-p filtering.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from rlhf_core.rollout import (HFGenerateEngine, RolloutBatch, SamplingParams, _left_pad, assemble_batch,
                               response_mask_from_ids)

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# How often (in decode steps) the host asks whether every row has finished: on a GPU each ask waits
# for the device, so it asks every 16 steps there and every step on the CPU.
_EOS_CHECK_EVERY = {"cuda": 16}
# Columns between the cache widths of the decode graphs (see _Decoder.width_buckets); 0: one graph over
# the whole cache. Measured on an H100 (bench/results/gpu_engine_h100_width_ab.json, 512 x 256): eight
# 32-column graphs 1.67 s against one graph 1.35 s: graphs are captured per generate call, and the
# extra captures cost more than the narrower attention saves. Kept for graphs kept across calls.
_WIDTH_BUCKET = 0
# SDPA backends a decode step may use (None: torch's choice, cuDNN on an H100), by name of
# torch.nn.attention.SDPBackend; bench/gpu_engine.py's static_cuda_graphs_<backend> engines A/B them.
_DECODE_SDPA: tuple[str, ...] | None = None


def supports(model: Any) -> str | None:
    """``None`` when this engine can run ``model``; otherwise the reason it cannot."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {SUPPORTED}"
    if hasattr(model, "peft_config"):
        return "the model carries LoRA adapters (the HF engine samples through them)"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model does not have the Llama-family layout (model.embed_tokens/layers/norm/rotary_emb)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if kind == "qwen2" and getattr(cfg, "use_sliding_window", False):
        return "Qwen2 sliding-window attention"
    return None


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
                 cuda_graphs: bool = True):
        reason = supports(model)
        if reason:
            raise ValueError(f"StaticCacheEngine: cannot run this model: {reason}")
        super().__init__(model, tokenizer, batch_size=batch_size, autocast_dtype=autocast_dtype)
        self.cuda_graphs = cuda_graphs
        cfg = model.config
        self._window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None

    @property
    def name(self) -> str:
        return "static"

    # ---- generate ---------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> RolloutBatch:
        """``params.n`` samples per prompt; see :class:`rlhf_core.rollout.RolloutBatch` for the layout."""
        return self.generate_ids(self._encode(prompts), params, prompts)

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
        return assemble_batch(self.tokenizer, prompts, params.n, chunks)

    def _generate_chunk(self, encoded: Sequence[list[int]], params: SamplingParams, device: torch.device,
                        generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        ids, mask = _left_pad(encoded, pad)
        # Each prompt is prefilled once and its cache shared by its n samples (rows i*n .. i*n+n-1).
        decoder = _Decoder(self._sampling_model, ids.to(device), mask.to(device), params.max_new_tokens, params.n)
        logits = decoder.prefill()
        ids, mask = ids.repeat_interleave(params.n, dim=0), mask.repeat_interleave(params.n, dim=0)
        sampler = _Sampler(params, ids.shape[0], params.max_new_tokens, eos, pad, device)
        if self.cuda_graphs and device.type == "cuda":
            try:
                decoder.capture(sampler)  # restores every buffer it touched, also when it fails
            except RuntimeError as err:  # e.g. an op of this model/torch that graphs cannot capture
                log.warning("StaticCacheEngine: CUDA graph capture failed (%s); decoding eagerly from now on", err)
                self.cuda_graphs = False
        if decoder.graphs:
            steps = _decode_in_graphs(decoder, logits, sampler, generator)
        else:
            steps = _decode_eagerly(decoder, logits, sampler, generator)
        out_ids, out_logp = sampler.out_ids, sampler.out_logp
        decoder.release()
        response = out_ids[:, :steps].cpu()
        logprobs = out_logp[:, :steps].cpu()
        response_mask = response_mask_from_ids(response, eos, params.stop_token_ids)
        longest = max(int(response_mask.sum(-1).max()), 1)  # columns after every row's eos: dropped, as generate does
        response, response_mask, logprobs = response[:, :longest], response_mask[:, :longest], logprobs[:, :longest]
        response = response.masked_fill(response_mask == 0, pad)
        return ids, mask, response, response_mask, logprobs.masked_fill(response_mask == 0, 0.0)


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


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """The Llama-family RMSNorm (statistics in float32, scaled in the input dtype) as one fused op."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
            uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``(rows,)`` and its ``log_softmax(logits / T)`` ``(rows,)`` from ``(rows, V)`` logits.

    ``uniform`` ``(rows, 1)``: the rows' U(0, 1) draws, given (a captured graph cannot draw from a
    generator it does not own); else drawn from ``generator``.
    """
    logits = logits.float()
    if params.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
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
    # Inverse-CDF sampling: one uniform per row, u * total mass located in the running sum of
    # softmax(s). Exact like Gumbel-max, but draws B numbers instead of B x V (profiled on an H100 at
    # B = 512, V = 32k: the per-element noise cost as much as a third of the decode step).
    cdf = (scores - scores.amax(-1, keepdim=True)).exp_().cumsum_(-1)
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
    """Sample, record and decode step by step (the CPU path; a uniform drawn per step); the steps run."""
    R, check_every = sampler.out_ids.shape[1], _EOS_CHECK_EVERY.get(logits.device.type, 1)
    for t in range(R):
        token = sampler.record(*_sample(logits, sampler.params, generator))
        if t == R - 1 or ((t + 1) % check_every == 0 and bool(sampler.finished.all())):
            return t + 1
        logits = decoder.step(token)
    return R


def _decode_in_graphs(decoder: "_Decoder", logits: torch.Tensor, sampler: _Sampler,
                      generator: torch.Generator) -> int:
    """The captured path: every step's uniforms drawn at once, the prefill's token sampled eagerly, then
    one replay per new token, each a whole iteration (decode, sample, record) with no host work between;
    the host reads ``finished`` every few steps only. The steps run."""
    R, check_every = sampler.out_ids.shape[1], _EOS_CHECK_EVERY.get(logits.device.type, 1)
    sampler.uniforms.copy_(torch.rand(sampler.uniforms.shape, device=logits.device, generator=generator))
    decoder.token.copy_(sampler.record(*_sample(logits, sampler.params, uniform=sampler.uniforms[0])))
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

    def __init__(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, n: int):
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
        self.k = [torch.zeros(B, kv_heads, W, head_dim, dtype=dtype, device=device) for _ in self.layers]
        self.v = [torch.zeros(B, kv_heads, W, head_dim, dtype=dtype, device=device) for _ in self.layers]
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
        self.decode_steps, self.step_index = max_new_tokens, 0
        self.graphs: list[tuple[int, Any]] = []  # (cache width, CUDA graph of a whole iteration)
        self.fused = self._fuse_weights()

    def _fuse_weights(self) -> list[dict[str, Any]] | None:
        """Per layer, Q/K/V and gate/up projections concatenated into one matrix each (decode only).

        A decode step at batch 512 is a chain of ~40 small kernels per layer (profiled on an H100:
        bench/results/gpu_profile_h100.json); one GEMM for Q, K and V, one for gate and up, rotary
        embedding applied once to the Q and K heads together and a fused RMS norm cut that chain by
        about a third. Copies of this call's weights, so they are rebuilt with the decoder (per call).
        ``None`` (use the model's modules) for layouts this does not cover (Qwen3's q/k norms).
        """
        fused = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if hasattr(attn, "q_norm") or not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")) \
                    or not all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm,
                                                                         layer.post_attention_layernorm)):
                return None
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            biases = [p.bias for p in projections]
            fused.append({
                "qkv": torch.cat([p.weight for p in projections]),
                "qkv_bias": torch.cat(biases) if all(b is not None for b in biases) else None,
                "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            })
            if any(b is not None for b in biases) and fused[-1]["qkv_bias"] is None:
                return None  # some projections biased, some not
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

    def _fused_layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     key_mask: torch.Tensor, width: int) -> torch.Tensor:
        """:meth:`_layer` for one decode position ``x (B, 1, hidden)`` with the fused projections."""
        layer, w, s = self.layers[i], self.fused[i], self.shape
        B, G, D = s.rows, s.heads // s.kv_heads, s.head_dim
        h = _rms_norm(x, layer.input_layernorm)
        qkv = F.linear(h, w["qkv"], w["qkv_bias"]).view(B, s.heads + 2 * s.kv_heads, 1, D)  # (B, H + 2 H_kv, 1, D)
        qk, _ = self.rope(qkv[:, :s.heads + s.kv_heads], qkv[:, :0], cos, sin)  # rotary on Q and K heads at once
        q, k = qk[:, :s.heads], qk[:, s.heads:]
        v = qkv[:, s.heads + s.kv_heads:]
        self.k[i].index_copy_(2, self.col, k)
        self.v[i].index_copy_(2, self.col, v)
        o = F.scaled_dot_product_attention(q.reshape(B, s.kv_heads, G, D), self.k[i][:, :, :width],
                                           self.v[i][:, :, :width], attn_mask=key_mask, scale=self.scaling)
        x = x + layer.self_attn.o_proj(o.reshape(B, 1, s.heads * D))
        gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), w["gate_up"]).chunk(2, dim=-1)
        return x + layer.mlp.down_proj(F.silu(gate) * up)

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
        s = self.shape
        B, G = s.rows, s.heads // s.kv_heads
        width = width or s.width
        cos, sin = self.cos[self.pos][:, None], self.sin[self.pos][:, None]  # (B, 1, D)
        key_mask = self.valid[:, None, None, :width]  # (B, 1, 1, width)
        if self.fused is not None:
            x = self.inner.embed_tokens(self.token[:, None])
            for i in range(len(self.layers)):
                x = self._fused_layer(i, x, cos, sin, key_mask, width)
            return self._head(x[:, 0])

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[i].index_copy_(2, self.col, k)
            self.v[i].index_copy_(2, self.col, v)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            # the G query heads of each KV head as G query rows over that head's cache: no K/V copies
            o = F.scaled_dot_product_attention(q.reshape(B, s.kv_heads, G, s.head_dim), self.k[i][:, :, :width],
                                               self.v[i][:, :, :width], attn_mask=key_mask, scale=self.scaling)
            return o.reshape(B, 1, s.heads * s.head_dim)

        x = self.inner.embed_tokens(self.token[:, None])
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin, write, attend)
        return self._head(x[:, 0])

    def _advance(self) -> None:
        self.pos += 1
        self.col += 1
        self.valid.index_fill_(1, self.col, True)

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
        self.token.copy_(sampler.record(*_sample(logits, sampler.params, uniform=uniform)))

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
        always paying for the whole ``W`` (on an H100 at 512 rows, ~30% of a full-width step)."""
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
        buffers = (self.token, self.pos, self.col, self.valid, *sampler.buffers())
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
