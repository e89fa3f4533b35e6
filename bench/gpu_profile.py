"""Where a GRPO step's GPU time goes: torch.profiler over one captured decode iteration of the static engine
and over one update micro-batch (forward + backward, gradient checkpointing, bf16 autocast), on the
GRPO benchmark's model (Qwen2-0.5B-shaped, 32k vocab) and shapes (512 rows, prompt ~20 + 256 tokens).

Prints the top CUDA-time ops of each and writes them to ``--out``. Run on a lent GPU::

    PYTHONPATH=. python bench/gpu_profile.py --out $OUT/gpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import rlhf_core  # noqa: E402,F401


def top(prof, n: int = 25) -> list[dict]:
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:n]:
        rows.append({"op": e.key[:90], "calls": e.count, "device_ms": round(e.self_device_time_total / 1000, 3),
                     "cpu_ms": round(e.self_cpu_time_total / 1000, 3)})
    return rows


def timed(fn, reps: int = 5) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


P = 20  # prompt tokens of the profiled rows


def profile_decode(model_dir: Path, args, report: dict) -> None:
    """One captured decode iteration of the static engine (decode + sample + record), before (masked SDPA over
    the whole cache, plain layer halves; keys prefixed ``before_``) and as the engine runs now on a GPU (flash
    over each row's filled keys, compiled halves; no prefix): capture time, replay and eager times, top kernels."""
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rollout.decode.decoder import Decoder
    from rlhf_core.rollout.decode.sampling import Sampler, sample
    from rlhf_core.rollout.decode.settings import SETTINGS
    from rlhf_core.rollout.engine import SamplingParams

    dev = torch.device("cuda")
    sampler = load_causal_lm(model_dir, dev).to(torch.bfloat16).eval()
    ids = torch.randint(5, 30000, (args.rows // 8, P), device=dev)
    mask = torch.ones_like(ids)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=args.new_tokens)
    for variant, attention, compiled in (("before_", "sdpa", False), ("", "auto", True)):
        SETTINGS.attention = attention
        with torch.no_grad():
            dec = Decoder(sampler, ids, mask, args.new_tokens, 8, compiled=compiled)
            dec.prefill()
            state = Sampler(params, args.rows, args.new_tokens, eos=-1, pad=0, device=dev)  # eos -1: no row ends
            state.uniforms.uniform_()
            t = time.perf_counter()
            dec.capture(state)
            report[variant + "capture_s"] = round(time.perf_counter() - t, 2)
            for _ in range(100):  # fill the cache about halfway, as the mean decode step sees it
                dec.replay()
            report[variant + "iteration_ms_graph"] = round(1000 * timed(dec.replay, 20), 3)
            report[variant + "decode_step_ms_eager"] = round(1000 * timed(lambda: dec._step(), 5), 3)
            logits = dec._step()
            uniform = state.uniforms[0]
            report[variant + "sample_ms_eager"] = round(1000 * timed(lambda: sample(logits, params, uniform=uniform), 20), 3)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    dec.replay()
                torch.cuda.synchronize()
            report[variant + "iteration_graph_top_5_replays"] = top(prof)
            dec.release()
    SETTINGS.attention = "auto"
    del sampler
    torch.cuda.empty_cache()


def profile_update(model_dir: Path, args, report: dict) -> None:
    """One update micro-batch (forward + backward, gradient checkpointing, bf16 autocast) and one no-grad
    log-prob forward: times, peak memory, TFLOP/s by 6NT / 2NT, top kernels of the update."""
    from rlhf_core.models.loading import load_causal_lm, prepare_for_training
    from rlhf_core.distributed.parallel import train_mode
    from rlhf_core.trainers.rl_forward import token_logprobs

    dev = torch.device("cuda")
    policy = load_causal_lm(model_dir, dev).eval()
    prepare_for_training(policy, gradient_checkpointing=True)
    W = P + args.new_tokens
    exp = {"input_ids": torch.randint(5, 30000, (args.micro, W), device=dev),
           "attention_mask": torch.ones(args.micro, W, dtype=torch.long, device=dev),
           "position_ids": torch.arange(W, device=dev).expand(args.micro, W),
           "response_ids": torch.randint(5, 30000, (args.micro, args.new_tokens), device=dev)}
    exp["response_ids"] = exp["input_ids"][:, P:]

    def update() -> None:
        with train_mode(policy), torch.autocast("cuda", dtype=torch.bfloat16):
            logp, ent = token_logprobs(policy, exp, P, 1.0, with_entropy=True)
            loss = logp.mean()
        loss.backward()

    def forward_only() -> None:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            token_logprobs(policy, exp, P, 1.0)

    update()
    torch.cuda.reset_peak_memory_stats()
    report["update_micro_s"] = round(timed(update, 3), 4)
    report["update_micro_peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    report["forward_micro_s"] = round(timed(forward_only, 3), 4)
    tokens = args.micro * W
    n = sum(p.numel() for p in policy.parameters())
    report["update_micro_tflops_6NT"] = round(6 * n * tokens / report["update_micro_s"] / 1e12, 1)
    report["forward_micro_tflops_2NT"] = round(2 * n * tokens / report["forward_micro_s"] / 1e12, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        update()
        torch.cuda.synchronize()
    report["update_top"] = top(prof, 30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--micro", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default="bench/out/gpu_profile.json")
    ap.add_argument("--decode-only", action="store_true", help="profile the decode iteration only")
    args = ap.parse_args()
    from gpu_grpo import build_model, build_tokenizer

    work = Path(tempfile.mkdtemp())
    model_dir = build_model(build_tokenizer(32000, work / "tok"), work / "model")
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    profile_decode(model_dir, args, report)
    if not args.decode_only:
        profile_update(model_dir, args, report)
    _print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def _print(report: dict) -> None:
    for k, v in report.items():
        if "_top" not in k:
            print(k, v)
    for k in [k for k in report if "_top" in k]:
        print(k)
        for r in report[k]:
            print("  ", r)


if __name__ == "__main__":
    main()
