"""One chunk's decode state (:class:`Decoder`): the static KV cache, the prefill, the fixed-shape decode step
and its CUDA graphs, and (eager decode) the batch shrinking to live rows; in parity mode (``rl.rollout.parity``) the
batch-invariant forward of :mod:`rlhf_core.models.parity` over that cache.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlhf_core.models.loading import has_lora
from rlhf_core.models.parity import canonical_attention
from rlhf_core.rollout.decode.attention import choose_row_kernel, flash_layout_attention, use_flash
from rlhf_core.rollout.decode.layer import (attention_inputs, biases, compiled_layer_halves, merged_weight,
                                            output_and_mlp, rotate, weight_scale)
from rlhf_core.rollout.decode.sampling import Sampler, choose_sampler, sampling_function
from rlhf_core.rollout.decode.settings import SETTINGS

log = logging.getLogger(__name__)


@dataclass
class _Shapes:
    rows: int
    width: int  # prompt width P + max_new_tokens R
    heads: int
    kv_heads: int
    head_dim: int


def _cat(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """``torch.cat(parts)``, written into ``out`` (a kept fused copy) when given."""
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def _into(value: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``value`` laid out contiguously (the model's own tensor stays itself), or copied into ``out`` (a kept copy)
    unless ``out`` is that very tensor."""
    if out is None:
        return value.contiguous()
    return out if out is value else out.copy_(value)


