"""Reproduce from a commit for real: an align run in a git project, then `alignflow reproduce RUN_ID`
reruns every stage from that commit with no cache hit and finds identical metrics and md5s."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from helpers import cli_env
from test_dvc import _fresh_copy


def _git(root, *args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def test_reproduce_a_flow_run_from_its_commit(tmp_path):
    project = _fresh_copy(tmp_path / "proj")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["flow"]["stages"] = ["dpo"]  # one alignment stage is enough to show the mechanism
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/models/\n/metrics/\n/data/\n/reports/\n"
                                        "/checkpoints/\n/.prefect/\n/.alignflow/\n__pycache__/\n")
    _git(project, "add", "-A")
    _git(project, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "project at a commit")
    env = {**cli_env(project), "PYTHONPATH": str(project), "OMP_WAIT_POLICY": "PASSIVE"}

    first = subprocess.run([sys.executable, "-m", "flows.cli", "flow", "align"], cwd=project, env=env,
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = json.loads((project / "metrics/align_summary.json").read_text())["parent_run_id"]

    again = subprocess.run([sys.executable, "-m", "flows.cli", "reproduce", run_id, "--report", "report.json"],
                           cwd=project, env=env, capture_output=True, text=True, timeout=900)
    print(again.stdout)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    report = json.loads((project / "report.json").read_text())
    assert report["identical"] and not report["differences"]
    assert report["commit"] == _git(project, "rev-parse", "HEAD")
    assert report["md5"]["original"]["dvc.md5.model_sft"] == report["md5"]["rerun"]["dvc.md5.model_sft"]
    assert "eval/accuracy_dpo" in report["metrics"]["rerun"]
    states = report["task_states"]
    assert states.get("Completed", 0) >= 8 and "Cached" not in states, states  # every task executed
    assert "identical" in again.stdout
    assert _git(project, "worktree", "list").count("\n") == 0  # the temporary worktree is gone
