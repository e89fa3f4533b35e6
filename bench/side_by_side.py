"""alignflow and TRL side by side: GRPO step, SFT / DPO / reward-model training, on one model and data.

Both frameworks get the same model, data, batch shape and settings (printed first, in the
``settings`` line); they run alternately in fresh processes (ours, TRL, ours, TRL, ...) so load
drifts hit both, and the summary prints each side's figures and the ratio.

Variants:

* ``--variant cpu``: the embedded default (``models/sft``, ``data/embedded``), fp32, torch threads fixed.
  Run from the repository root after ``make bench-cpu`` (it installs the ``bench`` extra, i.e. TRL)::

      .venv/bin/python bench/side_by_side.py --variant cpu --out bench/results/side_by_side_cpu.json

* ``--variant gpu``: a Qwen2-0.5B-shaped model with random weights and a 32k byte-level BPE built here
  (no download), bf16 on both sides. GRPO: 64 prompts x 8 samples x 256 new tokens; SFT: batch 32,
  prompt 64 + completion 192 random words, max_length 512; DPO / RM: 32 pairs, prompt 64 words,
  responses 128 words each. On a lent GPU (carried TRL from ``../shared/device/pack.sh``)::

      PYTHONPATH=/tmp/site:. python bench/side_by_side.py --variant gpu --out $OUT/side_by_side_h100.json

Settings shared by both sides (the ``settings`` line has every value):

* GRPO: KL coefficient beta > 0 on both (both compute reference log-probs; TRL 1.16 defaults to 0);
  one policy update per generated batch (ours: ``mini_batch_size`` = every row, one PPO epoch, so
  pi_old is the update's own detached log-prob, exactly TRL's ``num_iterations = 1``; TRL:
  ``steps_per_generation`` = gradient accumulation); the same micro-batch rows and gradient
  checkpointing; generation engines named in the output (ours: our static-cache engine, CUDA graphs
  on a GPU; TRL: HF ``generate``, vLLM off). Reward: completion length / 1000 on both.
* SFT / DPO / RM: the same rows per step, max_length, gradient checkpointing (GPU), learning-rate
  schedule shape irrelevant (timed steps only). DPO: both compute the reference per step (ours:
  ``precompute_reference: false``; TRL's default), sigmoid loss, no NLL term.
* Precision: ours trains fp32 master weights under bf16 autocast (what the pipeline runs); TRL trains
  the bf16 model it is given (the anchor's setup). Both compute matmuls in bf16.

Timing: per-step wall time; the summary is the median of the timed steps (the first ``--warmup`` are
dropped) over all rounds. Tokens/s counts real (non-padding) tokens. Peak memory: the process's
``torch.cuda.max_memory_allocated`` on a GPU, ``ru_maxrss`` on the CPU. Floors: ``6 N T`` FLOPs of the
update over the measured matmul peak; for generation, per decode step the larger of (weights + KV
cache bytes) / measured copy bandwidth and ``2 N B`` FLOPs / peak.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BENCHES = ("grpo", "sft", "dpo", "rm")

SETTINGS = {
    "cpu": dict(model="models/sft", threads=1, seed=0,
                grpo=dict(prompts="data/embedded/prompts.jsonl", prompts_per_step=32, group_size=8,
                          max_new_tokens=12, temperature=1.0, beta=0.1, lr=3e-4, micro_rows=32, steps=5,
                          grad_ckpt=False),
                sft=dict(data="data/embedded/sft.jsonl", batch=64, max_length=64, lr=3e-4, steps=12, grad_ckpt=False),
                dpo=dict(data="data/embedded/preferences.jsonl", batch=32, max_length=64, lr=3e-5, steps=12,
                         beta=0.1, grad_ckpt=False),
                rm=dict(data="data/embedded/preferences.jsonl", batch=32, max_length=64, lr=1e-4, steps=12,
                        grad_ckpt=False)),
    "gpu": dict(model="qwen2-0.5b-shaped", threads=8, seed=0,
                grpo=dict(prompts="prompts.jsonl", prompts_per_step=64, group_size=8, max_new_tokens=256,
                          temperature=1.0, beta=0.04, lr=1e-6, micro_rows=128, steps=4, grad_ckpt=True),
                sft=dict(data="sft.jsonl", batch=32, max_length=512, lr=1e-5, steps=12, grad_ckpt=True),
                dpo=dict(data="pairs.jsonl", batch=32, max_length=512, lr=1e-6, steps=12, beta=0.1, grad_ckpt=True),
                rm=dict(data="pairs.jsonl", batch=32, max_length=512, lr=1e-6, steps=12, grad_ckpt=True)),
}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _peak_memory_gb() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------
# The GPU variant's model and data (built once by the parent, read by every child)
# --------------------------------------------------------------------------------------


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def make_small() -> None:
    """``--small``: the GPU variant's code paths on a micro model and short runs (a CPU smoke test)."""
    g = SETTINGS["gpu"]
    g["threads"] = 1
    g["grpo"].update(prompts_per_step=4, group_size=4, max_new_tokens=16, micro_rows=8, steps=2)
    for name in ("sft", "dpo", "rm"):
        g[name].update(batch=4, steps=3)


