"""Liger-kernel on the GPU, before wiring it in (issue 17, item 1): is it right, and what would it buy?

Two measurements, one call on a lent GPU:

* ``lm_head``: liger's fused linear + cross-entropy (``LigerFusedLinearCrossEntropyLoss``) against the
  torch path our trainers take today (bf16 ``hidden @ W.T`` -> fp32 logits -> per-token cross-entropy),
  at the LM head of a Qwen2.5-0.5B/1.5B-like shape with the real Qwen2.5 vocabulary (151,936) and a
  NON-uniform upstream gradient (per-token weights drawn like advantages, some negative), with
  ``reduction='none'`` (the per-token gradient liger fixed in 0.8.5, PR #1298) and ``'sum'``: per-token
  loss and the gradients of hidden states and weight, relative to the reference's norm; peak memory
  and time (median and range of 5).
* ``sft``: our SFT trainer, unchanged, on the side-by-side bench's Qwen2-0.5B-shaped model
  (``bench/side_by_side.py --variant gpu`` settings), plain vs with liger's RoPE, RMSNorm and SwiGLU
  patched into the Qwen2 classes (its fused LM head does not apply: our loss reads logits). Child
  processes in ABBA order; step seconds, median and range of the timed steps.

Writes ``$OUT/gpu_liger_probe.json``. On the device, after ``source bench/device_setup.sh`` with the
liger-kernel wheel in ``.devwheels/`` (``bench/device_wheels.sh``): ``python3 bench/gpu_liger_probe.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _torch_path(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, reduction: str):
    logits = (x @ w.T).float()
    ce = torch.nn.functional.cross_entropy(logits, y, reduction="none", ignore_index=-100)
    return ce, (ce * weights).sum() if reduction == "none" else ce.sum()


def _liger_path(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, reduction: str):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    out = LigerFusedLinearCrossEntropyLoss(reduction=reduction, ignore_index=-100)(w, x, y)
    return (out, (out * weights).sum()) if reduction == "none" else (None, out)


def _run_head(path, x0, w0, y, weights, reduction) -> dict:
    times, result = [], {}
    for i in range(6):  # the first is a warm-up (Triton compiles)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        per_token, total = path(x, w, y, weights, reduction)
        total.backward()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - started)
        result = {"per_token": None if per_token is None else per_token.detach(), "total": total.detach(),
                  "dx": x.grad, "dw": w.grad, "peak_gb": (torch.cuda.max_memory_allocated() - base) / 2**30}
    result["seconds"] = _summary(times)
    return result


def lm_head(hidden: int, tokens: int, vocab: int = 151936) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = (torch.randn(tokens, hidden, device="cuda", generator=g) * 1.0).bfloat16()
    w0 = (torch.randn(vocab, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    y[::17] = -100  # padding / prompt tokens
    weights = torch.randn(tokens, device="cuda", generator=g)  # advantage-like: mixed signs, non-uniform
    out = {"shape": {"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": "bf16"}}
    for reduction in ("none", "sum"):
        ref = _run_head(_torch_path, x0, w0, y, weights, reduction)
        lig = _run_head(_liger_path, x0, w0, y, weights, reduction)
        row = {"total_rel": _rel(lig["total"], ref["total"]), "dx_rel": _rel(lig["dx"], ref["dx"]),
               "dw_rel": _rel(lig["dw"], ref["dw"]),
               "torch": {"peak_gb": ref["peak_gb"], "seconds": ref["seconds"]},
               "liger": {"peak_gb": lig["peak_gb"], "seconds": lig["seconds"]}}
        if reduction == "none":
            keep = y != -100
            row["per_token_max_abs"] = float((lig["per_token"][keep] - ref["per_token"][keep]).abs().max())
            row["ignored_tokens_zero"] = bool((lig["per_token"][~keep] == 0).all())
        out[f"reduction_{reduction}"] = row
    return out


def sft_child(kind: str, inputs: dict[str, str]) -> dict:
    import side_by_side

    if kind == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return side_by_side.ours("gpu", "sft", inputs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["plain", "liger"])
    ap.add_argument("--inputs")
    ap.add_argument("--small", action="store_true", help="small shapes: a smoke test of the script")
    args = ap.parse_args()
    if args.child:
        if args.small:
            import side_by_side

            side_by_side.make_small()
        print("RESULT " + json.dumps(sft_child(args.child, json.loads(args.inputs))))
        return
    import liger_kernel
    import side_by_side

    out_dir = Path(os.environ.get("OUT", REPO / "bench" / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "liger_kernel": getattr(liger_kernel, "__version__", "0.8.5"), "small": args.small}
    shapes = [(896, 1024)] if args.small else [(896, 4096), (1536, 8192)]
    report["lm_head"] = [lm_head(h, n) for h, n in shapes]
    print(json.dumps(report["lm_head"], indent=1, default=str), flush=True)
    if args.small:
        side_by_side.make_small()
    inputs = side_by_side.build_gpu_inputs(Path(tempfile.mkdtemp()), args.small)
    runs: dict[str, list[float]] = {"plain": [], "liger": []}
    peaks: dict[str, list[float]] = {"plain": [], "liger": []}
    for kind in ("plain", "liger", "liger", "plain"):  # ABBA
        proc = subprocess.run([sys.executable, __file__, "--child", kind, "--inputs", json.dumps(inputs)]
                              + (["--small"] if args.small else []), capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-3000:]}")
        res = json.loads(line[len("RESULT "):])
        runs[kind] += res["step_s"][2:]  # the first two steps warm up (allocator, autotune)
        peaks[kind].append(res["peak_memory_gb"])
    report["sft_0.5b_shape"] = {
        "settings": side_by_side.SETTINGS["gpu"]["sft"], "order": "plain, liger, liger, plain",
        "step_s": {k: _summary(v) for k, v in runs.items()}, "peak_memory_gb": peaks,
        "speedup_median": statistics.median(runs["plain"]) / statistics.median(runs["liger"])}
    name = "gpu_liger_probe_small.json" if args.small else "gpu_liger_probe.json"
    (out_dir / name).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["sft_0.5b_shape"], indent=1))


if __name__ == "__main__":
    main()
