"""Rollout engines on a GPU: HF ``generate`` (our HFGenerateEngine) vs our StaticCacheEngine, eager and
with CUDA graphs, on the GRPO benchmark's shape (Qwen2-0.5B-shaped random weights, 32k vocab, bf16,
64 prompts x 8 samples x 256 new tokens), plus the checks that make the speed usable:

* greedy tokens of the static engine vs HF generate (bf16: the two may part at a near-tie; the
  fraction of rows identical to the end is reported),
* the static engine's sampling log-probs vs the trainer's teacher-forced recomputation (bf16).

Run on a lent GPU: ``PYTHONPATH=. python bench/gpu_engine.py --out $OUT/gpu_engine.json``.
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


from rlhf_core.rollout.decode.attention import choose_row_kernel, flash_layout_attention, use_flash  # noqa: E402
from rlhf_core.rollout.decode.sampling import choose_sampler  # noqa: E402
from rlhf_core.rollout.decode.settings import SETTINGS, DecodeSettings  # noqa: E402
from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams  # noqa: E402
from rlhf_core.rollout.static import StaticCacheEngine  # noqa: E402

# Static engines: name -> the settings it runs under (compile_layers is the engine's own argument, the rest fields
# of the decode SETTINGS). static_cuda_graphs is what an RL run gets; static_before is the engine before
# flash decode attention and compiled layer halves (2026-11-29).
_DEFAULTS = DecodeSettings()
DEFAULT = dict(compile_layers=None, attention=_DEFAULTS.attention, sdpa_backends=_DEFAULTS.sdpa_backends,
               width_bucket=_DEFAULTS.width_bucket, flash_grouped=_DEFAULTS.flash_grouped,
               compile_sampler=_DEFAULTS.compile_sampler, sampler=_DEFAULTS.sampler)
VARIANTS = {name: {**DEFAULT, **change} for name, change in {
    "static_cuda_graphs": {},
    "static_torch_flash": dict(attention="flash"),  # torch's varlen flash op over the filled keys (before Triton)
    "static_sdpa": dict(attention="sdpa"),  # masked SDPA over the whole cache, compiled
    "static_flash_rows": dict(flash_grouped=False),  # one query row per cache row and query head
    "static_sampler_uncompiled": dict(compile_sampler=False),
    # torch's sampling (log-softmax, cumsum, searchsorted over (rows, V) fp32) instead of the fused Triton sampler
    "static_cuda_graphs_torch_sampler": dict(sampler="torch"),
    "static_uncompiled": dict(compile_layers=False),
    "static_before": dict(compile_layers=False, attention="sdpa"),
    # one graph over the whole cache width (before width buckets), SDPA
    "static_cuda_graphs_one_width": dict(compile_layers=False, attention="sdpa", width_bucket=10**9),
    # the masked SDPA path's backend forced (torch's own choice is cuDNN on an H100)
    **{f"static_cuda_graphs_{b.lower()}": dict(compile_layers=False, attention="sdpa", sdpa_backends=(b,))
       for b in ("EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION")}}.items()}


def configure(name: str) -> None:
    """Set the decode SETTINGS to engine ``name``'s (compile_layers goes to the engine when it is built)."""
    for key, value in VARIANTS.get(name, DEFAULT).items():
        if key != "compile_layers":
            setattr(SETTINGS, key, value)


def build_engines(names: list[str], model, tok, rows: int) -> dict:
    """The engines named (always static_cuda_graphs), in the order given."""
    chosen = [k for k in names if k in VARIANTS or k in ("hf_generate", "static_eager")]
    if "static_cuda_graphs" not in chosen:
        chosen.append("static_cuda_graphs")
    engines = {}
    for name in chosen:
        if name == "hf_generate":
            engines[name] = HFGenerateEngine(model, tok, batch_size=rows)
        elif name == "static_eager":
            engines[name] = StaticCacheEngine(model, tok, batch_size=rows, cuda_graphs=False)
        else:
            engines[name] = StaticCacheEngine(model, tok, batch_size=rows, cuda_graphs=True,
                                              compile_layers=VARIANTS[name]["compile_layers"])
    return engines


def time_engines(engines: dict, prompts: list[str], args, sync, report: dict) -> None:
    """A warm-up call each (the compiled pieces compile there), then ``args.reps`` timed calls each, engines
    interleaved and the order reversed every other rep (ABBA); figures into ``report``."""
    rows = len(prompts) * args.group
    times_of: dict[str, list[float]] = {k: [] for k in engines}
    lengths_of: dict[str, list[float]] = {k: [] for k in engines}
    for name, engine in engines.items():
        configure(name)
        sync()
        t = time.perf_counter()
        engine.generate(prompts[:8], SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0))
        sync()
        report["first_call_s"][name] = round(time.perf_counter() - t, 2)
    for rep in range(args.reps):
        for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
            configure(name)
            sync()
            t = time.perf_counter()
            batch = engines[name].generate(prompts, SamplingParams(n=args.group, temperature=1.0,
                                                                   max_new_tokens=args.new_tokens, seed=rep))
            sync()
            times_of[name].append(time.perf_counter() - t)
            lengths_of[name].append(float(batch.response_lengths().float().mean()))
            steps = batch.response_ids.shape[1]
    for name in engines:
        med = statistics.median(times_of[name])
        report["engines"][name] = {"seconds": [round(x, 3) for x in times_of[name]], "median_s": round(med, 3),
                                   "ms_per_decode_step": round(1000 * med / steps, 3),
                                   "generated_tokens_per_s": round(rows * statistics.median(lengths_of[name]) / med, 1),
                                   "mean_response_len": statistics.median(lengths_of[name])}
        print(json.dumps({name: report["engines"][name]}), flush=True)


