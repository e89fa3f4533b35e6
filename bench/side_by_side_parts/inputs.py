"""Inputs: tokenizer and data (in the parent, on the CPU), the model (in a child, on the device), TRL's DeepSpeed
file, and the paths a benchmark reads.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from .settings import REPO, SETTINGS


def build_inputs(variant: str, work: Path, small: bool) -> dict:
    """Tokenizer and the four data files here; the model in a child process (the parent keeps off CUDA)."""
    s = SETTINGS[variant]
    inputs: dict = {"variant": variant, "small": small, "dir": str(work), "gpus": s["gpus"],
                    "parallel": s.get("parallel") or ("zero3" if s["gpus"] > 1 else "ddp")}
    if variant == "cpu":
        return {**inputs, "root": str(REPO), "model": str(REPO / s["model"])}
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_grpo import build_tokenizer

    inputs["tokenizer"] = str(build_tokenizer(32000, work / "tok"))
    rng = random.Random(0)
    words = open(os.__file__).read().split()
    w = s["words"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    rows = max(s[n]["batch"] * (s[n]["steps"] + 2) for n in ("sft", "dpo", "rm"))
    with (work / "prompts.jsonl").open("w") as fh:
        for i in range(max(64 * 8, s["grpo"]["prompts_per_step"] * (s["grpo"]["steps"] + 2))):
            fh.write(json.dumps({"prompt": f"Question {i}: compute {i}*{i + 3} and explain", "label": "x"}) + "\n")
    with (work / "sft.jsonl").open("w") as fh:
        for _ in range(rows):
            fh.write(json.dumps({"prompt": text(w["prompt"]), "completion": text(w["completion"])}) + "\n")
    with (work / "pairs.jsonl").open("w") as fh:
        for _ in range(rows):
            fh.write(json.dumps({"prompt": text(w["prompt"]), "chosen": text(w["response"]),
                                 "rejected": text(w["response"])}) + "\n")
    if s["gpus"] > 1:
        inputs["deepspeed_config"] = write_deepspeed_config(work / "ds_zero3.json")
    return inputs


def build_model(inputs: dict) -> dict:
    """Child ``build``: the variant's Qwen2-shaped model with random weights, initialised on the device in
    bf16 (no fp32 copy on the host), saved as safetensors -- sharded where the variant says."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    s = SETTINGS[inputs["variant"]]
    tok = AutoTokenizer.from_pretrained(inputs["tokenizer"])
    cfg = Qwen2Config(vocab_size=s["vocab"] or len(tok), **s["shape"], tie_word_embeddings=s["tie"],
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.eos_token_id)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(s["seed"])
    started = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    built = time.perf_counter()
    out = Path(inputs["dir"]) / "model"
    model.save_pretrained(str(out), safe_serialization=True, **({"max_shard_size": s["shard"]} if s["shard"] else {}))
    tok.save_pretrained(str(out))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    return {"model": str(out), "device": str(next(model.parameters()).device), "build_s": round(built - started, 2),
            "save_s": round(time.perf_counter() - built, 2), "shards": len(shards),
            "index": (out / "model.safetensors.index.json").exists(), "params": sum(p.numel() for p in model.parameters())}


def write_deepspeed_config(path: Path) -> str:
    """TRL's ZeRO-3 file: ``auto`` values filled by the HF Trainer from the TrainingArguments (batch,
    accumulation, clipping, bf16); no optimizer section, so the Trainer's AdamW (betas, eps, decay as set)
    is DeepSpeed's client optimizer, as ours is."""
    cfg = {"zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                 "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_gather_16bit_weights_on_model_save": False},
           "bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return str(path)


def bench_paths(inputs: dict, name: str) -> tuple[str, str]:
    """(model dir, data file) of a benchmark."""
    s = SETTINGS[inputs["variant"]]
    key = "prompts" if name == "grpo" else "data"
    if inputs["variant"] == "cpu":
        return inputs["model"], str(Path(inputs["root"]) / s[name][key])
    return inputs["model"], str(Path(inputs["dir"]) / s[name][key])


def reward_file(work: Path) -> str:
    path = work / "length_reward.py"
    path.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 1000 for c in completions]\n")
    return f"{path}:reward"
