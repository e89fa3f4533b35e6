"""GPU benchmark: alignflow's GRPO trainer (``train_rl``) on a Qwen2-0.5B-shaped model with random weights,
64 prompts x 8 samples x 256 new tokens, bf16 autocast; in one process or through the Ray launcher on
N GPUs (the data-parallel scaling figure of BENCHMARKS.md). ``bench/side_by_side.py`` runs the same
configuration against TRL; this script varies placement, workers, engine and parallelism.

Runs on the lent GPUs with torch + transformers only (no MLflow, Prefect or Ray needed; `--parity` with `--engine hf` or
`--engine static`: parity mode, whose mismatch must read exactly 0 at every step)::

    PYTHONPATH=. python bench/gpu_grpo.py --out $OUT/gpu_grpo.json

and through the Ray launcher (carried Ray + DeepSpeed from ``../shared/device/pack.sh``), the
controller here and the models in actors, N policy ranks on N GPUs::

    PYTHONPATH=/tmp/site:. python bench/gpu_grpo.py --placement colocated --workers 2 --parallel zero2 \
        --out $OUT/gpu_grpo_2gpu_zero2.json

Asynchronous training on two GPUs (issue 19 item 3: async step <= 0.8 x sync step): ``--placement
disaggregated --workers 1 --rollout-workers 1`` with ``--max-staleness 0`` (synchronous) and ``1`` (one GPU learns
with the reference beside it, the other generates; ``rlhf_core/trainers/ray_launcher.py``), the same two GPUs in both;
read ``perf/overlap_s``, ``perf/rollout_wait_s`` and the per-step ``perf/*_ts`` timestamps in the steps.

Weight sync by NCCL broadcast (issue 19 item 5: seconds per sync <= 0.1 s for the 0.5B model, and
``rollout/logprob_mismatch`` unchanged): one policy rank on one GPU, one rollout replica on the other, weights
from rank 0 to the replica through a group of their own (``rl.distribution.weight_sync``,
``rlhf_core/distributed/weight_sync.py``). On 2
GPUs, the collective and the object store in one call (same machine, same seed), reading ``phase_s`` ->
``perf/weight_sync_s`` and ``logprob_mismatch`` of the two summaries::

    for sync in collective object_store; do
      PYTHONPATH=/tmp/site:. python bench/gpu_grpo.py --placement disaggregated --workers 1 --rollout-workers 1 \
          --max-staleness 1 --engine static --weight-sync $sync --steps 6 \
          --out $OUT/gpu_grpo_2gpu_sync_$sync.json
    done

Asynchronous (``--max-staleness 1``), it syncs at every launch from the third batch on, while the learner is idle
and before generation starts, so ``weight_sync_s_each`` lists one sync per step for steps 2..N-1 (the group and
NCCL's communicator are set up before step 1, so the first is not a warm-up). ``perf/weight_sync_s`` is the
controller's wall time of one sync (Ray calls, bucket gathers, broadcast, in-place loads, a device sync at the
end on each side). ``logprob_mismatch`` includes the one-update staleness in both runs alike. If the collective is slower
than expected, rerun it with ``NCCL_DEBUG=INFO``: the transport line of the weight-sync communicator should say
``P2P`` (GPU to GPU), not ``SHM`` (through host memory; each actor sees only its own GPU).

Peak memory is the largest ``memory.used`` nvidia-smi saw on any GPU (every process on it), sampled
every 200 ms.

Prints one JSON line per step and a summary line (median step time of steps 2..N, generated
tokens/s, peak GPU memory).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import rlhf_core  # noqa: E402,F401  (offline switches)
from result_paths import result_path  # noqa: E402  (bench/ is sys.path[0])


def build_tokenizer(vocab: int, out: Path) -> Path:
    """A byte-level BPE of ``vocab`` tokens trained on the standard library's source (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.dirname(os.__file__) + "/*.py"))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(out))
    return out