def time_phases(engines: dict, prompts: list[str], args) -> dict:
    """Each static engine's generate split into its phases (StaticCacheEngine.phase_seconds), ``args.phases`` calls
    each at the timed shape; seconds a call by phase, and their sum beside the call's own wall time."""
    out = {}
    for name, engine in engines.items():
        if not isinstance(engine, StaticCacheEngine):
            continue
        configure(name)
        engine.phase_seconds, walls = {}, []
        for rep in range(args.phases):
            t = time.perf_counter()
            engine.generate(prompts, SamplingParams(n=args.group, temperature=1.0, max_new_tokens=args.new_tokens,
                                                    seed=100 + rep))
            walls.append(time.perf_counter() - t)
        phases = {k: round(v / args.phases, 4) for k, v in engine.phase_seconds.items()}
        engine.phase_seconds = None
        out[name] = {**phases, "sum_of_phases": round(sum(phases.values()), 4),
                     "wall_median": round(statistics.median(walls), 4)}
        print(json.dumps({"phases": {name: out[name]}}), flush=True)
    return out


def kernel_check(device, reps: int = 200) -> list[dict]:
    """The decode attention kernels alone at the 0.5B GRPO decode shape (512 rows, 2 KV heads of 7 query heads,
    head size 64, cache width 512, prompts of 12-39 tokens) at three fill levels: our Triton kernel and torch's
    flash op against an fp32 softmax of the same bf16 tensors (``decode_attention_reference``), and each one's
    device time a call (CUDA events over ``reps`` replays of a graph of one call, as the engine runs it: the first
    check, 2026-12-01, timed an eager loop of calls, each with its host launch, which a graph does not pay)."""
    from rlhf_core.models import decode_attention as da

    B, Hkv, G, D, W = 512, 2, 7, 64, 512
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B * G, Hkv, D, device=device, generator=g).bfloat16()
    k, v = (torch.randn(B * W, Hkv, D, device=device, generator=g).bfloat16() for _ in range(2))
    prompt = torch.randint(12, 40, (B,), device=device, generator=g)
    start = (W - 256 - prompt).clamp(min=0)  # left padding: a row's keys start at its first prompt token
    cu_k = torch.cat([torch.arange(B, device=device) * W + start, torch.tensor([B * W], device=device)]).int()
    cu_q = (torch.arange(B + 1, device=device) * G).int()
    rows = []
    for new in (1, 128, 256):
        used = (prompt + new).int()
        ref = da.decode_attention_reference(q, k, v, cu_k, used, W, 0.125).float()
        row = {"new_tokens": new, "mean_used_keys": round(float(used.float().mean()), 1)}
        for name, fn in (("triton", lambda: da.decode_attention(q, k, v, cu_k, used, 0.125)),
                         ("torch_flash", lambda: flash_layout_attention(q, k, v, cu_q, cu_k, W, used, 0.125))):
            try:
                out = fn()
                graph = torch.cuda.CUDAGraph()  # one call captured and replayed: no host launch in the timing
                with torch.cuda.graph(graph):
                    fn()
            except Exception as err:  # noqa: BLE001 - a kernel that does not build here is a result to report
                row[name] = {"error": repr(err)[:400]}
                continue
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record()
            for _ in range(reps):
                graph.replay()
            end_ev.record()
            torch.cuda.synchronize()
            row[name] = {"max_abs_err_vs_fp32": round(float((out.float() - ref).abs().max()), 6),
                         "mean_abs_err_vs_fp32": round(float((out.float() - ref).abs().mean()), 7),
                         "us_a_call_in_a_graph": round(1000 * start_ev.elapsed_time(end_ev) / reps, 2)}
        rows.append(row)
        print(json.dumps({"kernel_check": row}), flush=True)
    return rows