def build_gpu_inputs(work: Path, small: bool) -> dict[str, str]:
    """Tokenizer + Qwen2-0.5B-shaped random model (causal LM) + the four data files."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_grpo import build_model, build_tokenizer

    model_dir = build_model(build_tokenizer(32000, work / "tok"), work / "model", **(SMALL if small else {}))
    rng = random.Random(0)
    words = open(os.__file__).read().split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    with (work / "prompts.jsonl").open("w") as fh:
        for i in range(64 * 8):
            fh.write(json.dumps({"prompt": f"Question {i}: compute {i}*{i + 3} and explain", "label": "x"}) + "\n")
    with (work / "sft.jsonl").open("w") as fh:
        for _ in range(32 * 14):
            fh.write(json.dumps({"prompt": text(64), "completion": text(192)}) + "\n")
    with (work / "pairs.jsonl").open("w") as fh:
        for _ in range(32 * 14):
            fh.write(json.dumps({"prompt": text(64), "chosen": text(128), "rejected": text(128)}) + "\n")
    return {"model": str(model_dir), "dir": str(work)}


def _paths(variant: str, inputs: dict[str, str], name: str) -> tuple[str, str]:
    """(model dir, data file) of a benchmark."""
    s = SETTINGS[variant]
    key = "prompts" if name == "grpo" else "data"
    if variant == "cpu":
        return str(REPO / s["model"]), str(REPO / s[name][key])
    return inputs["model"], str(Path(inputs["dir"]) / s[name][key])


def _reward_file(work: Path) -> str:
    path = work / "length_reward.py"
    path.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 1000 for c in completions]\n")
    return f"{path}:reward"


def _real_tokens(tokenizer_dir: str, rows: list[dict], fields: list[list[str]], max_length: int) -> float:
    """Mean non-padding tokens per row: each inner list of fields is one sequence (concatenated)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    total = 0
    for r in rows:
        for seq in fields:
            total += min(len(tok("".join(r[f] for f in seq), add_special_tokens=False)["input_ids"]) + 1, max_length)
    return total / len(rows)


# --------------------------------------------------------------------------------------
# Children: one framework, one benchmark, per-step times
# --------------------------------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))


