"""The LM-head paths on a GPU: the CPU tests' comparison (``tests/unit/test_lm_head.py``,
``tests/model/test_lm_head_paths.py``) rerun once in bf16 on the card, plus what each path costs.

Three parts, written to ``$OUT/gpu_lm_head_check.json``:

* ``head``: one LM head of the 1.5B shape (16,381 tokens x 1,536 -> 151,936, bf16 weights and hidden
  states), per-token log-probs by ``full`` (whole float32 logits), ``chunked``, ``liger`` (chunks of about
  4,096 rows, as ``lm_head: liger`` runs it) and ``liger-default`` (liger's own chunking), against
  an fp32 reference; upstream gradient non-uniform (random signed per-token weights, as advantages are).
  Reports max |delta log p|, relative gradient error (hidden, weight), median time of forward +
  backward over 5 runs, and peak memory.
* ``model``: a Qwen2-0.5B-shaped random model (32k vocabulary), bf16, 8 rows x 512 tokens with the
  last 384 labelled: ``labelled_token_logprobs`` under each head kernel, with and without liger's fused
  RMSNorm/RoPE/SwiGLU, against ``full`` without fused kernels and against the fp32 model (the size of
  bf16 rounding itself): log-prob deltas, parameter-gradient relative error, time and peak memory.

On a lent GPU (``.devwheels`` carried, liger-kernel in it: ``bench/device_wheels.sh``)::

    source bench/device_setup.sh && python bench/gpu_lm_head_check.py --out $OUT/gpu_lm_head_check.json

* ``packed``: 32 sequences of 128-511 tokens as one padding-free row, through torch's variable-length
  flash kernel (``rlhf_core.models.attention``, what ``packing: true`` gets on a GPU) and through SDPA's dense
  block-diagonal mask, against padded rows through SDPA, each against fp32 padded rows: per-sequence
  log-prob sums and gradients, time and memory (``--parts packed`` runs this part alone).

* ``heads`` (``--parts heads``): the same comparison at a 1.5B DPO micro-batch's 5,501 scored tokens and at
  the 0.5B shape (14,901 x 896 -> 32,000).

* ``rlhead`` (``--parts rlhead``): the RL update's LM head, which logs each token's entropy: ``head_logprobs``
  with ``with_entropy`` and no entropy gradient, by ``auto`` as a CPU resolves it (whole logits under 2 GiB,
  else chunked with the entropy in each chunk) and as a GPU with liger does (liger's log-probs, the entropy
  beside them without a gradient), at a 0.5B GRPO micro-batch (128 rows x 256 tokens over 32,000) and a 1.5B
  one (32 x 256 over 151,936): log-prob and entropy deltas against fp32, gradient error, time and memory.

* ``rlpacked`` (``--parts rlpacked``): RL's response-token log-probs on rollout-shaped rows (64 rows, prompts of
  12-39 tokens shared by groups of 8, responses of 64-255) by padded rows, shared prompts (the default) and
  ``rl.packing`` (one padding-free row, varlen on a GPU), bf16 against fp32 padded rows, with an
  advantage-weighted backward: log-prob deltas, gradient error, time and memory.

* ``pairtree`` (``--parts pairtree``): preference pairs sharing their prompts (16 pairs, prompts of 64-199 tokens,
  answers of 128-399) as padded rows, prefix trees (``collate_pair_tree``: what DPO and the reward model run when
  ``packing`` is false) and one padding-free row (varlen on a GPU), bf16 against fp32 padded rows: DPO's response
  log-prob sums and the reward model's scores, signed per-sequence weights in backward; deltas, gradient error,
  time and memory.

* ``rmsnorm`` (``--parts rmsnorm``): one Llama-family RMSNorm at a 0.5B GRPO micro-batch's shape (35,200 x 896)
  and a 1.5B one's (8,800 x 1,536), bf16, forward + backward with a random upstream gradient, by the module
  itself, liger-kernel's ``LigerRMSNorm`` and torch's fused ``rms_norm`` (what ``apply_fused_kernels`` now
  uses): error against the fp32 module, device time a call (median of 5 runs of 200 calls, CUDA events) and
  host time a call (the same loop's wall time with the device kept ahead: launches only).

* ``nosync`` (``--parts nosync``): SFT, DPO and reward-model micro-batches, padded and packed, forward and
  backward under ``torch.cuda.set_sync_debug_mode("warn")``: how often and where each waits for the device.

* ``compiled`` (``--parts compiled``): the decoder layers through ``torch.compile`` (``compile_layers: on``) against
  the eager layers with liger's kernels, padded and packed rows, bf16 against fp32: log-prob sums, gradients, the
  first call's seconds (the compile), steady-state time, memory, and the graphs compiled.

``--small`` runs every part at toy sizes (CPU: the liger rows are skipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from rlhf_core.models.lm_head import (LMHead, apply_fused_kernels, chunked_token_logprobs, labelled_token_logprobs,  # noqa: E402
                               liger_available, liger_token_logprobs)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _timed(fn, reps: int) -> tuple[list[float], float]:
    """Seconds of each of ``reps`` calls after one warm-up, and the peak memory (GB) of a call."""
    fn()
    _sync()
    times = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if torch.cuda.is_available() else float("nan")
    return times, peak


def _random_head(n: int, hidden_size: int, vocab: int, device: torch.device):
    """fp32 head weight ``(V, H)``, hidden states ``(n, H)``, targets ``(n,)``, signed non-uniform per-token
    upstream weights ``(n,)`` (as advantages are), and the dtype the card runs (bf16 on CUDA)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w32 = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(device)
    h32 = torch.randn(n, hidden_size, generator=g).to(device)
    y = torch.randint(0, vocab, (n,), generator=g).to(device)
    adv = (torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3).to(device)
    return w32, h32, y, adv, torch.bfloat16 if device.type == "cuda" else torch.float32


