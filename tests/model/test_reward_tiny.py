"""Tiny reward model: learns the pairs, saves as an HF directory, a fresh process scores identically."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from rlhf_core.config import RewardConfig
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.rewards.model import MEAN_KEY, load_reward_model, score
from rlhf_core.trainers.reward import train_reward_model


def test_reward_model_trains_saves_and_reloads(micro_model, micro_data, tmp_path):
    cfg = RewardConfig(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                       output_dir=str(tmp_path / "rm"), max_steps=40, batch_size=16, lr=3e-3, warmup_steps=2,
                       eval_fraction=0.2)
    result = train_reward_model(cfg, show_progress=False)
    assert (result.output_dir / "model.safetensors").exists()
    config = json.loads((result.output_dir / "config.json").read_text())
    assert MEAN_KEY in config and config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert 0.0 <= result.metrics["eval/reward_accuracy"] <= 1.0

    prompts, completions = ["12+30=", "sort 321="], ["42", "123"]
    rm = load_reward_model(result.output_dir, torch.device("cpu"))
    here = score(rm, load_tokenizer(result.output_dir), prompts, completions)
    code = (
        "import json, sys, torch, rlhf_core\n"
        "from rlhf_core.models.loading import load_tokenizer\n"
        "from rlhf_core.rewards.model import load_reward_model, score\n"
        f"p = {str(result.output_dir)!r}\n"
        "rm = load_reward_model(p, torch.device('cpu'))\n"
        f"print(json.dumps(score(rm, load_tokenizer(p), {prompts!r}, {completions!r})))\n"
    )
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(fresh.stdout.strip().splitlines()[-1]) == here
