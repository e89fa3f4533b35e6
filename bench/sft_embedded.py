"""Benchmark: SFT on the embedded default with the shipped params, on this machine's CPU.

Target (foundation issue): >= 40% and < 90% greedy exact match on >= 500 held-out items
after at most 3 minutes of training on 2 cores. Writes ``bench/out/sft_embedded.json`` and
prints a Markdown row for BENCHMARKS.md.

Run: ``.venv/bin/python bench/sft_embedded.py`` (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rlhf_core  # noqa: E402,F401
from rlhf_core.stages import wrappers as stages  # noqa: E402
from rlhf_core.config import EvalConfig, GenerateConfig, ModelConfig, SFTConfig, TrackingConfig, load_config  # noqa: E402


def main() -> None:
    params = REPO / "params.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["ALIGNFLOW_HOME"] = tmp
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
        gen = replace(load_config(GenerateConfig, "generate", params), out_dir=str(root / "data"))
        data = stages.generate(gen).outputs
        model = replace(load_config(ModelConfig, "model", params), out_dir=str(root / "base"),
                        corpus_file=data["sft"])
        base = stages.init_model(model)
        sft_cfg = replace(load_config(SFTConfig, "sft", params), model_path=str(root / "base"),
                          train_file=data["sft"], eval_file=data["eval"], output_dir=str(root / "sft"),
                          checkpoint_dir=str(root / "ckpt"))
        tracking = replace(load_config(TrackingConfig, "tracking", params), log_model=False)
        started = time.perf_counter()
        sft = stages.sft(sft_cfg, tracking, show_progress=False)
        wall = time.perf_counter() - started
        ev = stages.evaluate(replace(load_config(EvalConfig, "evaluate", params), model_path=str(root / "sft"),
                                     eval_file=data["eval"], output_file=str(root / "eval.json")), tracking)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "n_parameters": int(base.metrics["model/n_parameters"]),
        "max_steps": sft_cfg.max_steps,
        "batch_size": sft_cfg.batch_size,
        "train_seconds": round(sft.metrics["perf/train_seconds"], 1),
        "stage_wall_seconds": round(wall, 1),
        "tokens_per_s": round(sft.metrics["perf/tokens_per_s"]),
        "eval_items": int(ev.metrics["eval/n_items"]),
        "accuracy": round(ev.metrics["eval/accuracy"], 4),
        "accuracy_stderr": round(ev.metrics["eval/accuracy_stderr"], 4),
        "accuracy_sort": round(ev.metrics.get("eval/accuracy_sort", float("nan")), 4),
        "accuracy_arithmetic": round(ev.metrics.get("eval/accuracy_arithmetic", float("nan")), 4),
    }
    out = REPO / "bench" / "out" / "sft_embedded.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"| SFT, embedded default | {result['machine']} | {result['train_seconds']} s train "
          f"({result['max_steps']} steps x {result['batch_size']}) | {result['tokens_per_s']} tok/s | "
          f"{result['accuracy']:.3f} ± {result['accuracy_stderr']:.3f} on {result['eval_items']} "
          f"(sort {result['accuracy_sort']:.3f}, arithmetic {result['accuracy_arithmetic']:.3f}) |")


if __name__ == "__main__":
    main()
