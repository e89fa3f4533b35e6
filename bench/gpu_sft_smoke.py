"""GPU smoke run: the same SFT stage code on a lent GPU machine with torch + transformers only.

No MLflow, Prefect, DVC or GX there: tracking falls back to local JSON files under runs/,
which is what this checks, along with bf16 autocast on a bf16-capable GPU. Writes
``$OUT/gpu_sft_smoke.json`` (or ``bench/out/`` locally).

Run on the device machine: ``PYTHONPATH=. python bench/gpu_sft_smoke.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402

import rlhf_core  # noqa: E402,F401
from rlhf_core.stages import wrappers as stages  # noqa: E402
from rlhf_core.config import EvalConfig, GenerateConfig, ModelConfig, SFTConfig, TrackingConfig, load_config  # noqa: E402


def main() -> None:
    params = REPO / "params.yaml"
    out_dir = Path(os.environ.get("OUT", REPO / "bench" / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["ALIGNFLOW_HOME"] = tmp
        data = stages.generate(replace(load_config(GenerateConfig, "generate", params), out_dir=str(root / "data"))).outputs
        stages.init_model(replace(load_config(ModelConfig, "model", params), out_dir=str(root / "base"),
                                  corpus_file=data["sft"]))
        tracking = load_config(TrackingConfig, "tracking", params)
        results = {}
        for precision in ("fp32", "bf16"):
            cfg = replace(load_config(SFTConfig, "sft", params), model_path=str(root / "base"), train_file=data["sft"],
                          eval_file=data["eval"], output_dir=str(root / f"sft-{precision}"), precision=precision)
            started = time.perf_counter()
            sft = stages.sft(cfg, tracking, show_progress=False)
            ev = stages.evaluate(replace(load_config(EvalConfig, "evaluate", params), model_path=cfg.output_dir,
                                         eval_file=data["eval"], output_file=str(root / f"eval-{precision}.json")),
                                 tracking)
            results[precision] = {"train_seconds": round(sft.metrics["perf/train_seconds"], 2),
                                  "stage_wall_seconds": round(time.perf_counter() - started, 2),
                                  "tokens_per_s": round(sft.metrics["perf/tokens_per_s"]),
                                  "accuracy": ev.metrics["eval/accuracy"],
                                  "accuracy_stderr": round(ev.metrics["eval/accuracy_stderr"], 4)}
        tracked_files = sorted(p.name for p in (root / "runs").glob("*/*"))
    report = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "mlflow_installed": importlib.util.find_spec("mlflow") is not None,
        "local_tracking_files": sorted(set(tracked_files)),
        "results": results,
    }
    (out_dir / "gpu_sft_smoke.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