def ours(variant: str, name: str, inputs: dict[str, str]) -> dict:
    import torch

    from rlhf_core.config import DPOConfig, RLConfig, RewardConfig, SFTConfig

    s = SETTINGS[variant]
    b = s[name]
    torch.manual_seed(s["seed"])
    model, data = _paths(variant, inputs, name)
    work = Path(tempfile.mkdtemp(prefix=f"bench-ours-{name}-"))
    common = dict(output_dir=str(work / "out"), checkpoint_dir=str(work / "ckpt"), save_every=0,
                  precision="fp32" if variant == "cpu" else "auto", num_threads=s["threads"], seed=s["seed"])
    sink = _Sink()
    if name == "grpo":
        from rlhf_core.trainers.rl import train_rl

        rows = b["prompts_per_step"] * b["group_size"]
        cfg = RLConfig(model_path=model, prompts_file=data, eval_file=data, reward_function=_reward_file(work),
                       estimator="grpo", max_steps=b["steps"], prompts_per_step=b["prompts_per_step"],
                       group_size=b["group_size"], max_new_tokens=b["max_new_tokens"], temperature=b["temperature"],
                       kl_coef=b["beta"], lr=b["lr"], mini_batch_size=rows, micro_batch_size=b["micro_rows"],
                       ppo_epochs=1, batch_size=rows, max_length=b["max_new_tokens"] + 64, warmup_steps=0,
                       eval_items=1, eval_at_start=False, log_rollouts_every=0, rollout_engine="static",
                       gradient_checkpointing=b["grad_ckpt"], **common)
        _sync()
        train_rl(cfg, sink, show_progress=False)
        steps = [m for _, m in sink.rows if "perf/step_s" in m]
        return {"step_s": [m["perf/step_s"] for m in steps],
                "phase_s": {k: [m[k] for m in steps] for k in ("perf/rollout_s", "perf/reward_s", "perf/logprob_s",
                                                             "perf/update_s", "perf/weight_sync_s")},
                "response_len": [m["rollout/response_length"] for m in steps], "peak_memory_gb": _peak_memory_gb(),
                "engine": "alignflow StaticCacheEngine" + (" + CUDA graphs" if _cuda() else "")}
    held_out = _paths(variant, inputs, "grpo")[1]  # prompt + label rows: the end-of-run eval (not timed) reads 1
    shared = dict(model_path=model, train_file=data, eval_file=held_out, max_steps=b["steps"], batch_size=b["batch"],
                  max_length=b["max_length"], lr=b["lr"], warmup_steps=0, log_every=1, eval_items=1,
                  gradient_checkpointing=b["grad_ckpt"], **common)
    if name == "sft":
        from rlhf_core.trainers.sft import train_sft as train

        cfg = SFTConfig(**shared)
    elif name == "dpo":
        from rlhf_core.trainers.dpo import train_dpo as train

        cfg = DPOConfig(**shared, beta=b["beta"], precompute_reference=False, nll_weight=0.0)
    else:
        from rlhf_core.trainers.reward import train_reward_model as train

        cfg = RewardConfig(**{**shared, "eval_file": data})  # pairs as the held-out file: no split of the train rows
    train(cfg, sink, show_progress=False)
    elapsed = [m["perf/elapsed_s"] for _, m in sink.rows if "perf/elapsed_s" in m]
    return {"step_s": [b2 - a for a, b2 in zip([0.0] + elapsed, elapsed)], "peak_memory_gb": _peak_memory_gb()}


