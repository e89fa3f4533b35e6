"""CPU benchmark: alignflow's GRPO step against TRL's ``GRPOTrainer`` on the embedded default, side by side.

Same model (``models/sft``), prompts (``data/embedded/prompts.jsonl``), reward (the embedded
exact-match rule), batch shape and settings on both sides, printed at the start:

* 32 prompts x 8 samples x 12 new tokens per step, temperature 1, fp32, torch threads fixed;
* KL coefficient beta = 0.1 on both (both compute reference log-probs; TRL 1.16 defaults to 0);
* one policy update per generated batch (ours: mini_batch_size = 256 rows, one PPO epoch; TRL:
  per_device_train_batch_size = 256, steps_per_generation = 1, num_iterations = 1);
* pi_old from the sampling pass on both: TRL (num_iterations = 1) detaches the update's own
  log-probs; ours takes the HF engine's sampling log-probs (``recompute_old_logprobs: false``; the
  engine samples with the trained fp32 weights, and ``tests/model/test_rl_tiny.py`` checks that its
  log-probs match the trainer's recomputation);
* no gradient checkpointing; each side's engine: HF ``generate`` (ours: our HF engine around
  ``model.generate``; TRL: its own ``generate`` path, vLLM off).

The two run alternately in fresh processes (ours, TRL, ours, TRL, ...) so load drifts hit both;
each process reports its per-step times, and the summary is the median of steps 2..N over all
rounds, with peak resident memory (``ru_maxrss``).

Run from the repository root (``make bench-cpu`` installs the ``bench`` extra, i.e. TRL, first)::

    .venv/bin/python bench/trl_cpu_grpo.py --out bench/results/trl_cpu_grpo.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = dict(model="models/sft", prompts="data/embedded/prompts.jsonl", prompts_per_step=32, group_size=8,
                max_new_tokens=12, temperature=1.0, beta=0.1, lr=3e-4, precision="fp32", threads=1, seed=0,
                recompute_old_logprobs=False)


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def run_alignflow(steps: int, s: dict) -> dict:
    """Our trainer (``train_rl``), GRPO with the settings above; per-step wall times from perf/step_s."""
    from rlhf_core.config import RLConfig
    from rlhf_core.trainers.rl import train_rl

    class Sink:
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def log_metrics(self, metrics: dict, step: int) -> None:
            if "perf/step_s" in metrics:
                self.steps.append(dict(metrics))

    work = Path(tempfile.mkdtemp(prefix="bench-ours-"))
    cfg = RLConfig(model_path=str(REPO / s["model"]), prompts_file=str(REPO / s["prompts"]),
                   output_dir=str(work / "out"), checkpoint_dir=str(work / "ckpt"), estimator="grpo",
                   max_steps=steps, prompts_per_step=s["prompts_per_step"], group_size=s["group_size"],
                   max_new_tokens=s["max_new_tokens"], temperature=s["temperature"], kl_coef=s["beta"], lr=s["lr"],
                   mini_batch_size=s["prompts_per_step"] * s["group_size"], ppo_epochs=1, warmup_steps=0,
                   eval_items=1, eval_at_start=False, save_every=0, log_rollouts_every=0,
                   precision=s["precision"], num_threads=s["threads"], seed=s["seed"],
                   recompute_old_logprobs=s["recompute_old_logprobs"])
    sink = Sink()
    train_rl(cfg, sink, show_progress=False)
    return {"step_s": [m["perf/step_s"] for m in sink.steps],
            "phase_s": {k: statistics.median(m[k] for m in sink.steps[1:] or sink.steps)
                        for k in ("perf/rollout_s", "perf/reward_s", "perf/logprob_s", "perf/update_s")},
            "response_len": statistics.median(m["rollout/response_length"] for m in sink.steps),
            "peak_rss_gb": _peak_rss_gb()}


def run_trl(steps: int, s: dict) -> dict:
    """TRL 1.16 ``GRPOTrainer`` with the same settings; per-step wall times from a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_core.data.io import read_records
    from rlhf_core.models import load_tokenizer
    from rlhf_core.rewards_embedded import reward as embedded_reward

    torch.set_num_threads(s["threads"])
    records = read_records(str(REPO / s["prompts"]))
    ds = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in records])

    def reward(prompts, completions, label, **kw):
        return embedded_reward(prompts, completions, label)

    tok = load_tokenizer(REPO / s["model"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(REPO / s["model"]), dtype=torch.float32)
    rows = s["prompts_per_step"] * s["group_size"]
    work = tempfile.mkdtemp(prefix="bench-trl-")
    cfg = GRPOConfig(output_dir=work, per_device_train_batch_size=rows, gradient_accumulation_steps=1,
                     steps_per_generation=1, num_iterations=1, num_generations=s["group_size"],
                     max_completion_length=s["max_new_tokens"], temperature=s["temperature"], beta=s["beta"],
                     learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, max_steps=steps,
                     use_cpu=True, bf16=False, logging_steps=1, report_to="none", save_strategy="no",
                     use_vllm=False, gradient_checkpointing=False, seed=s["seed"], dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok)
    times: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer.add_callback(Timer())
    trainer.train()
    return {"step_s": times, "response_len": statistics.median(lengths) if lengths else float("nan"),
            "peak_rss_gb": _peak_rss_gb()}


def _child(side: str, steps: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", side, "--steps", str(steps)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise RuntimeError(f"{side} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5, help="GRPO steps per process (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of (alignflow, TRL)")
    ap.add_argument("--out", default="bench/results/trl_cpu_grpo.json")
    ap.add_argument("--child", choices=["alignflow", "trl"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import rlhf_core  # noqa: F401  (offline switches)

        result = (run_alignflow if args.child == "alignflow" else run_trl)(args.steps, SETTINGS)
        print(json.dumps(result))
        return

    import torch
    import trl

    header = {"settings": SETTINGS, "trl": trl.__version__, "torch": torch.__version__, "cpus": os.cpu_count(),
              "engines": {"alignflow": "HF generate (HFGenerateEngine)", "trl": "HF generate (use_vllm=False)"}}
    print(json.dumps(header), flush=True)
    runs: dict[str, list[dict]] = {"alignflow": [], "trl": []}
    for r in range(args.rounds):
        for side in ("alignflow", "trl"):
            res = _child(side, args.steps)
            runs[side].append(res)
            print(json.dumps({"round": r, "side": side, "step_s": [round(x, 3) for x in res["step_s"]],
                              "peak_rss_gb": round(res["peak_rss_gb"], 2)}), flush=True)
    summary = {}
    for side, results in runs.items():
        timed = [t for res in results for t in res["step_s"][1:]]
        med = statistics.median(timed)
        rows = SETTINGS["prompts_per_step"] * SETTINGS["group_size"]
        resp = statistics.median(res["response_len"] for res in results)
        summary[side] = {"median_step_s": round(med, 3), "samples_per_s": round(rows / med, 1),
                         "generated_tokens_per_s": round(rows * resp / med, 1), "median_response_len": resp,
                         "peak_rss_gb": round(max(res["peak_rss_gb"] for res in results), 2), "timed_steps": len(timed)}
        if side == "alignflow":
            summary[side]["phase_s"] = {k: round(statistics.median(res["phase_s"][k] for res in results), 3)
                                        for k in results[0]["phase_s"]}
    summary["speedup_alignflow_over_trl"] = round(summary["trl"]["median_step_s"] / summary["alignflow"]["median_step_s"], 2)
    print(json.dumps(summary), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**header, "summary": summary, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
