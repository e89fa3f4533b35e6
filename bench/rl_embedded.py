"""Rerun the online-RL acceptance runs on the embedded task (CPU, 1 torch thread by default), printing every step.

Reads the ``rl`` section of ``params.yaml`` (or ``--params``), applies ``--set field=value``
overrides, trains with :func:`rlhf_core.trainers.rl.train_rl` without MLflow, and writes every
logged metric row and the rollout table to ``--out`` (JSON). Examples, from the repository root::

    # (a) GRPO with the rule reward
    OMP_NUM_THREADS=1 .venv/bin/python bench/rl_embedded.py --out bench/results/cpu/<UTC date>/rl_grpo.json
    # (b) PPO (GAE + critic) with the trained reward model
    OMP_NUM_THREADS=1 .venv/bin/python bench/rl_embedded.py --out bench/results/cpu/<UTC date>/rl_ppo.json \\
        --set estimator=gae --set reward_kind=model --set kl_in_reward=true --set kl_estimator=k1

``--root DIR`` points model_path, reward_model_path and the data files at another checkout of the
same pipeline (e.g. a copy under /tmp) without editing params.yaml.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlhf_core  # noqa: E402,F401  (offline switches)
from rlhf_core.tracking.checkpoint import clear_checkpoints  # noqa: E402
from rlhf_core.config import RLConfig, load_config, parse_overrides  # noqa: E402
from rlhf_core.trainers.rl import train_rl  # noqa: E402

SHOWN = ("rollout/reward_mean", "rollout/kept_groups_frac", "rollout/response_length", "train/kl",
         "train/entropy", "train/clip_frac", "train/value_loss", "train/explained_variance", "train/kl_coef",
         "perf/rollout_s", "perf/reward_s", "perf/logprob_s", "perf/update_s", "perf/step_s", "eval/accuracy",
         "eval/accuracy_sort", "eval/reward_model_score")


class PrintSink:
    """Prints a compact line per step and keeps every row."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.started = time.perf_counter()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append({"step": step, **metrics})
        shown = "  ".join(f"{k.split('/', 1)[1]}={v:.4g}" for k, v in metrics.items() if k in SHOWN)
        print(f"[{time.perf_counter() - self.started:6.1f}s] step {step:3d}  {shown}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--root", default=None, help="read models/ and data/embedded/ under this folder")
    parser.add_argument("--out", required=True, help="JSON file receiving every metric row and the final metrics")
    args = parser.parse_args()

    overrides = {}
    if args.root:
        root = Path(args.root)
        overrides = {"model_path": str(root / "models/sft"), "reward.model_path": str(root / "models/reward"),
                     "prompts_file": str(root / "data/embedded/prompts.jsonl"),
                     "eval_file": str(root / "data/embedded/eval.jsonl")}
    overrides.update(parse_overrides(args.set))
    overrides.setdefault("output_dir", "/tmp/alignflow-rl-bench/model")
    overrides.setdefault("checkpoint_dir", "/tmp/alignflow-rl-bench/checkpoints")
    cfg = load_config(RLConfig, "rl", args.params, overrides)
    # a benchmark trains every time: no resuming from, or reusing the finished output of, an earlier run
    clear_checkpoints(cfg.checkpoint_dir)
    sink = PrintSink()
    started = time.perf_counter()
    result = train_rl(cfg, sink, show_progress=False)
    wall = time.perf_counter() - started
    out = {"config": {k: v for k, v in vars(cfg).items()}, "wall_s": wall, "metrics": result.metrics,
           "rows": sink.rows, "rollout_table": result.rollout_table, "eval_samples": result.eval_samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    m = result.metrics
    print(f"wall {wall:.0f}s  accuracy {m.get('eval/accuracy_start', float('nan')):.3f} -> {m['eval/accuracy']:.3f} "
          f"(± {m['eval/accuracy_stderr']:.3f})  sort {m.get('eval/accuracy_sort', float('nan')):.3f}  "
          f"RM score {m.get('eval/reward_model_score_start', float('nan')):.3f} -> "
          f"{m.get('eval/reward_model_score', float('nan')):.3f}  final KL {m.get('train/kl', float('nan')):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
