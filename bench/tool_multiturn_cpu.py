"""Multi-turn rollout cost on CPU: our static-cache engine and HF generate, single-turn vs with the calculator.

Each multi-turn turn is one ``generate_ids`` call from the trajectory's ids (rlhf_core/rollout/environments.py):
our engine prefills the whole trajectory afresh each turn and decodes eagerly on CPU (no CUDA graph
here in any case; on a GPU the graphs still serve the decode steps within a turn, and the observation is
written by the next turn's prefill). Prints tokens per second of each.

Run: ``PYTHONPATH=. python bench/tool_multiturn_cpu.py models/tool_sft data/tool/prompts.jsonl``
"""

from __future__ import annotations

import json
import sys
import time

import torch

from rlhf_core.rollout.environments import rollout_with_environment
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
from rlhf_core.rollout.static import StaticCacheEngine
from rlhf_core.rollout.tool_task import make_env


def main(model_dir: str, prompts_file: str, rows: int = 32, n: int = 8, repeats: int = 3) -> None:
    torch.set_num_threads(1)
    model, tok = load_causal_lm(model_dir), load_tokenizer(model_dir)
    with open(prompts_file) as fh:
        records = [json.loads(line) for line in fh][:rows]
    prompts, labels = [r["prompt"] for r in records], [r["label"] for r in records]
    for name, engine in (("static", StaticCacheEngine(model, tok, batch_size=256)),
                         ("hf", HFGenerateEngine(model, tok, batch_size=256))):
        for mode in ("single-turn", "multi-turn"):
            times, tokens = [], 0
            for r in range(repeats):
                params = SamplingParams(n=n, temperature=1.0, max_new_tokens=16, seed=r)
                start = time.perf_counter()
                if mode == "single-turn":
                    batch = engine.generate(prompts, params)
                else:
                    batch, _ = rollout_with_environment(engine, tok, prompts, labels, params, make_env, max_turns=2,
                                                        max_trajectory_tokens=32)
                times.append(time.perf_counter() - start)
                tokens = int(batch.loss_mask().sum())
            best = min(times)
            calls = float(batch.tool_calls.float().mean()) if batch.tool_calls is not None else 0.0
            print(json.dumps({"engine": name, "mode": mode, "rows": rows * n, "best_s": round(best, 3),
                              "sampled_tokens": tokens, "tokens_per_s": round(tokens / best, 1),
                              "tool_calls_mean": round(calls, 2)}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