def trl_side(variant: str, name: str, inputs: dict[str, str]) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    from rlhf_core.data.io import read_records

    s = SETTINGS[variant]
    b = s[name]
    torch.manual_seed(s["seed"])
    torch.set_num_threads(s["threads"])
    model_dir, data = _paths(variant, inputs, name)
    gpu = _cuda()
    dtype = torch.bfloat16 if gpu else torch.float32
    tok = AutoTokenizer.from_pretrained(model_dir)
    work = tempfile.mkdtemp(prefix=f"bench-trl-{name}-")
    times: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            _sync()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync()
            times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    common = dict(output_dir=work, learning_rate=b["lr"], lr_scheduler_type="constant", warmup_steps=0,
                  max_steps=b["steps"], use_cpu=not gpu, bf16=gpu, logging_steps=1, report_to="none",
                  save_strategy="no", gradient_checkpointing=b["grad_ckpt"], seed=s["seed"], dataloader_num_workers=0)
    records = read_records(data)
    if name == "grpo":
        rows = b["prompts_per_step"] * b["group_size"]
        accum = rows // b["micro_rows"]
        ds = Dataset.from_list([{"prompt": r["prompt"]} for r in records])

        def reward(completions, **kw):
            return [len(c) / 1000 for c in completions]

        cfg = trl.GRPOConfig(**common, per_device_train_batch_size=b["micro_rows"], gradient_accumulation_steps=accum,
                             steps_per_generation=accum, num_iterations=1, num_generations=b["group_size"],
                             max_completion_length=b["max_new_tokens"], temperature=b["temperature"], beta=b["beta"],
                             use_vllm=False)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok)
    elif name == "sft":
        ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in records])
        cfg = trl.SFTConfig(**common, per_device_train_batch_size=b["batch"], max_length=b["max_length"])
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    elif name == "dpo":
        ds = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in records])
        cfg = trl.DPOConfig(**common, per_device_train_batch_size=b["batch"], max_length=b["max_length"],
                            beta=b["beta"])
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        trainer = trl.DPOTrainer(model=model, ref_model=ref, args=cfg, train_dataset=ds, processing_class=tok)
    else:
        ds = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in records])
        cfg = trl.RewardConfig(**common, per_device_train_batch_size=b["batch"], max_length=b["max_length"])
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype, num_labels=1)
        model.config.pad_token_id = tok.pad_token_id
        trainer = trl.RewardTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    trainer.add_callback(Timer())
    trainer.train()
    out = {"step_s": times, "peak_memory_gb": _peak_memory_gb(), "trl": trl.__version__}
    if name == "grpo":
        out.update(response_len=lengths, engine="TRL HF generate (use_vllm=False)")
    return out


# --------------------------------------------------------------------------------------
# Parent: ceilings, alternating children, summary with ratios and floors
# --------------------------------------------------------------------------------------