def build_model(tokenizer_dir: Path, out: Path, **dims: int) -> Path:
    """Qwen2-0.5B dimensions (896 hidden, 24 layers, 14 heads, 2 KV heads, 4864 MLP), random weights;
    ``dims`` overrides them (a smoke test's micro model)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2)
    shape.update(dims)
    cfg = Qwen2Config(vocab_size=len(tok), **shape, tie_word_embeddings=True,
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


class Sink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))
        if "perf/step_s" in metrics:
            print(json.dumps({"step": step, **{k: round(v, 4) for k, v in metrics.items()
                                               if k.startswith(("perf/", "rollout/response_length", "rollout/logprob_mismatch"))}}),
                  flush=True)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="", help="default: bench/results/<device>/<UTC date>/gpu_grpo.json")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mini", type=int, default=64, help="rows per optimizer step (512: one update per batch)")
    ap.add_argument("--micro", type=int, default=0, help="rows per forward/backward within a mini-batch (0: all)")
    ap.add_argument("--engine", choices=["hf", "static"], default="hf", help="rollout engine")
    ap.add_argument("--kl", type=float, default=0.0, help="KL coefficient beta (> 0: reference log-probs computed)")
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument("--placement", choices=["none", "colocated", "disaggregated"], default="none")
    ap.add_argument("--workers", type=int, default=1, help="policy data-parallel ranks (Ray actors, a GPU each)")
    ap.add_argument("--rollout-workers", type=int, default=0, help="rollout replicas (default: one per worker)")
    ap.add_argument("--parallel", choices=["ddp", "zero2", "zero3"], default="ddp")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in the policy update")
    ap.add_argument("--max-staleness", type=int, default=0,
                    help="asynchronous training: 1 generates the next batch during the update (with "
                         "--placement disaggregated --workers 1: one GPU learns, the other generates)")
    ap.add_argument("--weight-sync", choices=["auto", "object_store", "collective"], default="auto",
                    help="rl.distribution.weight_sync: how rollout replicas get the weights (collective: NCCL broadcast from rank 0)")
    ap.add_argument("--small", action="store_true", help="a micro model and short rows (CPU smoke test)")
    ap.add_argument("--parity", action="store_true", help="rl.rollout.parity (--engine hf or static): the engine's "
                    "log-probs equal the trainer's bit for bit; rollout/logprob_mismatch then reads 0")
    ap.add_argument("--sampling", choices=["copy", "master"], default="copy",
                    help="copy: the HF engine samples with a bf16 copy of the policy (default); master: with the "
                         "fp32 master weights (the engine before that change, for an A/B on one machine)")
    return ap.parse_args()


def _inputs(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path]:
    """The random model (the 0.5B shape, or a micro one with --small), a prompts file and a length reward."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1) if args.small else {}
    model_dir = build_model(build_tokenizer(32000, work / "tok"), work / "model", **small)
    prompts = work / "prompts.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "kernel", "tensor", "matrix", "vector", "policy", "reward"]
    with prompts.open("w") as fh:
        for i in range(max(args.prompts * args.steps, 256)):
            fh.write(json.dumps({"prompt": f"Question {i}: explain {words[i % 10]} and {words[(i * 7) % 10]}.",
                                 "label": "x"}) + "\n")
    reward = work / "reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 100 for c in completions]\n")
    return model_dir, prompts, reward


def _peak_by_gpu(smi: subprocess.Popen) -> dict[str, float]:
    """The largest memory.used (GB) nvidia-smi sampled on each GPU while the run went."""
    smi.terminate()
    used = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    peak: dict[str, float] = {}
    for idx, mib in used:
        peak[idx.strip()] = max(peak.get(idx.strip(), 0.0), float(mib) / 1024)
    return peak


