"""What the parts of ``bench/gpu_lm_head_check.py`` share: device sync, relative error, timing with peak memory,
random heads, random models and the rows they read.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch


def device_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def timed(fn, reps: int) -> tuple[list[float], float]:
    """Seconds of each of ``reps`` calls after one warm-up, and the peak memory (GB) of a call."""
    fn()
    device_sync()
    times = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        device_sync()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if torch.cuda.is_available() else float("nan")
    return times, peak


def random_head(n: int, hidden_size: int, vocab: int, device: torch.device):
    """fp32 head weight ``(V, H)``, hidden states ``(n, H)``, targets ``(n,)``, signed non-uniform per-token
    upstream weights ``(n,)`` (as advantages are), and the dtype the card runs (bf16 on CUDA)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w32 = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(device)
    h32 = torch.randn(n, hidden_size, generator=g).to(device)
    y = torch.randint(0, vocab, (n,), generator=g).to(device)
    adv = (torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3).to(device)
    return w32, h32, y, adv, torch.bfloat16 if device.type == "cuda" else torch.float32


def random_model_dir(small: bool, prefix: str) -> tuple[Path, int]:
    """A random Qwen2-0.5B-shaped model (32k vocabulary; ``small``: a 2-layer micro model, 2k) in a new
    temporary folder, and its vocabulary size."""
    from gpu_grpo import build_model, build_tokenizer

    work = Path(tempfile.mkdtemp(prefix=prefix))
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1) if small else {}
    vocab = 2000 if small else 32000
    return build_model(build_tokenizer(vocab, work / "tok"), work / "model", **dims), vocab


def values_and_grads(step, model) -> tuple[torch.Tensor, dict]:
    """One call of ``step`` (a forward and a weighted backward): what it returns and every parameter's gradient in
    float32."""
    values = step()
    return values, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def grads_and_cost_vs_fp32(grads: dict, exact: dict, times: list[float], peak: float) -> dict:
    """A variant's parameter-gradient error against the fp32 run's (median and max over parameters), and its
    time (median and range of ``times``) and peak memory."""
    return {"grad_rel_err_median_vs_fp32": statistics.median(rel_error(grads[k], exact[k]) for k in grads),
            "grad_rel_err_max_vs_fp32": max(rel_error(grads[k], exact[k]) for k in grads),
            "seconds_median": statistics.median(times), "seconds_min": min(times),
            "seconds_max": max(times), "peak_gb": round(peak, 3)}


def random_examples(lengths: list[int], vocab: int, g: torch.Generator) -> list:
    """Token lists of the given lengths, the first quarter of each unlabelled."""
    from rlhf_core.data.tokenize import TokenizedExample

    out = []
    for n in lengths:
        ids = torch.randint(0, vocab - 10, (n,), generator=g).tolist()
        out.append(TokenizedExample(input_ids=ids, labels=[-100] * (n // 4) + ids[n // 4:]))
    return out


def pairs_sharing_prompts(n: int, small: bool, vocab: int, pad: int, g: torch.Generator) -> list:
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
