"""The head and norm kernels alone, on random tensors: ``head`` / ``heads`` (the LM-head paths), ``rlhead`` (the RL
update's head with entropy), ``rmsnorm`` (the module, liger's, torch's fused one).
"""

from __future__ import annotations

import statistics
import time

import torch

from rlhf_core.models.lm_head import LMHead, chunked_token_logprobs, liger_available, liger_token_logprobs

from .common import random_head, rel_error, timed


def head_part(n: int, hidden_size: int, vocab: int, device: torch.device, reps: int) -> dict:
    w32, h32, y, adv, dtype = random_head(n, hidden_size, vocab, device)

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
        times, peak = timed(lambda: run(path, w32.to(dtype), h32.to(dtype)), reps)
        out["paths"][path] = {"max_abs_dlogp_vs_fp32": float((got[0] - ref[0]).abs().max()),
                              "grad_hidden_rel_err": rel_error(got[1], ref[1]), "grad_weight_rel_err": rel_error(got[2], ref[2]),
                              "seconds_median": statistics.median(times), "seconds_min": min(times),
                              "seconds_max": max(times), "peak_gb": round(peak, 3)}
    return out


def rl_head_part(n: int, hidden_size: int, vocab: int, device: torch.device, reps: int) -> dict:
    """RL update's head: log-probs with an advantage-weighted gradient and a logged (gradient-free) entropy."""
    from rlhf_core.models.lm_head import head_logprobs, resolve_kernel

    w32, h32, y, adv, dtype = random_head(n, hidden_size, vocab, device)

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
        times, peak = timed(lambda: run(cfg, w32.to(dtype), h32.to(dtype)), reps)
        out["paths"][name] = {"resolved": resolve_kernel(cfg, n, vocab, needs_entropy_grad=False),
                              "max_abs_dlogp_vs_fp32": float((got[0] - ref[0]).abs().max()),
                              "max_abs_dentropy_vs_fp32": float((got[1] - ref[1]).abs().max()),
                              "grad_hidden_rel_err": rel_error(got[2], ref[2]), "grad_weight_rel_err": rel_error(got[3], ref[3]),
                              "seconds_median": statistics.median(times), "seconds_min": min(times),
                              "seconds_max": max(times), "peak_gb": round(peak, 3)}
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
            res = {"out_rel_err": rel_error(got[0], exact[0]), "grad_input_rel_err": rel_error(got[1], exact[1]),
                   "grad_weight_rel_err": rel_error(got[2], exact[2])}
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