def check_numerics(engines: dict, model, prompts: list[str], device) -> dict:
    """Per engine: greedy tokens against HF generate's, and sampling log-probs against the trainer's
    recomputation (bf16; HF generate's own log-probs are the baseline the others are read against)."""
    from rlhf_core.trainers.rl_forward import token_logprobs

    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=64)
    configure("hf_generate")
    a = engines["hf_generate"].generate(prompts, greedy)
    checks = {}
    for name in engines:
        configure(name)
        b = engines[name].generate(prompts, greedy)
        width = min(a.response_ids.shape[1], b.response_ids.shape[1])
        same_rows = (a.response_ids[:, :width] == b.response_ids[:, :width]).all(-1).float().mean().item()
        first_diff = [(ra != rb).nonzero()[0].item() if (ra != rb).any() else width
                      for ra, rb in zip(a.response_ids[:, :width], b.response_ids[:, :width])]
        batch = engines[name].generate(prompts[:16], SamplingParams(n=4, temperature=1.0, max_new_tokens=128, seed=9))
        exp = {k: v.to(device) for k, v in batch.learner_inputs().items()}
        with torch.no_grad():
            lp, _ = token_logprobs(model, exp, batch.prompt_ids.shape[1], 1.0)
        m = batch.response_mask.bool()
        diff = (lp.float().cpu()[m] - batch.sampling_logprobs[m]).abs()
        checks[name] = {
            "greedy_rows_identical_to_hf_generate": same_rows,
            "greedy_first_divergence_median_token": statistics.median(first_diff), "greedy_tokens_compared": width,
            "sampling_logprob_vs_trainer_abs_diff_mean": round(diff.mean().item(), 5),
            "sampling_logprob_vs_trainer_abs_diff_max": round(diff.max().item(), 5)}
        print(json.dumps({name: checks[name]}), flush=True)
    return checks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", default="hf_generate,static_eager,static_cuda_graphs",
                    help="comma-separated; static_sdpa / static_uncompiled / static_before (neither) for the flash "
                         "decode attention and compiled layer halves A/B, static_cuda_graphs_one_width for the "
                         "width-bucket A/B, static_cuda_graphs_{efficient_attention,math,cudnn_attention} for the "
                         "masked decode attention's SDPA backend, static_cuda_graphs_torch_sampler for the sampler "
                         "A/B (torch's against the fused Triton kernel)")
    ap.add_argument("--small", action="store_true", help="micro model (a CPU smoke test)")
    ap.add_argument("--phases", type=int, default=0, metavar="N",
                    help="after the timed reps, N more calls of each static engine with its phases timed (each phase "
                         "waits for the device at its ends): seconds a call by phase")
    ap.add_argument("--kernel-check", action="store_true",
                    help="first, the decode attention kernels alone (Triton against torch's flash): error and time")
    ap.add_argument("--out", default="bench/out/gpu_engine.json")
    args = ap.parse_args()

    from gpu_grpo import build_model, build_tokenizer
    from side_by_side_parts.settings import SMALL_SHAPE as SMALL

    from rlhf_core.models.loading import load_causal_lm, load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="gpu-engine-"))
    model_dir = build_model(build_tokenizer(32000, work / "tok"), work / "model", **(SMALL if args.small else {}))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_causal_lm(model_dir, device).to(dtype).eval()
    tok = load_tokenizer(model_dir, padding_side="left")
    prompts = [f"Question {i}: compute {i}*{i + 3} and explain" for i in range(args.prompts)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    engines = build_engines(args.engines.split(","), model, tok, args.prompts * args.group)
    report: dict = {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "rows": args.prompts * args.group, "new_tokens": args.new_tokens,
                    "engines": {}, "first_call_s": {}}
    if args.kernel_check and device.type == "cuda":
        report["kernel_check"] = kernel_check(device)
    time_engines(engines, prompts, args, sync, report)
    if args.phases:
        report["phases_s_a_call"] = time_phases(engines, prompts, args)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    report["row_kernel_by_engine"], report["sampler_by_engine"] = {}, {}
    for name, engine in engines.items():
        if isinstance(engine, StaticCacheEngine):
            configure(name)
            report["row_kernel_by_engine"][name] = (choose_row_kernel(device, head_dim, engine.triton_attention)
                                                    if use_flash(device, dtype, head_dim) else "sdpa")
            report["sampler_by_engine"][name] = choose_sampler(device, engine.triton_sampler)
    configure("static_cuda_graphs")
    report["compiled_layers"] = engines["static_cuda_graphs"].compile_layers and device.type == "cuda"
    report["flash_decode_attention"] = use_flash(device, dtype, model.config.hidden_size
                                                 // model.config.num_attention_heads)
    if "static_cuda_graphs_one_width" in engines:
        one, buckets = (report["engines"][k]["median_s"] for k in ("static_cuda_graphs_one_width", "static_cuda_graphs"))
        report["speedup_width_buckets_over_one_width"] = round(one / buckets, 3)
    if "static_cuda_graphs_torch_sampler" in engines:
        torch_s, ours = (report["engines"][k]["median_s"] for k in ("static_cuda_graphs_torch_sampler",
                                                                    "static_cuda_graphs"))
        report["speedup_default_sampler_over_torch_sampler"] = round(torch_s / ours, 3)
    if "hf_generate" in engines:
        report["checks_by_engine"] = check_numerics(engines, model, prompts, device)
        configure("static_cuda_graphs")
        report["checks"] = report["checks_by_engine"]["static_cuda_graphs"]
        hf, graphs = (report["engines"][k]["median_s"] for k in ("hf_generate", "static_cuda_graphs"))
        report["speedup_static_graphs_over_hf_generate"] = round(hf / graphs, 2)
        print(json.dumps({"speedup_static_graphs_over_hf_generate": report["speedup_static_graphs_over_hf_generate"]}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
