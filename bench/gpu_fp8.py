"""FP8 rollouts (``rl.rollout.fp8``) against bf16 on one GPU, in one process: our static engine on the GRPO
benchmark's shape (Qwen2-0.5B-shaped random weights, 32k vocab, 64 prompts x 8 samples x 256 new tokens, CUDA graphs
and compiled layer halves as an RL run gets them).

* Rollout seconds: a warm-up call per engine, then ``--reps`` timed calls each, the engines interleaved and their
  order reversed every other rep (ABBA); median and range, and generated tokens/s (rows x median response length over
  the median call).
* Log-probs over the same prompts: each engine's sampled tokens (one seeded call each) scored by the bf16 trainer's
  recomputation (``token_logprobs``, the learner's forward): mean and max |engine - trainer| per token, and the
  mismatch KL (``rl_dashboard.mismatch_kl``: mean k3 estimate of KL(engine || trainer) per token).
* One weight sync each (``update_weights`` with the trainer's model): the FP8 copy is quantized again; the bf16
  engine samples from the trainer's model itself, so it moves nothing.

The random model's logits are near uniform, so responses run to the token budget and no reward is compared.

    PYTHONPATH=. python bench/gpu_fp8.py --out $OUT/gpu_fp8_rollout.json
    PYTHONPATH=. python bench/gpu_fp8.py --small --out bench/out/gpu_fp8_small.json   # CPU smoke test
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

import rlhf_core  # noqa: E402,F401  (offline switches)
from result_paths import result_path  # noqa: E402  (bench/ is sys.path[0])
from rlhf_core.rollout.engine import SamplingParams  # noqa: E402
from rlhf_core.rollout.static import StaticCacheEngine  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def trainer_gap(model, batch, device, rows: int = 64) -> dict:
    """The batch's sampling log-probs against the trainer's recomputation (``rows`` rows a forward): mean and max
    |diff| over the response tokens, and the mismatch KL."""
    from rlhf_core.trainers.rl_dashboard import mismatch_kl
    from rlhf_core.trainers.rl_forward import token_logprobs

    inputs, width = batch.learner_inputs(), batch.prompt_ids.shape[1]
    parts = []
    with torch.no_grad():
        for s in range(0, len(batch), rows):
            exp = {k: v[s:s + rows].to(device) for k, v in inputs.items()}
            parts.append(token_logprobs(model, exp, width, 1.0)[0].float().cpu())
    trainer, mask = torch.cat(parts), batch.response_mask.float()
    diff = (batch.sampling_logprobs - trainer).abs()[mask.bool()]
    return {"mean_abs": float(diff.mean()), "max_abs": float(diff.max()), "tokens": int(mask.sum()),
            "mismatch_kl": mismatch_kl(batch.sampling_logprobs, trainer, mask)}


def time_rollouts(engines: dict, prompts: list[str], args, sync) -> dict:
    """Warm-up, then ``args.reps`` timed calls each (ABBA); per engine its seconds and tokens/s."""
    out = {name: {"seconds": [], "lengths": []} for name in engines}
    for name, engine in engines.items():
        sync()
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(n=args.group, temperature=1.0, max_new_tokens=args.new_tokens, seed=99))
        sync()
        out[name]["first_call_s"] = round(time.perf_counter() - start, 2)
    for rep in range(args.reps):
        for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
            sync()
            start = time.perf_counter()
            batch = engines[name].generate(prompts, SamplingParams(n=args.group, temperature=1.0,
                                                                   max_new_tokens=args.new_tokens, seed=rep))
            sync()
            out[name]["seconds"].append(round(time.perf_counter() - start, 4))
            out[name]["lengths"].append(float(batch.response_lengths().float().mean()))
    rows, on_gpu = len(prompts) * args.group, torch.cuda.is_available()
    for name, row in out.items():
        med, length = statistics.median(row["seconds"]), statistics.median(row["lengths"])
        row.update(median_s=round(med, 4), range_s=[min(row["seconds"]), max(row["seconds"])],
                   mean_response_len=length, generated_tokens_per_s=round(rows * length / med, 1),
                   compiled_layers=engines[name].compile_layers and on_gpu,
                   cuda_graphs=engines[name].cuda_graphs and on_gpu)
        del row["lengths"]
        print(json.dumps({name: row}), flush=True)
    return out


def time_sync(engine, model, sync) -> dict:
    """One weight sync from the trainer's model (the FP8 copy quantizes again): seconds and bytes taken in."""
    sync()
    start = time.perf_counter()
    moved = engine.update_weights(model)
    sync()
    return {"seconds": round(time.perf_counter() - start, 4), "bytes": int(moved)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="micro model, short rows (a CPU smoke test)")
    ap.add_argument("--out", default="", help="default: bench/results/<device>/<UTC date>/gpu_fp8_rollout.json")
    args = ap.parse_args()
    if args.small:
        args.prompts, args.group, args.new_tokens = 4, 2, 8

    from gpu_grpo import build_model, build_tokenizer

    from rlhf_core.models.fp8 import fp8_unsupported
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="gpu-fp8-"))
    model_dir = build_model(build_tokenizer(32000, work / "tok"), work / "model", **(SMALL if args.small else {}))
    model = load_causal_lm(model_dir, device).to(torch.bfloat16).eval()  # the trainer's bf16 weights
    tok = load_tokenizer(model_dir, padding_side="left")
    prompts = [f"Question {i}: compute {i}*{i + 3} and explain" for i in range(args.prompts)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows = args.prompts * args.group
    engines = {"bf16": StaticCacheEngine(model, tok, batch_size=rows),
               "fp8": StaticCacheEngine(model, tok, batch_size=rows, fp8=True)}
    report: dict = {"what": "static engine, bf16 vs rl.rollout.fp8 (e4m3, per-channel weight and per-token input "
                            "scales), Qwen2-0.5B-shaped random weights, 32k vocab" if not args.small else "micro model",
                    "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "fp8_unsupported_here": fp8_unsupported(device),
                    "prompts": args.prompts, "group": args.group, "rows": rows, "new_tokens": args.new_tokens,
                    "reps": args.reps}
    report["rollout"] = time_rollouts(engines, prompts, args, sync)
    report["speedup_fp8_over_bf16"] = round(report["rollout"]["bf16"]["median_s"]
                                            / report["rollout"]["fp8"]["median_s"], 3)
    params = SamplingParams(n=args.group, temperature=1.0, max_new_tokens=args.new_tokens, seed=1234)
    report["logprobs_vs_bf16_trainer"] = {}
    for name, engine in engines.items():
        report["logprobs_vs_bf16_trainer"][name] = trainer_gap(model, engine.generate(prompts, params), device)
        print(json.dumps({name: report["logprobs_vs_bf16_trainer"][name]}), flush=True)
    report["weight_sync"] = {name: time_sync(engine, model, sync) for name, engine in engines.items()}
    report["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else 0
    print(json.dumps({"speedup_fp8_over_bf16": report["speedup_fp8_over_bf16"], "weight_sync": report["weight_sync"]}))
    out = Path(args.out) if args.out else result_path("gpu_fp8_rollout.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