def head_part(n: int, hidden_size: int, vocab: int, device: torch.device, reps: int) -> dict:
    w32, h32, y, adv, dtype = _random_head(n, hidden_size, vocab, device)

    def run(path: str, w: torch.Tensor, h: torch.Tensor):
        w = w.detach().clone().requires_grad_(True)
        h = h.detach().clone().requires_grad_(True)
        head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device, dtype=w.dtype)
        head.weight = torch.nn.Parameter(w)
        if path == "full":
            logp = torch.log_softmax((h @ head.weight.T).float(), -1).gather(-1, y[:, None]).squeeze(-1)
        elif path == "chunked":
            logp, _ = chunked_token_logprobs(head, h, y, chunk_tokens=4096)
        else:  # liger: chunks of about 4,096 rows (what lm_head gets); liger-default: liger's own chunking
            logp = liger_token_logprobs(head.weight, h, y, chunk_rows=0 if path == "liger-default" else 4096)
        (logp * adv).sum().backward()
        return logp.detach(), h.grad, head.weight.grad

    ref = run("full", w32, h32)  # fp32 reference
    out = {"tokens": n, "hidden": hidden_size, "vocab": vocab, "dtype": str(dtype), "paths": {}}
    for path in ("full", "chunked") + (("liger-default", "liger") if liger_available() else ()):
        got = run(path, w32.to(dtype), h32.to(dtype))
        times, peak = _timed(lambda: run(path, w32.to(dtype), h32.to(dtype)), reps)
        out["paths"][path] = {"max_abs_dlogp_vs_fp32": float((got[0] - ref[0]).abs().max()),
                              "grad_hidden_rel_err": _rel(got[1], ref[1]), "grad_weight_rel_err": _rel(got[2], ref[2]),
                              "seconds_median": statistics.median(times), "seconds_min": min(times),
                              "seconds_max": max(times), "peak_gb": round(peak, 3)}
    return out


def rl_head_part(n: int, hidden_size: int, vocab: int, device: torch.device, reps: int) -> dict:
    """RL update's head: log-probs with an advantage-weighted gradient and a logged (gradient-free) entropy."""
    from rlhf_core.models.lm_head import head_logprobs, resolve_kernel

    w32, h32, y, adv, dtype = _random_head(n, hidden_size, vocab, device)

    def run(head_cfg: LMHead, w: torch.Tensor, h: torch.Tensor):
        h = h.detach().clone().requires_grad_(True)
        head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device, dtype=w.dtype)
        head.weight = torch.nn.Parameter(w.detach().clone())
        logp, entropy = head_logprobs(head, h, y, head_cfg, temperature=0.9, with_entropy=True, entropy_grad=False)
        (logp * adv).sum().backward()
        return logp.detach(), entropy, h.grad, head.weight.grad

    ref = run(LMHead(kernel="whole"), w32, h32)
    out = {"tokens": n, "hidden": hidden_size, "vocab": vocab, "dtype": str(dtype), "paths": {}}
    configs = {"auto-no-liger": LMHead(kernel="auto")}
    if liger_available():
        configs["auto-liger"] = LMHead(kernel="auto", prefer_liger=True)
    for name, cfg in configs.items():
        got = run(cfg, w32.to(dtype), h32.to(dtype))
        times, peak = _timed(lambda: run(cfg, w32.to(dtype), h32.to(dtype)), reps)
        out["paths"][name] = {"resolved": resolve_kernel(cfg, n, vocab, needs_entropy_grad=False),
                              "max_abs_dlogp_vs_fp32": float((got[0] - ref[0]).abs().max()),
                              "max_abs_dentropy_vs_fp32": float((got[1] - ref[1]).abs().max()),
                              "grad_hidden_rel_err": _rel(got[2], ref[2]), "grad_weight_rel_err": _rel(got[3], ref[3]),
                              "seconds_median": statistics.median(times), "seconds_min": min(times),
                              "seconds_max": max(times), "peak_gb": round(peak, 3)}
    return out