def main() -> None:
    args = _args()
    from rlhf_core.config import RLConfig, build_config
    from rlhf_core.trainers import rl_parts
    from rlhf_core.trainers.rl import train_rl

    if args.sampling == "master":
        from rlhf_core.rollout.engine import HFGenerateEngine

        rl_parts.build_rollout_engine = lambda cfg, policy, tok, dtype=None: HFGenerateEngine(policy, tok, cfg.batch_size)

    work = Path(tempfile.mkdtemp(prefix="gpu-grpo-"))
    model_dir, prompts, reward = _inputs(args, work)
    cfg = build_config(RLConfig, "rl", {"model_path": str(model_dir), "prompts_file": str(prompts),
                                        "eval_file": str(prompts), "output_dir": str(work / "out"),
                                        "checkpoint_dir": str(work / "ckpt"), "reward.function": f"{reward}:reward",
                                        "algorithm.estimator": "grpo", "max_steps": args.steps,
                                        "rollout.prompts_per_step": args.prompts, "rollout.group_size": args.group,
                                        "rollout.max_new_tokens": args.new_tokens, "max_length": args.new_tokens + 64,
                                        "batch_size": args.gen_batch, "algorithm.mini_batch_size": args.mini,
                                        "micro_batch_size": args.micro, "rollout.engine": args.engine,
                                        "algorithm.ppo_epochs": 1, "kl.coef": args.kl, "lr": 1e-6, "warmup_steps": 0,
                                        "eval_items": 1, "eval_at_start": False, "save_every": 0,
                                        "log_rollouts_every": 0, "precision": "auto",
                                        "distribution.placement": args.placement, "num_workers": args.workers,
                                        "distribution.rollout_workers": args.rollout_workers or args.workers,
                                        "parallel": args.parallel, "gradient_checkpointing": args.grad_ckpt,
                                        "off_policy.max_staleness": args.max_staleness,
                                        "distribution.weight_sync": args.weight_sync, "rollout.parity": args.parity})
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sink = Sink()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                            "-lms", "200"] if cuda else ["sleep", "0"], stdout=subprocess.PIPE, text=True)
    started = time.perf_counter()
    if args.placement == "none":
        train_rl(cfg, sink, show_progress=False)
    else:
        from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

        train_rl_on_ray(cfg, sink, show_progress=False)
    total = time.perf_counter() - started
    peak_by_gpu = _peak_by_gpu(smi)
    steps = [m for _, m in sink.rows if "perf/step_s" in m]
    timed = steps[1:] if len(steps) > 1 else steps
    step_s = statistics.median(m["perf/step_s"] for m in timed)
    gen_tokens = statistics.median(m["rollout/response_length"] for m in timed) * args.prompts * args.group
    summary = {
        "what": "alignflow GRPO (train_rl), Qwen2-0.5B-shaped random weights, 32k vocab",
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "placement": args.placement, "workers": args.workers, "parallel": args.parallel,
        "rollout_workers": cfg.distribution.rollout_workers, "gradient_checkpointing": args.grad_ckpt,
        "gpus_seen": torch.cuda.device_count(), "peak_memory_used_gb_by_gpu": {k: round(v, 2) for k, v in peak_by_gpu.items()},
        "sampling": args.sampling, "engine": args.engine, "parity": args.parity, "kl_coef": args.kl, "micro_batch": args.micro,
        "logprob_mismatch": round(statistics.median(m["rollout/logprob_mismatch"] for m in timed), 5),
        "logprob_mismatch_max_all_steps": max(m["rollout/logprob_mismatch"] for m in steps),
        "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens, "mini_batch": args.mini,
        "median_step_s": round(step_s, 3), "samples_per_s": round(args.prompts * args.group / step_s, 1),
        "generated_tokens_per_s": round(gen_tokens / step_s, 1),
        "max_staleness": args.max_staleness, "weight_sync": args.weight_sync,
        "weight_sync_s_each": [round(m["perf/weight_sync_s"], 4) for m in steps if "perf/weight_sync_s" in m],
        # medians over the timed steps that logged each (asynchronous runs sync weights only at some launches)
        "phase_s": {k: round(statistics.median(m[k] for m in timed if k in m), 3)
                    for k in ("perf/rollout_s", "perf/reward_s", "perf/logprob_s", "perf/update_s",
                              "perf/weight_sync_s", "perf/rollout_wait_s", "perf/overlap_s")
                    if any(k in m for m in timed)},
        "peak_gpu_memory_gb_this_process": round(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, 2), "total_s": round(total, 1),
    }
    print(json.dumps(summary), flush=True)
    out = Path(args.out) if args.out else result_path("gpu_grpo.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "steps": [m for _, m in sink.rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
