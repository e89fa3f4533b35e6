"""The offline-alignment commands through the real CLI on a micro project: reward, dpo, rejection."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli, write_micro_params


@pytest.fixture()
def sft_project(tmp_path):
    write_micro_params(tmp_path)
    for cmd in (["generate"], ["init-model"], ["sft", "--set", "max_steps=10"]):
        proc = run_cli(cmd, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path


@pytest.mark.slow  # an SFT run and three stage commands (about 80 s): the default tier runs `alignflow dpo`
# through test_stage_data_report and test_unlabelled_gate
def test_reward_dpo_rejection_commands(sft_project):
    proc = run_cli(["reward", "--set", "max_steps=10", "--set", "batch_size=16",
                    "--metrics-file", "metrics/reward.json"], sft_project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/reward_accuracy" in json.loads((sft_project / "metrics/reward.json").read_text())
    assert (sft_project / "models/reward/config.json").exists()

    proc = run_cli(["dpo", "--set", "max_steps=5", "--set", "batch_size=8", "--set", "eval_items=20"], sft_project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (sft_project / "models/dpo/model.safetensors").exists()

    proc = run_cli(["rejection", "--set", "max_prompts=10"], sft_project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = (sft_project / "data/rejection/best.jsonl").read_text().splitlines()
    assert 0 < len(best) <= 10

    proc = run_cli(["dpo", "--set", "loss=kto"], sft_project)
    assert proc.returncode == 2 and "dpo.loss: must be dpo, ipo or cdpo" in proc.stderr