class Decoder:
    """One chunk's decode state: the static cache and the buffers a captured step reads and writes.

    Shapes: ``B`` rows, ``P`` prompt width, ``W = P + R`` cache width, ``H``/``H_kv`` query/KV heads,
    ``D`` head size, ``V`` vocabulary.

    ``parity`` (a batch-invariant ``model``, :func:`rlhf_core.models.parity.make_batch_invariant`): the model's own
    modules (their ``blocked_linear`` projections, no fused copies, no torch.compile), the SDPA cache layout
    ``(B, H_kv, W, D)``, attention through :func:`rlhf_core.models.parity.canonical_attention` over the filled prefix
    of the cache (the key count of HF generate's step), and the torch sampler, whose ``log_softmax(logits.float() /
    T)`` then gather is the HF engine's and the trainer's parity arithmetic. Decode is eager (the engine captures no
    CUDA graphs in parity mode: the filled prefix grows every step).
    """

    def __init__(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, n: int,
                 compiled: bool = False, triton: bool = True, triton_sampler: bool = True, parity: bool = False):
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
        self.rope = rotate
        self.parity = parity
        dtype = next(model.parameters()).dtype
        device = ids.device
        W = self.shape.width
        # Cache layout: (B, W, H_kv, D) for the flash kernel (a row's keys contiguous), else (B, H_kv, W, D).
        self.flash = not parity and use_flash(device, dtype, head_dim)
        self.row_kernel = choose_row_kernel(device, head_dim, triton) if self.flash else "sdpa"
        layout = (B, W, kv_heads, head_dim) if self.flash else (B, kv_heads, W, head_dim)
        self.k = [torch.empty(layout, dtype=dtype, device=device) for _ in self.layers]
        self.v = [torch.empty(layout, dtype=dtype, device=device) for _ in self.layers]
        # rotary tables for positions 0 .. W-1, from the model's own rotary module (any rope scaling)
        probe = torch.zeros(1, W, head_dim, dtype=dtype, device=device)
        cos, sin = self.inner.rotary_emb(probe, torch.arange(W, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]  # (W, D)
        # decode-step buffers (updated in place, read by the captured graph), one row per sample; filled by
        # load_prompts
        self.valid = torch.empty(B, W, dtype=torch.bool, device=device)  # keys a row may attend to
        self.token = torch.empty(B, dtype=torch.long, device=device)
        self.pos = torch.empty(B, dtype=torch.long, device=device)  # position of the last token fed
        self.col = torch.empty(1, dtype=torch.long, device=device)
        # flash, grouped (SETTINGS.flash_grouped): KV head j's G query heads are G query rows; the fused weights put
        # Q's heads (and o_proj's columns) in (g, j) order, so the projection writes those rows directly
        self.grouped = self.flash and SETTINGS.flash_grouped and heads > kv_heads
        self.cu_q = torch.arange(B + 1, dtype=torch.int32, device=device) * (heads // kv_heads if self.grouped else 1)
        # flash: row b's keys start at its first prompt token (left padding) and run ``used[b]`` columns
        self.cu_k = torch.empty(B + 1, dtype=torch.int32, device=device)
        self.used = torch.empty(B, dtype=torch.int32, device=device)
        self.decode_steps = max_new_tokens
        self.graphs: list[tuple[int, Any]] = []  # (cache width, CUDA graph of a whole iteration)
        self.load_prompts(ids, mask)
        self.fused = None if parity else self._fuse_weights()
        self.heads_regrouped = self.grouped and self.fused is not None
        self.compiled = compiled and self.fused is not None
        self.halves = compiled_layer_halves() if self.compiled else (attention_inputs, output_and_mlp)
        # triton or torch (SETTINGS.sampler); parity: torch, the log-softmax the trainer recomputes
        self.sampler = "torch" if parity else choose_sampler(device, triton_sampler)
        self.sample = sampling_function(self.sampler, self.compiled and SETTINGS.compile_sampler)

    def load_prompts(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Set every buffer that depends on the prompts ``ids``, ``mask (prompts, P)`` (of this decoder's shape), in
        place: the caches zeroed, the key mask, positions, column and sequence bounds of the prompts. A decoder
        kept from an earlier chunk then runs exactly as a fresh one, and its captured graphs, which read these
        buffers, stay valid."""
        B, W = self.shape.rows, self.shape.width
        P = ids.shape[1]
        if ids.shape[0] * self.n != B or W - self.decode_steps != P:
            raise ValueError(f"Decoder.load_prompts: prompts {tuple(ids.shape)} do not fit a decoder of {B} rows "
                             f"and width {W}")
        device = self.token.device
        self.ids, self.prompt_mask = ids, mask  # (prompts, P): one row per prompt
        row_mask = mask.repeat_interleave(self.n, dim=0)
        for cache in (*self.k, *self.v):
            cache.zero_()
        self.valid.zero_()
        self.valid[:, :P] = row_mask.bool()
        self.token.zero_()
        self.pos.copy_((row_mask.sum(-1) - 1).clamp(min=0))  # advanced before a step
        self.col.fill_(P - 1)
        start = P - row_mask.sum(-1)
        self.cu_k.copy_(torch.cat([torch.arange(B, device=device) * W + start, torch.tensor([B * W], device=device)]))
        self.used.copy_(P - start)
        self.step_index = 0

    def refresh_weights(self) -> None:
        """Copy the model's weights as they are now into the fused copies, in place (the captured graphs read
        them): a decoder kept across weight updates samples from the current weights."""
        if self.fused is not None:
            self._fuse_weights(into=self.fused)

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

    def _fuse_weights(self, into: list[dict[str, Any]] | None = None) -> list[dict[str, Any]] | None:
        """Per layer, Q/K/V and gate/up projections concatenated into one matrix each (decode only).

        A decode step at batch 512 is a chain of ~40 small kernels per layer (a profile in
        BENCHMARKS.md, "Rollout decode"); one GEMM for Q, K and V, one for gate and up, rotary
        embedding applied once to the Q and K heads together and a fused RMS norm cut that chain by
        about a third. Copies of the weights as they are when called: ``into`` (this decoder's copies, which its
        captured graphs read) is written in place instead (:meth:`refresh_weights`, before every chunk).
        ``None`` (use the model's modules) for layouts this does not cover (Qwen3's q/k norms), and on a GPU
        where the copies would take more than half the free memory (:meth:`_copies_fit`).
        """
        if into is None and not self._copies_fit():
            return None
        fused = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if hasattr(attn, "q_norm") or not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")) \
                    or not all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm,
                                                                         layer.post_attention_layernorm)):
                return None
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            try:
                qkv_bias, gate_up_bias = biases(projections), biases((mlp.gate_proj, mlp.up_proj))
            except ValueError:
                return None  # some projections biased, some not
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            o_proj = merged_weight(attn.o_proj)
            out = into[i] if into is not None else {}
            fused.append({**self._fused_scales(attn, mlp, out),  # an FP8 copy's scales (None each otherwise)
                # the model's own tensors (LoRA: merged copies), except the two concatenations
                "ln1": ln1.weight, "eps1": ln1.variance_epsilon, "ln2": ln2.weight, "eps2": ln2.variance_epsilon,
                "qkv": _cat([self._grouped_q(merged_weight(attn.q_proj)), merged_weight(attn.k_proj),
                             merged_weight(attn.v_proj)], out.get("qkv")),
                "qkv_bias": None if qkv_bias is None else _cat([self._grouped_q(qkv_bias[0]), *qkv_bias[1:]],
                                                               out.get("qkv_bias")),
                "o": _into(self._grouped_q(o_proj.T).T if self.grouped else o_proj, out.get("o")),
                "o_bias": attn.o_proj.bias,
                "gate_up": _cat([merged_weight(mlp.gate_proj), merged_weight(mlp.up_proj)], out.get("gate_up")),
                "gate_up_bias": None if gate_up_bias is None else _cat(gate_up_bias, out.get("gate_up_bias")),
                "down": _into(merged_weight(mlp.down_proj), out.get("down")), "down_bias": mlp.down_proj.bias,
            })
        return fused

    def _fused_scales(self, attn: Any, mlp: Any, out: dict[str, Any]) -> dict[str, torch.Tensor | None]:
        """An FP8 copy's per-output-channel weight scales (:class:`rlhf_core.models.fp8.Fp8Linear`), laid out as the
        fused weights' rows (Q's heads regrouped like Q's rows; o_proj's regrouped columns keep its rows' scales);
        ``None`` each for weights of another dtype. The concatenations are written into ``out``'s (a kept decoder's
        copies) when it has them, as :meth:`_fuse_weights` does the weights."""
        q, k, v = (weight_scale(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        gate, up = weight_scale(mlp.gate_proj), weight_scale(mlp.up_proj)
        return {"qkv_scale": None if q is None else _cat([self._grouped_q(q), k, v], out.get("qkv_scale")),
                "o_scale": weight_scale(attn.o_proj),
                "gate_up_scale": None if gate is None else _cat([gate, up], out.get("gate_up_scale")),
                "down_scale": weight_scale(mlp.down_proj)}

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
        if not self.parity:  # pad queries: no empty rows (SDPA would give NaN; canonical_attention gives them zeros)
            allowed |= torch.eye(P, dtype=torch.bool, device=self.ids.device)[None]
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
            if self.parity:  # (B, P, H, D), HF's own call of the parity attention
                o = canonical_attention(self.layers[i].self_attn, q, k, v, allowed[:, None], scaling=self.scaling)[0]
                return o.reshape(B, P, s.heads * s.head_dim)
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
        if self.parity:  # keys: the cache's first ``width`` columns, ``key_mask (B, 1, 1, width)``
            o, _ = canonical_attention(self.layers[i].self_attn, q, self.k[i][:, :, :width], self.v[i][:, :, :width],
                                       key_mask, scaling=self.scaling)  # (B, 1, H, D)
        elif self.flash:
            regroup = self.grouped and not self.heads_regrouped  # the model's own q_proj: heads in (j, g) order
            if regroup:
                q = q.reshape(B, s.kv_heads, G, D).transpose(1, 2)
            rows = q.reshape(B * G, s.kv_heads, D) if self.grouped else q.reshape(B, s.heads, D)
            o = flash_layout_attention(rows, self.k[i].view(-1, s.kv_heads, D), self.v[i].view(-1, s.kv_heads, D),
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
        halves around attention (compiled on a GPU, see :func:`compiled_layer_halves`), the cache write and
        attention between them."""
        w, s = self.fused[i], self.shape
        attention_inputs, output_and_mlp = self.halves
        q, k, v = attention_inputs(x, w["ln1"], w["eps1"], w["qkv"], w["qkv_bias"], cos, sin, s.heads, s.kv_heads,
                                   self.flash, w["qkv_scale"])
        self._write(i, k, v)
        o = self._attend(i, q, key_mask, width)
        return output_and_mlp(x, o, w["o"], w["o_bias"], w["ln2"], w["eps2"], w["gate_up"], w["gate_up_bias"],
                              w["down"], w["down_bias"], w["o_scale"], w["gate_up_scale"], w["down_scale"])

    def _step(self, width: int | None = None) -> torch.Tensor:
        """Reads ``token``, ``pos``, ``col``, ``valid``; writes the cache at ``col``; ``(B, V)`` logits.

        Attention reads cache columns ``0 .. width-1`` only (default: all ``W``); any ``width > col``
        gives the same result, since later columns are masked out.
        """
        if SETTINGS.sdpa_backends is not None:
            with sdpa_kernel([getattr(SDPBackend, name) for name in SETTINGS.sdpa_backends]):
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
        """Feed ``token (B,)``; the next ``(B, V)`` logits (eager decode: the CPU path, parity mode, and the fallback
        when graphs cannot be captured; the captured path is :meth:`replay`). Parity mode attends over the filled
        columns ``0 .. col`` only, as many keys as HF generate's cache holds at this step."""
        self.token.copy_(token)
        self._advance()
        self.step_index += 1
        return self._step(self.shape.width - self.decode_steps + self.step_index if self.parity else None)

    def _iteration(self, sampler: Sampler, width: int) -> None:
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
        """Cache widths of the captured decode graphs: every ``SETTINGS.width_bucket`` columns past the prompt,
        and the whole cache. Attention over the filled prefix only: its cost grows with the step instead of
        always paying for the whole ``W`` (at 512 rows, ~30% of a full-width step)."""
        W, P = self.shape.width, self.shape.width - self.decode_steps
        if not SETTINGS.width_bucket:
            return [W]
        bucket = SETTINGS.width_bucket
        return sorted({min(W, P + b) for b in range(bucket, self.decode_steps + bucket, bucket)})

    def capture(self, sampler: Sampler) -> None:
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