def _model_dir(small: bool, prefix: str) -> tuple[Path, int]:
    """A random Qwen2-0.5B-shaped model (32k vocabulary; ``small``: a 2-layer micro model, 2k) in a new
    temporary folder, and its vocabulary size."""
    from gpu_grpo import build_model, build_tokenizer

    work = Path(tempfile.mkdtemp(prefix=prefix))
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1) if small else {}
    vocab = 2000 if small else 32000
    return build_model(build_tokenizer(vocab, work / "tok"), work / "model", **dims), vocab


def model_part(small: bool, device: torch.device, reps: int) -> dict:
    from rlhf_core.models.loading import load_causal_lm

    model_dir, _vocab = _model_dir(small, "lmhead-")
    rows, width, labelled = (2, 64, 48) if small else (8, 512, 384)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    vocab = 2000 if small else 32000
    ids = torch.randint(0, vocab - 10, (rows, width), generator=g)
    labels = ids.clone()
    labels[:, :width - labelled] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    weights = torch.randn(rows, width - 1, generator=g).to(device)  # per-token, signed
    results, reference, exact = {}, None, None
    variants = [("full", False), ("chunked", False)]
    if liger_available():
        variants += [("liger", False), ("full", True), ("chunked", True), ("liger", True)]
    for kernel, fused in [("fp32-reference", False)] + variants:
        if kernel == "fp32-reference":  # the fp32 model, whole logits: the yardstick of bf16 rounding
            fp32 = load_causal_lm(model_dir, device)
            logp = labelled_token_logprobs(fp32, batch, LMHead("full"))
            (logp * weights).sum().backward()
            exact = (logp.detach(), {n: p.grad.float().clone() for n, p in fp32.named_parameters()
                                     if p.grad is not None})
            del fp32
            continue
        model = load_causal_lm(model_dir, device).to(dtype)
        if fused:
            apply_fused_kernels(model)
        head = LMHead(kernel, 4096)

        def step():
            model.zero_grad(set_to_none=True)
            logp = labelled_token_logprobs(model, batch, head)
            (logp * weights).sum().backward()
            return logp.detach()

        logp = step()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        if reference is None:
            reference = (logp, grads)
        times, peak = _timed(step, reps)
        scored = labels[:, 1:].to(device) != -100
        results[f"{kernel}{'+fused' if fused else ''}"] = {
            "max_abs_dlogp_vs_full": float((logp - reference[0])[scored].abs().max()),
            "mean_abs_dlogp_vs_full": float((logp - reference[0])[scored].abs().mean()),
            "grad_rel_err_max_over_params": max(_rel(grads[k], reference[1][k]) for k in grads),
            "grad_rel_err_median_over_params": statistics.median(_rel(grads[k], reference[1][k]) for k in grads),
            "mean_abs_dlogp_vs_fp32": float((logp - exact[0])[scored].abs().mean()),
            "grad_rel_err_median_vs_fp32": statistics.median(_rel(grads[k], exact[1][k]) for k in grads),
            "seconds_median": statistics.median(times), "seconds_min": min(times), "seconds_max": max(times),
            "peak_gb": round(peak, 3)}
        model = None  # freed before the next variant loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "width": width, "labelled": labelled, "dtype": str(dtype), "results": results}


def _values_and_grads(step, model) -> tuple[torch.Tensor, dict]:
    """One call of ``step`` (a forward and a weighted backward): what it returns and every parameter's gradient in
    float32."""
    values = step()
    return values, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grads_and_cost_vs_fp32(grads: dict, exact: dict, times: list[float], peak: float) -> dict:
    """A variant's parameter-gradient error against the fp32 run's (median and max over parameters), and its
    time (median and range of ``times``) and peak memory."""
    return {"grad_rel_err_median_vs_fp32": statistics.median(_rel(grads[k], exact[k]) for k in grads),
            "grad_rel_err_max_vs_fp32": max(_rel(grads[k], exact[k]) for k in grads),
            "seconds_median": statistics.median(times), "seconds_min": min(times),
            "seconds_max": max(times), "peak_gb": round(peak, 3)}


