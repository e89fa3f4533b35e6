"""Whole-model paths: ``model`` (each head kernel with and without liger's fused kernels), ``compiled`` (the
compiled decoder layers), ``nosync`` (where SFT, DPO and reward-model micro-batches wait for the device).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from rlhf_core.models.lm_head import LMHead, apply_fused_kernels, labelled_token_logprobs, liger_available

from .common import device_sync, grads_and_cost_vs_fp32, random_examples, random_model_dir, rel_error, timed


def model_part(small: bool, device: torch.device, reps: int) -> dict:
    from rlhf_core.models.loading import load_causal_lm

    model_dir, _vocab = random_model_dir(small, "lmhead-")
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
        times, peak = timed(step, reps)
        scored = labels[:, 1:].to(device) != -100
        results[f"{kernel}{'+fused' if fused else ''}"] = {
            "max_abs_dlogp_vs_full": float((logp - reference[0])[scored].abs().max()),
            "mean_abs_dlogp_vs_full": float((logp - reference[0])[scored].abs().mean()),
            "grad_rel_err_max_over_params": max(rel_error(grads[k], reference[1][k]) for k in grads),
            "grad_rel_err_median_over_params": statistics.median(rel_error(grads[k], reference[1][k]) for k in grads),
            "mean_abs_dlogp_vs_fp32": float((logp - exact[0])[scored].abs().mean()),
            "grad_rel_err_median_vs_fp32": statistics.median(rel_error(grads[k], exact[1][k]) for k in grads),
            "seconds_median": statistics.median(times), "seconds_min": min(times), "seconds_max": max(times),
            "peak_gb": round(peak, 3)}
        model = None  # freed before the next variant loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "width": width, "labelled": labelled, "dtype": str(dtype), "results": results}


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

    model_dir, vocab = random_model_dir(small, "compiled-")
    g = torch.Generator().manual_seed(3)
    rows = 4 if small else 32
    lo, hi = (16, 64) if small else (128, 512)
    first = random_examples(torch.randint(lo, hi, (rows,), generator=g).tolist(), vocab, g)
    second = random_examples(torch.randint(lo, hi, (rows,), generator=g).tolist(), vocab, g)
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
        device_sync()
        first_s = time.perf_counter() - t
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        if reference:  # the packed rows' sequences in the same order: one fp32 padded reference serves both
            exact = (sums, grads)
            model = None
            continue
        times, peak = timed(step, reps)
        step(collate(second))  # other lengths: a recompile here would show in the graph count
        failed = [c.failed for c in layer_compile._COMPILED.values() if c.failed]
        results[name] = {"first_call_s": round(first_s, 2), "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
                         "compile_failed": failed,
                         "max_abs_dsum_vs_fp32": float((sums - exact[0]).abs().max()),
                         **grads_and_cost_vs_fp32(grads, exact[1], times, peak)}
        print(name, json.dumps(results[name]), flush=True)
        model = None  # freed before the next variant loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["results"] = results
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

    model_dir, vocab = random_model_dir(small, "nosync-")
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
