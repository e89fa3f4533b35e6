"""Slow acceptance check of the embedded tool task (rlhf_core/rollout/tool_task.py) through the real commands.

The ``tool_*`` stages of dvc.yaml, in a fresh folder with the repository's params.yaml: generate, build
the model, SFT on the flawed demonstrator's mix of tool calls and guesses, GRPO with the calculator
environment and the rule reward, then greedy multi-turn evaluation of both models on 500 held-out items.

* after RL, arithmetic accuracy with the tool >= 0.5 (a tiny model without it: 0.02-0.09);
* RL raises both the accuracy and the tool-call rate over SFT alone by more than two standard errors
  (the binomial standard errors of the two estimates, combined).

Measured on 2 CPU cores shared with other jobs (README "Tool use", bench/results/cpu/2026-11-27/tool_task_cpu.md): about
2.5 min of SFT (500 x 128, one thread), 1 min of RL, 15 s for each evaluation; SFT-only 0.242 +- 0.019 and
after RL 0.984 +- 0.006 accuracy, tool-call rate 0.104 -> 1.000 (seed 0). Run: ``make test-slow``.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
from conftest import REPO
from helpers import cli_env, run_cli


def _module(args, project, timeout=1200):
    return subprocess.run([sys.executable, "-m", "rlhf_core.rollout.tool_task", *args], cwd=project, env=cli_env(project), check=False,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_rl_with_the_calculator_beats_sft_alone(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    steps = [("module", ["generate"]), ("cli", ["init-model", "--section", "tool_model"]),
             ("cli", ["sft", "--section", "tool_sft", "--metrics-file", "metrics/tool_sft.json"]),
             ("cli", ["rl", "--section", "tool_rl", "--metrics-file", "metrics/tool_rl.json"]),
             ("module", ["evaluate", "--model", "models/tool_sft", "--out", "metrics/tool_eval_sft.json"]),
             ("module", ["evaluate", "--model", "models/tool_rl", "--out", "metrics/tool_eval_rl.json"])]
    for kind, args in steps:
        proc = (_module(args, tmp_path) if kind == "module" else run_cli(args, tmp_path, timeout=2400))
        assert proc.returncode == 0, (args, proc.stderr[-3000:])
    sft, rl = (json.loads((tmp_path / "metrics" / f"tool_eval_{n}.json").read_text()) for n in ("sft", "rl"))
    assert rl["eval/accuracy_arithmetic_tool"] >= 0.5, rl
    for name in ("eval/accuracy_arithmetic_tool", "eval/tool_call_rate"):
        se = math.hypot(sft[f"{name}_stderr"], rl[f"{name}_stderr"])
        assert rl[name] - sft[name] > 2 * se, (name, sft[name], rl[name], se)
