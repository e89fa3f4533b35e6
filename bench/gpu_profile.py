"""Where a GRPO step's rollout GPU time goes, on the GRPO benchmark's model (Qwen2-0.5B-shaped, 32k vocab) and
shapes (512 rows: 64 prompts x 8 samples, prompt ~20 + 256 new tokens), as the static engine runs it on a GPU
(flash-decoding attention over each row's filled keys, compiled layer halves, one CUDA graph replay a token):

* the captured decode iteration (decode + sample + record): every step's device time by CUDA events over a whole
  decode, then torch.profiler over the same replays of a fresh decoder: kernel time a step by category
  (``side_by_side_parts.profiling.CATEGORIES``), the top kernels, and the device's idle time between kernels;
* the engine's whole ``generate`` call as the trainer makes it: wall time (median and range of ``--reps``), its
  phases (``StaticCacheEngine.phase_seconds``: each phase waits for the device at its ends) and torch.profiler over
  one call: kernel time by category and where the device sat idle (what the host ran in the largest gaps);
* ``--before``: the decode iteration as it was before flash decode attention and compiled halves (masked SDPA over
  the whole cache, plain layer halves), its keys prefixed ``before_``;
* without ``--decode-only``: one update micro-batch (forward + backward, gradient checkpointing, bf16 autocast) and
  one no-grad log-prob forward on padded rows (the RL update as the trainer runs it, packed and without
  checkpointing: ``side_by_side.py --profile --profile-phase update``).

Prints the figures and writes them to ``--out``. Run on a lent GPU::

    PYTHONPATH=. python bench/gpu_profile.py --decode-only --out $OUT/gpu_profile.json
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

import rlhf_core  # noqa: E402,F401
from side_by_side_parts.profiling import profile_summary  # noqa: E402


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
GROUP = 8  # samples a prompt


def _decoder(model, args, compiled: bool):
    """A fresh decoder at the benchmark's shape, prefilled and captured (no row ends: eos -1), with the seconds
    its capture took."""
    from rlhf_core.rollout.decode.decoder import Decoder
    from rlhf_core.rollout.decode.sampling import Sampler
    from rlhf_core.rollout.engine import SamplingParams

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(5, 30000, (args.rows // GROUP, P), device=dev, generator=gen)
    params = SamplingParams(n=GROUP, temperature=1.0, max_new_tokens=args.new_tokens)
    dec = Decoder(model, ids, torch.ones_like(ids), args.new_tokens, GROUP, compiled=compiled)
    if dec.row_kernel == "triton":  # built eagerly before a graph captures it, as the engine does
        dec.run_row_kernel()
    dec.prefill()
    state = Sampler(params, args.rows, args.new_tokens, eos=-1, pad=0, device=dev)
    state.uniforms.uniform_(generator=gen)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dec.capture(state)
    torch.cuda.synchronize()
    return dec, state, round(time.perf_counter() - t, 3)


def profile_iteration(model, args, report: dict, prefix: str = "", compiled: bool = True) -> None:
    """The captured decode iteration over a whole decode (``new_tokens - 1`` replays, as the engine replays after
    sampling the prefill's token): each step's device time by CUDA events; then, on a fresh decoder, the same
    replays under torch.profiler (kernel time a step by category, top kernels, idle time between kernels).
    The events' step minus the profiled kernel time is the device's idle time inside a replay."""
    steps = args.new_tokens - 1
    with torch.no_grad():
        dec, _, report[prefix + "capture_s"] = _decoder(model, args, compiled)
        report[prefix + "graphs"] = len(dec.graphs)
        report[prefix + "row_kernel"] = dec.row_kernel
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            dec.replay()
            events[i + 1].record()
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        dec.release()
        q = steps // 4
        report[prefix + "iteration_ms_events"] = {
            "mean": round(statistics.mean(ms), 4), "median": round(statistics.median(ms), 4),
            "min": round(min(ms), 4), "max": round(max(ms), 4),
            "mean_by_quarter": [round(statistics.mean(ms[i * q:(i + 1) * q]), 4) for i in range(4)],
            "decode_s": round(sum(ms) / 1e3, 4), "steps": steps}
        dec, _, _ = _decoder(model, args, compiled)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec.replay()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        dec.release()
    summary = profile_summary(prof, [wall / steps] * steps, steps)
    summary.pop("top_host_ops", None)  # a replay is one host call
    report[prefix + "iteration_profile"] = summary
    busy_ms = 1e3 * summary["device_busy_s_per_step"]
    report[prefix + "iteration_idle_ms_events_minus_kernels"] = round(report[prefix + "iteration_ms_events"]["mean"]
                                                                      - busy_ms, 4)
    _show(prefix + "iteration", {k: v for k, v in report.items() if k.startswith(prefix + "iteration")})


def profile_rollout(model_dir: Path, model, args, report: dict) -> None:
    """The engine's generate call at the benchmark's shape: a first call (compiles), ``--reps`` timed calls,
    two calls with their phases timed, one call under torch.profiler."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rollout.engine import SamplingParams
    from rlhf_core.rollout.static import StaticCacheEngine

    tok = load_tokenizer(model_dir, padding_side="left")
    engine = StaticCacheEngine(model, tok, batch_size=args.rows)
    prompts = [f"Question {i}: compute {i}*{i + 3} and explain the steps" for i in range(args.rows // GROUP)]

    def call(seed: int):
        torch.cuda.synchronize()
        t = time.perf_counter()
        batch = engine.generate(prompts, SamplingParams(n=GROUP, temperature=1.0, max_new_tokens=args.new_tokens,
                                                        seed=seed))
        torch.cuda.synchronize()
        return batch, time.perf_counter() - t

    _, first = call(0)
    walls, lengths = [], []
    for rep in range(args.reps):
        batch, wall = call(1 + rep)
        walls.append(wall)
        lengths.append(float(batch.response_lengths().float().mean()))
    med = statistics.median(walls)
    out = {"first_call_s": round(first, 2), "wall_s": [round(w, 4) for w in walls], "median_s": round(med, 4),
           "min_s": round(min(walls), 4), "max_s": round(max(walls), 4),
           "mean_prompt_tokens": round(statistics.mean(len(tok(p)["input_ids"]) for p in prompts), 1),
           "mean_response_len": round(statistics.median(lengths), 2), "decode_steps": batch.response_ids.shape[1],
           "generated_tokens_per_s": round(args.rows * statistics.median(lengths) / med, 1)}
    engine.phase_seconds = {}
    for rep in range(2):
        call(100 + rep)
    out["phases_s_a_call"] = {k: round(v / 2, 4) for k, v in engine.phase_seconds.items()}
    engine.phase_seconds = None
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, SamplingParams(n=GROUP, temperature=1.0, max_new_tokens=args.new_tokens, seed=200))
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    out["call_profile"] = profile_summary(prof, [wall], 1)
    # a capture that failed under the profiler would have left the engine decoding eagerly
    out["engine_after"] = {"cuda_graphs": engine.cuda_graphs, "compile_layers": engine.compile_layers,
                           "triton_attention": engine.triton_attention}
    report["rollout"] = out
    _show("rollout", out)


def profile_decode(model_dir: Path, args, report: dict) -> None:
    """The decode iteration (and ``--before``'s), then the whole rollout call."""
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rollout.decode.settings import SETTINGS

    model = load_causal_lm(model_dir, torch.device("cuda")).to(torch.bfloat16).eval()
    if args.before:
        SETTINGS.attention = "sdpa"
        try:
            profile_iteration(model, args, report, "before_", compiled=False)
        finally:
            SETTINGS.attention = "auto"
    for part in (lambda: profile_iteration(model, args, report), lambda: profile_rollout(model_dir, model, args, report)):
        try:
            part()
        except Exception as err:  # noqa: BLE001 -- one part that fails must not cost the others' figures
            report.setdefault("errors", []).append(f"{type(err).__name__}: {err}"[:600])
            print("part failed:", report["errors"][-1], flush=True)
        _write(report, args.out)
    del model
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
    ap.add_argument("--reps", type=int, default=3, help="timed generate calls")
    ap.add_argument("--out", default="bench/out/gpu_profile.json")
    ap.add_argument("--decode-only", action="store_true", help="the rollout only (no update micro-batch)")
    ap.add_argument("--before", action="store_true", help="also the decode iteration before flash attention and "
                                                          "compiled halves")
    args = ap.parse_args()
    from gpu_grpo import build_model, build_tokenizer

    work = Path(tempfile.mkdtemp())
    model_dir = build_model(build_tokenizer(32000, work / "tok"), work / "model")
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": args.rows,
                    "prompt_tokens_iteration": P, "new_tokens": args.new_tokens}
    profile_decode(model_dir, args, report)
    if not args.decode_only:
        profile_update(model_dir, args, report)
        _show("update", {k: v for k, v in report.items() if k.startswith(("update", "forward"))})
    _write(report, args.out)


def _write(report: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")


def _show(title: str, part: dict) -> None:
    print(json.dumps({title: part}), flush=True)


if __name__ == "__main__":
    main()
