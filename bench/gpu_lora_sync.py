"""What a LoRA policy's weight sync to a rollout engine with weights of its own costs on one GPU: adapter-only against
merged (``rl.rollout.lora_sync``), for the HF and static engines, at the Qwen2-1.5B shape (random weights, 32k vocab,
bf16 base) with rank-16 adapters on every linear layer but the LM head.

The Ray replica path in one process: the learner's side of a sync is ``PolicyLearner.engine_weights``
(``rlhf_core/trainers/rl_roles.py``): the adapter tensors alone (``adapters_only``), or the merged weights
(``export_state_dict``) in the engine's dtype, copied to host memory; the replica's side is ``update_weights``
(``copy_adapters`` into its own injected adapters, or ``load_state_dict`` into its plain model;
``rlhf_core/trainers/rollout_replica.py``). What the object store adds between the two is not here. Each engine holds
a copy of its own: the adapter path's replica the frozen base with adapters injected as the learner's, the merged
path's a plain model.

Per engine and path: bytes a sync moves and sync seconds (median and range of ``--syncs`` syncs after one warm-up,
the adapters nudged before each as an update would), and the engine's sampling log-probs against the merged trainer
weights' recomputation (mean and max |diff|).

    PYTHONPATH=/tmp/site:. python bench/gpu_lora_sync.py --out $OUT/gpu_lora_sync_1p5b.json
    PYTHONPATH=. python bench/gpu_lora_sync.py --small --out bench/out/gpu_lora_sync_small.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
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
from rlhf_core.models.loading import adapter_parameters, export_state_dict, prepare_for_training  # noqa: E402
from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams  # noqa: E402
from rlhf_core.rollout.static import StaticCacheEngine  # noqa: E402

SHAPE_1P5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
ENGINES = {"hf": HFGenerateEngine, "static": StaticCacheEngine}


def base_model(tok, shape: dict, device: torch.device):
    """A Qwen2 model of ``shape``, random weights (seed 0), bf16 on ``device``, built in place (no files)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tok), **shape, tie_word_embeddings=True, max_position_embeddings=4096,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def learner_weights(policy, adapters_only: bool) -> dict[str, torch.Tensor]:
    """``PolicyLearner.engine_weights`` on one rank: the adapters in their own dtype, or the merged weights in bf16,
    on the host."""
    if adapters_only:
        return {k: v.detach().cpu() for k, v in adapter_parameters(policy).items()}
    return {k: v.detach().to(torch.bfloat16).cpu() for k, v in export_state_dict(policy).items()}


def nudge(policy, step: int) -> None:
    """An update's worth of change to every adapter (B starts at zero in LoRA: without this the adapters add nothing)."""
    g = torch.Generator(device="cpu").manual_seed(step)
    with torch.no_grad():
        for name, p in adapter_parameters(policy).items():
            scale = 0.02 if "lora_B" in name else 0.002
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))


def gap(engine, reference, prompts: list[str], device, new_tokens: int) -> dict:
    """The engine's sampling log-probs against ``reference``'s recomputation (the merged trainer weights)."""
    from rlhf_core.trainers.rl_forward import token_logprobs

    batch = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=new_tokens, seed=7))
    exp = {k: v.to(device) for k, v in batch.learner_inputs().items()}
    with torch.no_grad():
        trainer = token_logprobs(reference, exp, batch.prompt_ids.shape[1], 1.0)[0].float().cpu()
    diff = (batch.sampling_logprobs - trainer).abs()[batch.response_mask.bool()]
    return {"mean_abs": float(diff.mean()), "max_abs": float(diff.max()), "tokens": int(diff.numel())}


def run_path(policy, base, tok, engine_name: str, adapters_only: bool, args, device, sync) -> dict:
    """One engine on one path: its replica, ``args.syncs`` timed syncs after a warm-up, then the log-prob check."""
    replica = copy.deepcopy(base)
    if adapters_only:
        prepare_for_training(replica, lora_rank=args.rank, lora_alpha=2.0 * args.rank)
        replica.eval().requires_grad_(False)
    engine = ENGINES[engine_name](replica, tok, batch_size=256)
    seconds, moved = [], 0
    for step in range(args.syncs + 1):
        nudge(policy, 100 * len(seconds) + step)
        sync()
        start = time.perf_counter()
        moved = engine.update_weights(learner_weights(policy, adapters_only))
        sync()
        if step:  # the first is a warm-up
            seconds.append(time.perf_counter() - start)
    reference = copy.deepcopy(base)
    reference.load_state_dict(learner_weights(policy, adapters_only=False))  # the merged trainer weights
    prompts = [f"Question {i}: explain the tensor and the policy" for i in range(args.check_prompts)]
    row = {"bytes_per_sync": int(moved), "sync_s": [round(s, 4) for s in seconds],
           "sync_s_median": round(statistics.median(seconds), 4), "sync_s_range": [round(min(seconds), 4),
                                                                              round(max(seconds), 4)],
           "logprobs_vs_merged_trainer": gap(engine, reference, prompts, device, args.new_tokens)}
    del engine, replica, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--check-prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--engines", default="hf,static")
    ap.add_argument("--small", action="store_true", help="micro model (a CPU smoke test)")
    ap.add_argument("--out", default="", help="default: bench/results/<device>/<UTC date>/gpu_lora_sync_1p5b.json")
    args = ap.parse_args()

    from gpu_grpo import build_tokenizer

    from rlhf_core.models.loading import load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(build_tokenizer(32000, Path(tempfile.mkdtemp(prefix="lora-sync-")) / "tok"),
                         padding_side="left")
    base = base_model(tok, SMALL if args.small else SHAPE_1P5B, device)
    policy = prepare_for_training(copy.deepcopy(base), lora_rank=args.rank, lora_alpha=2.0 * args.rank)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    report: dict = {"what": "LoRA weight sync, adapter-only vs merged, in one process (engine_weights then the "
                            "engine's update_weights)",
                    "model": "Qwen2-1.5B shape (1536 hidden, 28 layers, 12 heads, 2 KV heads, MLP 8960), random "
                             "weights, 32k vocab, bf16 base" if not args.small else "micro model",
                    "parameters": sum(p.numel() for p in base.parameters()), "lora_rank": args.rank,
                    "lora_alpha": 2.0 * args.rank, "gpu": torch.cuda.get_device_name(0) if device.type == "cuda"
                    else "cpu", "torch": torch.__version__, "syncs_timed": args.syncs, "engines": {}}
    for name in args.engines.split(","):
        report["engines"][name] = {}
        for path in ("adapters", "merged"):
            row = run_path(policy, base, tok, name, path == "adapters", args, device, sync)
            report["engines"][name][path] = row
            print(json.dumps({name: {path: row}}), flush=True)
    out = Path(args.out) if args.out else result_path("gpu_lora_sync_1p5b.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
