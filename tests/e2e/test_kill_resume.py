"""SIGKILL mid-run, then the same command again: the run resumes past step 0 and ends identical.

Real processes (``alignflow sft | dpo | rl``), killed with SIGKILL at a random moment after at
least two checkpoints were written — no handler runs, whatever was being written stays torn.
The resumed run must start at a checkpointed step > 0 and end with the weights and metrics of
an uninterrupted run with the same seed (computed in-process here).
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import cli_env
from rlhf_core.config import DPOConfig, RLConfig, SFTConfig, build_config
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.trainers.dpo import train_dpo
from rlhf_core.trainers.rl import train_rl
from rlhf_core.trainers.sft import train_sft

# Eight real training processes (killed, resumed, SIGTERMed): about 4 minutes on 2 cores; run
# with `make test-slow`. The in-process resume tests (tests/model/test_resume.py) run in `make test`.
pytestmark = pytest.mark.slow


def _sections(micro_model: Path, micro_data: dict[str, Path], project: Path) -> dict[str, dict]:
    reward = project / "length_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")
    common = dict(model_path=str(micro_model), eval_file=str(micro_data["eval"]), eval_items=20, num_threads=1,
                  warmup_steps=2, lr=3e-3)
    return {
        "sft": {**common, "train_file": str(micro_data["sft"]), "max_steps": 80, "batch_size": 16, "save_every": 4},
        "dpo": {**common, "train_file": str(micro_data["preferences"]), "max_steps": 40, "batch_size": 8,
                "save_every": 3, "beta": 0.5},
        "rl": {**common, "prompts_file": str(micro_data["prompts"]), "reward.function": f"{reward}:reward",
               "max_steps": 12, "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6,
               "batch_size": 64,
               "algorithm.mini_batch_size": 8, "eval_items": 8, "eval_at_start": False, "save_every": 2,
               "log_rollouts_every": 0},
    }


def _start(stage: str, project: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", stage, "--metrics-file", f"metrics/{stage}.json",
                             *extra],
                            cwd=project, env=cli_env(project), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _kill_after_two_checkpoints(proc: subprocess.Popen, ckpt_dir: Path, rng: random.Random) -> list[str]:
    deadline = time.time() + 300
    while len(list(ckpt_dir.glob("step-*"))) < 2:
        assert proc.poll() is None, f"the run ended before two checkpoints: {proc.communicate()[1][-2000:]}"
        assert time.time() < deadline, "no two checkpoints within 300 s"
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.3))  # a random later moment: mid-step, mid-eval or mid-save
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed; lengthen it"
    return sorted(p.name for p in ckpt_dir.glob("step-*"))


@pytest.mark.parametrize("stage", ["sft", "dpo", "rl"])
def test_sigkill_then_resume_matches_uninterrupted(stage, tmp_path, micro_model, micro_data):
    project = tmp_path / "project"
    project.mkdir()
    sections = _sections(micro_model, micro_data, project)
    (project / "params.yaml").write_text(yaml.safe_dump({stage: sections[stage],
                                                         "tracking": {"experiment": "kill", "log_model": False}}))
    cls, train = {"sft": (SFTConfig, train_sft), "dpo": (DPOConfig, train_dpo), "rl": (RLConfig, train_rl)}[stage]

    rng = random.Random()
    kept = _kill_after_two_checkpoints(_start(stage, project), project / "checkpoints" / stage, rng)
    assert not (project / "models" / stage).exists(), "a killed run leaves no output model"

    proc = _start(stage, project, "--resume")  # also the default; the flag insists on a checkpoint
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    match = re.search(r"resuming from \S+step-(\d+) \((?:step|iteration) (\d+)", err)
    assert match, err[-3000:]
    resumed_at = int(match.group(2))
    assert resumed_at > 0 and f"step-{resumed_at:07d}" in kept, (resumed_at, kept)
    print(f"{stage}: killed with checkpoints {kept}; resumed at step {resumed_at}")

    whole = train(build_config(cls, stage, {**sections[stage], "output_dir": str(tmp_path / "whole"),
                                            "checkpoint_dir": str(tmp_path / "whole-ckpt")}), show_progress=False)
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(project / "models" / stage / "model.safetensors")
    resumed_metrics = json.loads((project / "metrics" / f"{stage}.json").read_text())
    for key, value in resumed_metrics.items():
        if key.startswith("eval/"):
            assert round(whole.metrics[key], 6) == value, key  # the metrics file keeps 6 decimals
    assert not list((project / "checkpoints" / stage).glob("step-*"))


def test_sigterm_checkpoints_the_current_step_and_exits_143(tmp_path, micro_model, micro_data):
    """SIGTERM (a scheduler's polite stop) finishes the step in progress, writes its checkpoint
    (even between save_every steps) and exits 143; the next run resumes right there."""
    project = tmp_path / "project"
    project.mkdir()
    section = {**_sections(micro_model, micro_data, project)["sft"], "save_every": 1000, "max_steps": 400}
    (project / "params.yaml").write_text(yaml.safe_dump({"sft": section, "tracking": {"experiment": "term",
                                                                                     "log_model": False}}))
    proc = _start("sft", project)
    deadline = time.time() + 300
    while not (project / "checkpoints" / "sft" / ".lock").exists():  # taken as the training loop starts
        assert proc.poll() is None and time.time() < deadline, "the run ended before training started"
        time.sleep(0.05)
    time.sleep(2.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    match = re.search(r"stopped by SIGTERM after step (\d+); resume from \S+step-(\d+)", err)
    assert match and int(match.group(1)) == int(match.group(2)) > 0, err[-3000:]
    step = int(match.group(1))
    assert [p.name for p in (project / "checkpoints" / "sft").glob("step-*")] == [f"step-{step:07d}"]

    proc = _start("sft", project)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and f"(step {step} of 400)" in err, err[-3000:]
    print(f"SIGTERM after step {step}: checkpointed, exit 143, resumed at step {step}")
