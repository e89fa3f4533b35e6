"""Where an SFT step's GPU time goes, on the side-by-side benchmark's shape (Qwen2-0.5B-shaped, 32k vocab,
32 rows x 512 tokens, the last 384 labelled): our trainer's pieces (precision regime, fused kernels, LM
head as ``auto`` resolves them, no gradient checkpointing), one optimizer step per iteration.

Reports the wall time of a step and its phases (forward + backward, optimizer step), the GPU-busy share
(CUDA time over wall time: low means the host is the limit), and torch.profiler's top CUDA ops over
three steps. Run on a lent GPU (``.devwheels`` carried)::

    source bench/device_setup.sh && python bench/gpu_sft_profile.py --out $OUT/gpu_sft_profile.json
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
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpu_profile import top  # noqa: E402
from rlhf_core.config import SFTConfig  # noqa: E402
from rlhf_core.models.lm_head import prepare_kernels  # noqa: E402
from rlhf_core.models.loading import load_causal_lm  # noqa: E402
from rlhf_core.models.precision import Precision  # noqa: E402
from rlhf_core.trainers.step import build_optimizer  # noqa: E402
from rlhf_core.trainers.sft import nll_loss_fn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default="gpu_sft_profile.json")
    args = ap.parse_args()
    from gpu_grpo import build_model, build_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="sftprof-"))
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1) if args.small else {}
    vocab = 2000 if args.small else 32000
    model_dir = build_model(build_tokenizer(vocab, work / "tok"), work / "model", **dims)
    cfg = SFTConfig(model_path=str(model_dir), precision=args.precision)
    precision = Precision.resolve(cfg.precision, device)
    model = load_causal_lm(model_dir, device, precision.load_dtype)
    head = prepare_kernels(cfg, model)
    optimizer = build_optimizer(model, 1e-5, 0.01, precision)
    model.train()
    rows, width = (4, 64) if args.small else (32, 512)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 10, (rows, width), generator=g)
    labels = ids.clone()
    labels[:, :width // 4] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    loss_fn = nll_loss_fn(head)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step() -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        loss, n = loss_fn(model, batch)
        (loss / n).backward()
        sync()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(3):
        step()
    phases = [step() for _ in range(8)]
    fwd_bwd, opt = [p[0] for p in phases], [p[1] for p in phases]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(3):
            step()
        wall = time.perf_counter() - t
    busy = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 1e6
    tokens = rows * width  # every position is a real token (no padding here)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "precision": args.precision,
           "lm_head": head.kernel, "rows": rows, "width": width, "tokens_per_step": tokens,
           "fwd_bwd_s": {"median": statistics.median(fwd_bwd), "min": min(fwd_bwd), "max": max(fwd_bwd)},
           "optimizer_s": {"median": statistics.median(opt), "min": min(opt), "max": max(opt)},
           "tokens_per_s": tokens / statistics.median([a + b for a, b in phases]),
           "gpu_busy_share": round(busy / wall, 3) if wall else None, "top_ops": top(prof, 25)}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "top_ops"}, indent=1))
    for row in out["top_ops"][:15]:
        print(row)


if __name__ == "__main__":
    main()