def packed_part(small: bool, device: torch.device, reps: int) -> dict:
    """Padding-free rows against padded rows through SDPA: per-sequence log-prob sums and parameter
    gradients, bf16, signed per-sequence weights, each against fp32 padded rows. Packed rows run through
    both attention paths (a trainer config's ``attention``): ``varlen`` (torch's flash varlen kernel, what
    ``packing: true`` gets on a GPU) and ``sdpa`` (transformers' dense block-diagonal mask)."""
    from rlhf_core.models import attention
    from rlhf_core.data.tokenize import TokenizedExample, collate_packed, collate_padded
    from rlhf_core.algorithms.logprobs import sequence_sums
    from rlhf_core.models.loading import load_causal_lm

    model_dir, vocab = _model_dir(small, "packed-")
    g = torch.Generator().manual_seed(2)
    rows = 4 if small else 32
    lengths = torch.randint(16 if small else 128, 64 if small else 512, (rows,), generator=g).tolist()
    examples = []
    for n in lengths:
        ids = torch.randint(0, vocab - 10, (n,), generator=g).tolist()
        examples.append(TokenizedExample(input_ids=ids, labels=[-100] * (n // 4) + ids[n // 4:]))
    weights = (torch.randn(rows, generator=g) * 2).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {"rows": rows, "tokens": sum(lengths), "padded_tokens": rows * max(lengths), "dtype": str(dtype)}
    try:
        from torch.nn.attention.varlen import varlen_attn
        import inspect

        out["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    except ImportError:
        out["varlen_attn_signature"] = None
    results = {}
    for name, packed, model_dtype, impl in (("fp32-padded", False, torch.float32, "sdpa"),
                                            ("padded-sdpa", False, dtype, "sdpa"),
                                            ("packed-sdpa", True, dtype, "sdpa"),
                                            ("packed-varlen", True, dtype, "varlen")):
        model = load_causal_lm(model_dir, device, attention=impl).to(model_dtype)
        batch = collate_packed(examples) if packed else collate_padded(examples, 0)

        def step():
            model.zero_grad(set_to_none=True)
            sums = sequence_sums(labelled_token_logprobs(model, batch, LMHead("chunked", 4096)), batch)
            (sums * weights).sum().backward()
            return sums.detach().float()

        before = dict(attention.calls)
        sums = step()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        if name == "fp32-padded":
            exact = (sums, grads)
            continue
        times, peak = _timed(step, reps)
        results[name] = {"attention": model.config._attn_implementation,
                         "layer_calls": {k: attention.calls[k] - before[k] for k in before},
                         "max_abs_dsum_vs_fp32": float((sums - exact[0]).abs().max()),
                         **_grads_and_cost_vs_fp32(grads, exact[1], times, peak)}
        model = None  # freed before the next variant loads
    out["results"] = results
    return out


def _examples(lengths: list[int], vocab: int, g: torch.Generator) -> list:
    """Token lists of the given lengths, the first quarter of each unlabelled."""
    from rlhf_core.data.tokenize import TokenizedExample

    out = []
    for n in lengths:
        ids = torch.randint(0, vocab - 10, (n,), generator=g).tolist()
        out.append(TokenizedExample(input_ids=ids, labels=[-100] * (n // 4) + ids[n // 4:]))
    return out


def compiled_part(small: bool, device: torch.device, reps: int) -> dict:
    """Decoder layers through ``torch.compile`` (``compile_layers: on``, :mod:`rlhf_core.models.layer_compile`) against
    the eager layers with liger's kernels (what ``fused_kernels: auto`` runs without it), for padded rows (SDPA
    with a mask inside the graph) and packed rows (torch's varlen flash kernel on a GPU), each set up by the
    trainers' own ``prepare_decoder_kernels``: per-sequence log-prob sums and gradients against fp32 padded rows,
    signed per-sequence weights; the first call's seconds (it compiles), steady-state time, peak memory; and
    the graphs compiled in all (one symbolic graph is meant to serve every layer and every length: a second
    batch of other lengths runs after the timing)."""
    import types

    from torch._dynamo.utils import counters

    from rlhf_core.models import layer_compile
    from rlhf_core.data.tokenize import collate_packed, collate_padded
    from rlhf_core.models.lm_head import prepare_decoder_kernels
    from rlhf_core.algorithms.logprobs import sequence_sums
    from rlhf_core.models.loading import load_causal_lm

    model_dir, vocab = _model_dir(small, "compiled-")
    g = torch.Generator().manual_seed(3)
    rows = 4 if small else 32
    lo, hi = (16, 64) if small else (128, 512)
    first = _examples(torch.randint(lo, hi, (rows,), generator=g).tolist(), vocab, g)
    second = _examples(torch.randint(lo, hi, (rows,), generator=g).tolist(), vocab, g)
    weights = (torch.randn(rows, generator=g) * 2).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {"rows": rows, "tokens": sum(len(e.input_ids) for e in first), "dtype": str(dtype),
                 "backend": "inductor"}
    results, exact = {}, None
    # compiled variants first: liger's RoPE patch (the eager variants' fused kernels) replaces a module-level
    # function of the model's file for every model loaded after it, compiled ones included
    for name, packed, model_dtype, compiled in (("fp32-padded", False, torch.float32, "off"),
                                                ("compiled-padded", False, dtype, "on"),
                                                ("compiled-packed", True, dtype, "on"),
                                                ("eager-padded", False, dtype, "off"),
                                                ("eager-packed", True, dtype, "off")):
        model = load_causal_lm(model_dir, device).to(model_dtype)
        reference = name.startswith("fp32")
        if not reference:
            cfg = types.SimpleNamespace(section=name, fused_kernels="auto", compile_layers=compiled, num_workers=1,
                                        parallel="ddp", lora_rank=0, compile_backend=out["backend"])
            prepare_decoder_kernels(cfg, model)
        collate = (lambda ex: collate_packed(ex)) if packed else (lambda ex: collate_padded(ex, 0))
        batch = collate(first)

        def step(batch=batch):
            model.zero_grad(set_to_none=True)
            sums = sequence_sums(labelled_token_logprobs(model, batch, LMHead("chunked", 4096)), batch)
            (sums * weights).sum().backward()
            return sums.detach().float()

        graphs = counters["stats"]["unique_graphs"]
        t = time.perf_counter()
        sums = step()
        _sync()
        first_s = time.perf_counter() - t
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        if reference:  # the packed rows' sequences in the same order: one fp32 padded reference serves both
            exact = (sums, grads)
            model = None
            continue
        times, peak = _timed(step, reps)
        step(collate(second))  # other lengths: a recompile here would show in the graph count
        failed = [c.failed for c in layer_compile._COMPILED.values() if c.failed]
        results[name] = {"first_call_s": round(first_s, 2), "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
                         "compile_failed": failed,
                         "max_abs_dsum_vs_fp32": float((sums - exact[0]).abs().max()),
                         **_grads_and_cost_vs_fp32(grads, exact[1], times, peak)}
        print(name, json.dumps(results[name]), flush=True)
        model = None  # freed before the next variant loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["results"] = results
    return out


def rl_packed_part(small: bool, device: torch.device, reps: int) -> dict:
    """RL's response-token log-probs (``rl_forward.token_logprobs``, temperature 0.9, the entropy logged) on rows
    laid out as the rollout leaves them, left-padded prompts shared by groups of 8 and right-padded responses,
    by the three layouts the trainer has: padded rows, each distinct prompt once (the default), and one
    padding-free row (``rl.packing``, torch's varlen flash kernel on a GPU); bf16, advantage-weighted backward,
    each against fp32 padded rows: log-prob deltas, gradient error, time and peak memory."""
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.trainers.rl_forward import token_logprobs

    model_dir, vocab = _model_dir(small, "rlpacked-")
    g = torch.Generator().manual_seed(3)
    prompts, group = (2, 4) if small else (8, 8)
    rows = prompts * group
    p_len = torch.randint(6 if small else 12, 12 if small else 40, (prompts,), generator=g).repeat_interleave(group)
    r_len = torch.randint(4 if small else 64, 16 if small else 256, (rows,), generator=g)
    P, R = int(p_len.max()), int(r_len.max())
    ids = torch.randint(0, vocab - 10, (prompts, P + R), generator=g).repeat_interleave(group, dim=0)
    ids[:, P:] = torch.randint(0, vocab - 10, (rows, R), generator=g)  # the group's samples differ
    cols = torch.arange(P + R)
    attention = ((cols >= P - p_len[:, None]) & (cols < P + r_len[:, None])).long()
    exp = {"input_ids": ids * attention, "attention_mask": attention,
           "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "response_ids": (ids * attention)[:, P:]}
    exp = {k: v.to(device) for k, v in exp.items()}
    mask = attention[:, P:].float().to(device)
    adv = (torch.randn(rows, R, generator=g) * 2).to(device) * mask
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {"rows": rows, "prompt_width": P, "response_width": R, "tokens": int(attention.sum()),
           "padded_tokens": rows * (P + R), "dtype": str(dtype)}
    results, exact = {}, None
    for name, model_dtype, way, impl in (("fp32-padded", torch.float32, {}, "sdpa"),
                                         ("padded", dtype, {}, "sdpa"),
                                         ("shared-prompts", dtype, {"share_prompts": True}, "auto"),
                                         ("packed-varlen", dtype, {"packed": True}, "auto")):
        model = load_causal_lm(model_dir, device, attention=impl).to(model_dtype).eval()

        def step():
            model.zero_grad(set_to_none=True)
            logp, _ = token_logprobs(model, exp, P, 0.9, with_entropy=True, head=LMHead("chunked", 4096), **way)
            (logp * adv).sum().backward()
            return logp.detach().float() * mask

        logp, grads = _values_and_grads(step, model)
        if exact is None:
            exact = (logp, grads)
            continue
        times, peak = _timed(step, reps)
        results[name] = {"attention": model.config._attn_implementation,
                         "max_abs_dlogp_vs_fp32": float((logp - exact[0]).abs().max()),
                         "mean_abs_dlogp_vs_fp32": float((logp - exact[0]).abs().sum() / mask.sum()),
                         **_grads_and_cost_vs_fp32(grads, exact[1], times, peak)}
        model = None  # freed before the next variant loads
    out["results"] = results
    return out


def rms_norm_part(small: bool, device: torch.device) -> list[dict]:
    """RMSNorm by the Llama-family module, liger's kernel and torch's fused ``rms_norm``: error against the fp32
    module (output and the input and weight gradients), and per call (forward + backward) the device's time
    and the host's (a ``torch.cuda._sleep`` ahead of the loop keeps the device busy, so the loop's wall
    time is what launching costs)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from rlhf_core.models.lm_head import use_torch_rms_norm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    calls, host_calls = (20, 5) if small else (200, 25)
    out = []
    for rows, width in ([(64, 32)] if small else [(35200, 896), (8800, 1536)]):
        g = torch.Generator().manual_seed(5)
        x0 = torch.randn(rows, width, generator=g).to(device)
        w0 = (1 + 0.1 * torch.randn(width, generator=g)).to(device)
        up = torch.randn(rows, width, generator=g).to(device)

        def module(kind: str, mdtype: torch.dtype) -> torch.nn.Module:
            m = Qwen2RMSNorm(width, eps=1e-6).to(device)
            m.weight.data.copy_(w0)
            m = m.to(mdtype)
            if kind == "torch":
                use_torch_rms_norm(m)
            elif kind == "liger":
                from liger_kernel.transformers.rms_norm import LigerRMSNorm

                lm = LigerRMSNorm(width, eps=1e-6).to(device)  # liger's defaults for Llama: casting_mode "llama"
                lm.weight.data.copy_(w0)
                m = lm.to(mdtype)
            return m

        def run(m: torch.nn.Module, mdtype: torch.dtype):
            x = x0.to(mdtype).detach().requires_grad_(True)  # a leaf of its own (x0.to(fp32) is x0 itself)
            m.zero_grad(set_to_none=True)
            y = m(x)
            y.backward(up.to(y.dtype))
            return y.detach().float(), x.grad.float(), m.weight.grad.float()

        exact = run(module("module", torch.float32), torch.float32)
        row = {"rows": rows, "width": width, "dtype": str(dtype), "paths": {}}
        kinds = ["module", "torch"] + (["liger"] if liger_available() else [])
        for kind in kinds:
            m = module(kind, dtype)
            got = run(m, dtype)
            res = {"out_rel_err": _rel(got[0], exact[0]), "grad_input_rel_err": _rel(got[1], exact[1]),
                   "grad_weight_rel_err": _rel(got[2], exact[2])}
            if device.type == "cuda":
                x = x0.to(dtype).detach().requires_grad_(True)
                g_up = up.to(dtype)
                dev, host = [], []
                for _ in range(5):
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(calls):
                        m(x).backward(g_up)
                    end.record()
                    torch.cuda.synchronize()
                    dev.append(start.elapsed_time(end) / calls)
                    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time: the loop below only launches
                    # few enough calls that their launches fit the device's queue (about a thousand pending
                    # kernels; past it a launch waits, and 200 calls of the module's ~20 kernels timed the sleep)
                    t0 = time.perf_counter()
                    for _ in range(host_calls):
                        m(x).backward(g_up)
                    host.append((time.perf_counter() - t0) * 1e3 / host_calls)
                    torch.cuda.synchronize()
                res.update({"device_ms_per_call": statistics.median(dev), "host_ms_per_call": statistics.median(host),
                            "host_ms_range": [min(host), max(host)]})
            row["paths"][kind] = res
        out.append(row)
    return out


def nosync_part(small: bool, device: torch.device) -> dict:
    """Whether a training micro-batch's forward and backward wait for the device anywhere: each trainer's
    loss path (SFT's NLL, DPO's sequence log-probs with the reference, the reward model's pair rewards),
    padded and packed rows, with the fused kernels and LM head as the trainers resolve them, run once to
    warm up and once under ``torch.cuda.set_sync_debug_mode("warn")`` (any host read of a device value, a
    blocking copy, a ``nonzero`` on the device warns there): the number of waits and where (file:line of the
    Python frame that made each; 2026-11-28's run used mode "error", which stops at the first)."""
    import collections
    import warnings

    from rlhf_core.data.tokenize import TokenizedExample, collate_pairs
    from rlhf_core.models.lm_head import resolve_lm_head
    from rlhf_core.algorithms.logprobs import response_logprobs
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rewards.model import load_reward_model, pair_rewards
    from rlhf_core.trainers.sft import nll_loss_fn

    model_dir, vocab = _model_dir(small, "nosync-")
    g = torch.Generator().manual_seed(3)
    pairs = []
    for _ in range(4 if small else 16):
        prompt = torch.randint(0, vocab - 10, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
        pair = []
        for _side in range(2):
            answer = torch.randint(0, vocab - 10, (int(torch.randint(4, 200, (1,), generator=g)),), generator=g).tolist()
            pair.append(TokenizedExample(prompt + answer, [-100] * len(prompt) + answer))
        pairs.append(tuple(pair))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fused = liger_available()
    policy, reference = (load_causal_lm(model_dir, device).to(dtype) for _ in range(2))
    reward = load_reward_model(model_dir, device).to(dtype)
    if fused:
        for m in (policy, reference, reward):
            apply_fused_kernels(m)
    head = resolve_lm_head("auto", 4096, fused=fused, head_whole=True)
    sft_loss = nll_loss_fn(head)

    def dpo(batch):
        logps = response_logprobs(policy, batch, head=head)
        with torch.no_grad():
            ref = response_logprobs(reference, batch, head=head)
        return torch.nn.functional.logsigmoid(0.1 * (logps - ref)).sum()

    cases = {"sft": (policy, lambda b: sft_loss(policy, b)[0]), "dpo": (policy, dpo),
             "rm": (reward, lambda b: pair_rewards(reward, b).sum())}
    out: dict = {"attention": policy.config._attn_implementation, "fused_kernels": fused, "lm_head": head.kernel,
                 "dtype": str(dtype), "cases": {}}
    for name, (model, fn) in cases.items():
        for packed in (False, True):
            batch = collate_pairs(pairs, 0, packed=packed)
            key = f"{name}-{'packed' if packed else 'padded'}"
            fn(batch).backward()  # warm-up: kernels chosen, caches built
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")  # every wait warns (mode "error" would stop at the first)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    fn(batch).backward()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
                model.zero_grad(set_to_none=True)
            waits = [f"{w.filename.split('/')[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
            out["cases"][key] = {"waits": len(waits), "where": dict(collections.Counter(waits))}
    return out


def _pairs_sharing_prompts(n: int, small: bool, vocab: int, pad: int, g: torch.Generator) -> list:
    """``n`` preference pairs whose two answers share a prompt (64-199 tokens; 8-23 small) and differ from their
    first token (128-399 tokens each; 8-31 small), labels on the answers; no token is ``pad`` (a padded row's
    score is pooled at its last non-pad token)."""
    from rlhf_core.data.tokenize import TokenizedExample

    def rand(lo: int, hi: int) -> list[int]:
        ids = torch.randint(0, vocab - 10, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)
        return torch.where(ids == pad, (pad + 1) % (vocab - 10), ids).tolist()

    pairs = []
    for _ in range(n):
        prompt = rand(8, 24) if small else rand(64, 200)
        a, b = (rand(8, 32), rand(8, 32)) if small else (rand(128, 400), rand(128, 400))
        b[0] = a[0] + 1 if a[0] + 1 not in (pad, vocab - 10) else a[0] - 1
        pairs.append(tuple(TokenizedExample(input_ids=prompt + x, labels=[-100] * len(prompt) + x) for x in (a, b)))
    return pairs


def pair_tree_part(small: bool, device: torch.device, reps: int) -> dict:
    """Pairs as prefix trees (``collate_pair_tree``, what DPO and the reward model run when ``packing`` is false)
    against padded rows and one padding-free row (varlen on a GPU), bf16, each against fp32 padded rows: DPO's
    per-sequence response log-prob sums and the reward model's scores, signed per-sequence weights in backward;
    value deltas, gradient error, time and peak memory."""
    from rlhf_core.data.tokenize import collate_pair_tree, collate_pairs
    from rlhf_core.algorithms.logprobs import response_logprobs
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rewards.model import load_reward_model, pair_rewards

    from transformers import AutoConfig

    model_dir, vocab = _model_dir(small, "pairtree-")
    pad = AutoConfig.from_pretrained(model_dir).pad_token_id
    g = torch.Generator().manual_seed(4)
    pairs = _pairs_sharing_prompts(4 if small else 16, small, vocab, pad, g)
    weights = (torch.randn(2 * len(pairs), generator=g) * 2).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layouts = {"padded": collate_pairs(pairs, pad), "tree": collate_pair_tree(pairs, pad),
               "packed": collate_pairs(pairs, pad, packed=True)}
    out: dict = {"pairs": len(pairs), "dtype": str(dtype),
                 "tokens": {k: int(b["input_ids"].numel()) for k, b in layouts.items()},
                 "sequence_tokens": int(layouts["tree"]["n_tokens"])}
    for what, load, fn in (("dpo_logprobs", load_causal_lm,
                            lambda m, b: response_logprobs(m, b, head=LMHead("chunked", 4096))),
                           ("reward_scores", load_reward_model, pair_rewards)):
        results, exact = {}, None
        for name, layout, model_dtype, impl in (("fp32-padded", "padded", torch.float32, "sdpa"),
                                                ("padded", "padded", dtype, "sdpa"),
                                                ("tree", "tree", dtype, "sdpa"),
                                                ("packed-varlen", "packed", dtype, "auto")):
            torch.manual_seed(0)  # the reward model's new score head: the same random init in every variant
            model = load(model_dir, device, attention=impl).to(model_dtype)
            batch = layouts[layout]

            def step():
                model.zero_grad(set_to_none=True)
                values = fn(model, batch)
                (values * weights).sum().backward()
                return values.detach().float()

            values, grads = _values_and_grads(step, model)
            if exact is None:
                exact = (values, grads)
                continue
            times, peak = _timed(step, reps)
            results[name] = {"max_abs_delta_vs_fp32": float((values - exact[0]).abs().max()),
                             **_grads_and_cost_vs_fp32(grads, exact[1], times, peak)}
            model = None  # freed before the next variant loads
        out[what] = results
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_lm_head_check.json")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--parts", default="head,model,packed",
                    help="comma-separated: head, heads, rlhead, model, packed, rlpacked, pairtree, rmsnorm, nosync, "
                         "compiled")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = 2 if args.small else 5
    import transformers

    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "small": args.small,
           "parts": sorted(parts)}
    if "head" in parts:  # token counts not divisible by 16: liger_token_logprobs pads them
        out["head"] = head_part(509 if args.small else 16381, 64 if args.small else 1536,
                                1000 if args.small else 151936, device, reps)
    if "heads" in parts:  # a 1.5B DPO micro-batch's scored tokens (8k-token packed rows), and 0.5B SFT's
        out["heads"] = [head_part(n, h, v, device, reps) for n, h, v in
                        ([(301, 64, 1000), (509, 32, 3000)] if args.small else [(5501, 1536, 151936), (14901, 896, 32000)])]
    if "rlhead" in parts:  # a 0.5B GRPO update micro-batch (128 x 256 tokens) and a 1.5B one (32 x 256)
        out["rlhead"] = [rl_head_part(n, h, v, device, reps) for n, h, v in
                         ([(301, 64, 1000), (509, 32, 3000)] if args.small else [(32768, 896, 32000), (8192, 1536, 151936)])]
    if "model" in parts:
        out["model"] = model_part(args.small, device, reps)
    if "packed" in parts:
        out["packed"] = packed_part(args.small, device, reps)
    if "rlpacked" in parts:
        out["rlpacked"] = rl_packed_part(args.small, device, reps)
    if "pairtree" in parts:
        out["pairtree"] = pair_tree_part(args.small, device, reps)
    if "rmsnorm" in parts:
        out["rmsnorm"] = rms_norm_part(args.small, device)
    if "nosync" in parts:
        out["nosync"] = nosync_part(args.small, device)
    if "compiled" in parts:
        out["compiled"] = compiled_part(args.small, device, reps)
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        out["liger_kernel"] = version("liger-kernel")
    except ImportError:
        out["liger_kernel"] = None
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
