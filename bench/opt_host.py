"""Host time of the bf16 regime's optimizer step (``MasterWeightAdamW.step``), the part of a 0.5B SFT step that
the H200 profile shows the device waiting for
(bench/results/h200/2026-12-03/prof_h200_0p5b_sft_phases.json: 5-6 ms gaps inside ``Optimizer.step``). The same 290 tensors as the Qwen2-0.5B-shaped model's trained parameters, each tiny, so the
device work is nil and what is timed is the host's: Python, the dispatcher and torch's AdamW bookkeeping. On a
CPU, with torch's fused AdamW kernel (the one that runs on a GPU), one torch thread.

    python bench/opt_host.py [--root CHECKOUT] [--steps 300] [--out FILE.json]

``--root`` times another checkout's ``rlhf_core`` (an A/B: `git archive REV rlhf_core | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def qwen2_0p5b_shapes(layers: int = 24) -> list[tuple[int, ...]]:
    """The trained tensors of a Qwen2-0.5B-shaped model (tied head), in order, each shrunk to a few elements:
    per layer q/k/v weights and biases, o, gate, up, down and two norms, then the embedding and the final norm."""
    layer = [(8, 4), (8,), (2, 4), (2,), (2, 4), (2,), (4, 8), (16, 4), (16, 4), (4, 16), (4,), (4,)]
    return layer * layers + [(32, 4), (4,)]


def time_steps(steps: int, warmup: int) -> list[float]:
    import torch

    from rlhf_core.distributed.parallel import optimizer_step
    from rlhf_core.models.precision import MasterWeightAdamW, Precision

    torch.manual_seed(0)
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in qwen2_0p5b_shapes()]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = MasterWeightAdamW(groups, Precision.BF16, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for group in opt.param_groups:
        group["fused"] = True  # what it picks with every tensor on CUDA; torch's fused AdamW runs on a CPU too
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    skip = torch.zeros(())
    out = []
    for _ in range(warmup + steps):
        for p in params:
            p.grad = torch.ones_like(p)
        start = time.perf_counter()
        optimizer_step(opt, skip)
        out.append(time.perf_counter() - start)
    return out[warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="checkout whose rlhf_core runs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", default="", help="append one JSON line here")
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    times = time_steps(args.steps, args.warmup)
    import torch

    row = {"root": Path(args.root).name, "tensors": len(qwen2_0p5b_shapes()), "steps": len(times),
           "median_ms": round(statistics.median(times) * 1e3, 4),
           "range_ms": [round(min(times) * 1e3, 4), round(max(times) * 1e3, 4)], "torch": torch.__version__}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