def ceilings(variant: str, threads: int) -> dict[str, float]:
    """Measured matmul peak (bf16 on a GPU, fp32 on the CPU at the benchmark's thread count) and copy bandwidth."""
    import torch

    if variant == "gpu" and _cuda():
        dev, dtype, n = torch.device("cuda"), torch.bfloat16, 8192
    else:
        torch.set_num_threads(threads)
        dev, dtype, n = torch.device("cpu"), torch.float32, 1024
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync()
    t = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ b
    _sync()
    flops = 2 * n**3 / ((time.perf_counter() - t) / reps)
    x = torch.empty(2**28, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    _sync()
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    _sync()
    bw = 2 * x.numel() / ((time.perf_counter() - t) / 5)
    return {"matmul_flops": flops, "copy_bytes_per_s": bw}


def _child(variant: str, side: str, name: str, inputs: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--child", side, "--bench", name,
           "--inputs", json.dumps(inputs)] + (["--small"] if inputs.get("small") else [])
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{\"result\"")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    return json.loads(lines[-1])["result"]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(variant: str, name: str, runs: dict[str, list[dict]], warmup: int, inputs: dict[str, str],
              peak: dict[str, float], n_params: int, model_info: dict) -> dict:
    s = SETTINGS[variant]
    b = s[name]
    out: dict = {}
    for side, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            out[side] = {"error": results[-1]["error"][-1500:] if results else "not run"}
            continue
        timed = [t for r in ok for t in r["step_s"][warmup:]]
        med = _median(timed)
        entry = {"median_step_s": round(med, 4), "timed_steps": len(timed),
                 "peak_memory_gb": round(max(r["peak_memory_gb"] for r in ok), 2)}
        if name == "grpo":
            rows = b["prompts_per_step"] * b["group_size"]
            resp = _median([x for r in ok for x in r.get("response_len", [])[warmup:]] or
                           [x for r in ok for x in r.get("response_len", [])])
            entry.update(engine=ok[0]["engine"], samples_per_s=round(rows / med, 1), median_response_len=resp,
                         generated_tokens_per_s=round(rows * resp / med, 1))
            if "phase_s" in ok[0]:
                entry["phase_s"] = {k.split("/")[1]: round(_median([x for r in ok for x in r["phase_s"][k][warmup:]]), 4)
                                    for k in ok[0]["phase_s"]}
        else:
            tokens = model_info["tokens_per_row"][name] * b["batch"]
            n = n_params - model_info["lm_head_params"] if name == "rm" else n_params
            entry.update(tokens_per_step=round(tokens), tokens_per_s=round(tokens / med, 1),
                         fraction_of_peak_6NT=round(6 * n * tokens / med / peak["matmul_flops"], 4))
        out[side] = entry
    if all("median_step_s" in out.get(k, {}) for k in ("alignflow", "trl")):
        out["speedup_alignflow_over_trl"] = round(out["trl"]["median_step_s"] / out["alignflow"]["median_step_s"], 2)
    resp = out.get("alignflow", {}).get("median_response_len") if name == "grpo" else None
    out["floor"] = floor(variant, name, peak, n_params, model_info, resp)
    if "median_step_s" in out.get("alignflow", {}):
        out["alignflow"]["fraction_of_floor"] = round(out["floor"]["step_s"] / out["alignflow"]["median_step_s"], 4)
    return out


def floor(variant: str, name: str, peak: dict[str, float], n_params: int, info: dict,
          response_len: float | None = None) -> dict:
    """The physical floor of one step: FLOPs over the measured matmul peak, bytes over the copy bandwidth."""
    b = SETTINGS[variant][name]
    F, BW = peak["matmul_flops"], peak["copy_bytes_per_s"]
    if name != "grpo":
        tokens = info["tokens_per_row"][name] * b["batch"]
        factor = 8 if name == "dpo" else 6  # DPO: + the reference's forward (2 N T)
        n = n_params - info["lm_head_params"] if name == "rm" else n_params  # RM: a scalar head, no LM head
        return {"step_s": round(factor * n * tokens / F, 4), "rule": f"{factor} N T / peak"}
    rows = b["prompts_per_step"] * b["group_size"]
    R, P = b["max_new_tokens"], info["prompt_tokens"]
    bytes_per = 2 if variant == "gpu" else 4
    kv = info["kv_bytes_per_token"] * rows * (P + R / 2)  # mean cache length over the decode
    decode = max((n_params * bytes_per + kv) / BW, 2 * n_params * rows / F)
    # training passes need only the real tokens: mean prompt + measured mean response
    tokens = rows * (info.get("mean_prompt_tokens", P) + (response_len or R))
    gen, ref, upd = R * decode, 2 * n_params * tokens / F, 6 * n_params * tokens / F
    return {"step_s": round(gen + ref + upd, 4), "generation_s": round(gen, 4), "reference_s": round(ref, 4),
            "update_s": round(upd, 4), "rule": "R x max(bytes/BW, 2NB/peak) + 2NT/peak + 6NT/peak"}


def model_facts(variant: str, inputs: dict[str, str]) -> tuple[int, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.data.io import read_records

    model_dir, _ = _paths(variant, inputs, "sft")
    cfg = AutoConfig.from_pretrained(model_dir)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (2 if variant == "gpu" else 4)
    tok = AutoTokenizer.from_pretrained(model_dir)
    s = SETTINGS[variant]
    per_row = {}
    for name, fields in (("sft", [["prompt", "completion"]]), ("dpo", [["prompt", "chosen"], ["prompt", "rejected"]]),
                         ("rm", [["prompt", "chosen"], ["prompt", "rejected"]])):
        rows = read_records(_paths(variant, inputs, name)[1])[:256]
        per_row[name] = _real_tokens(model_dir, rows, fields, s[name]["max_length"])
    prompts = read_records(_paths(variant, inputs, "grpo")[1])
    lengths = [len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in prompts]
    return n_params, {"tokens_per_row": per_row, "kv_bytes_per_token": kv_bytes, "prompt_tokens": max(lengths),
                      "mean_prompt_tokens": sum(lengths) / len(lengths),
                      "lm_head_params": cfg.vocab_size * cfg.hidden_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of (alignflow, TRL)")
    ap.add_argument("--warmup", type=int, default=1, help="steps per process left out of the median")
    ap.add_argument("--sides", default="alignflow,trl")
    ap.add_argument("--out", default="bench/results/side_by_side_cpu.json")
    ap.add_argument("--small", action="store_true", help="GPU variant's code on a micro model (smoke test)")
    ap.add_argument("--resummarize", metavar="FILE", help="recompute the summaries of a result file from its runs")
    ap.add_argument("--child", choices=["alignflow", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--bench", choices=BENCHES, help=argparse.SUPPRESS)
    ap.add_argument("--inputs", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import rlhf_core  # noqa: F401  (offline switches)

    if args.small:
        make_small()
    if args.resummarize:  # recompute summaries (ratios, floors) of a result file from its recorded runs
        data = json.loads(Path(args.resummarize).read_text())
        peak = {"matmul_flops": data["measured_peak"]["matmul_tflops"] * 1e12,
                "copy_bytes_per_s": data["measured_peak"]["copy_tb_per_s"] * 1e12}
        for name, res in data["results"].items():
            res["summary"] = summarize(data["variant"], name, res["runs"], args.warmup, {}, peak,
                                       data["model_params"], data["model_info"])
            print(json.dumps({"bench": name, "summary": res["summary"]}))
        Path(args.resummarize).write_text(json.dumps(data, indent=2) + "\n")
        return
    if args.child:
        result = (ours if args.child == "alignflow" else trl_side)(args.variant, args.bench, json.loads(args.inputs))
        print(json.dumps({"result": result}), flush=True)
        return

    import torch
    import transformers

    inputs = {}
    if args.variant == "gpu":
        inputs = {**build_gpu_inputs(Path(tempfile.mkdtemp(prefix="bench-gpu-")), args.small), "small": args.small}
    peak = ceilings(args.variant, SETTINGS[args.variant]["threads"])
    n_params, info = model_facts(args.variant, inputs)
    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    header = {"variant": args.variant, "settings": SETTINGS[args.variant], "torch": torch.__version__,
              "transformers": transformers.__version__, "trl": trl_version, "cpus": os.cpu_count(),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "measured_peak": {"matmul_tflops": round(peak["matmul_flops"] / 1e12, 3),
                                "copy_tb_per_s": round(peak["copy_bytes_per_s"] / 1e12, 3)},
              "model_params": n_params, "model_info": info,
              "precision": "bf16 autocast over fp32 masters (alignflow), bf16 weights (TRL)" if args.variant == "gpu"
              else "fp32 both"}
    print(json.dumps({"settings": header}), flush=True)
    results: dict = {}
    sides = args.sides.split(",")
    for name in args.only.split(","):
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in sides:
                started = time.perf_counter()
                res = _child(args.variant, side, name, inputs)
                runs[side].append(res)
                print(json.dumps({"bench": name, "round": r, "side": side, "wall_s": round(time.perf_counter() - started, 1),
                                  **({"error": res["error"][-800:]} if "error" in res else
                                     {"step_s": [round(x, 4) for x in res["step_s"]],
                                      "peak_memory_gb": round(res["peak_memory_gb"], 2)})}), flush=True)
        results[name] = {"summary": summarize(args.variant, name, runs, args.warmup, inputs, peak, n_params, info),
                         "runs": runs}
        print(json.dumps({"bench": name, "summary": results[name]["summary"]}), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # after each benchmark: a cut-off run keeps its part
        Path(args.out).write_text(json.dumps({**header, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
