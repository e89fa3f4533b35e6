"""Reproduce on another machine: a run on the team services (``alignflow services up``) from project clone A, its
data versioned with DVC and pushed to the object-store remote, is reproduced from clone B, a fresh ``git clone`` of A
with an empty DVC cache and no data. ``alignflow reproduce --profile team RUN_ID`` in B checks out the run's commit,
fetches each input from the remote in the object store (the team profile's ``.dvc/config.local``, per machine,
reaches the worktree), reruns the flow and reports IDENTICAL.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import cli_env, git, team_clone, team_section

pytestmark = pytest.mark.slow

DATA = ("sft", "preferences", "prompts", "eval")
FLAGS = {"sft": "--sft-file", "preferences": "--preference-file", "prompts": "--prompts-file", "eval": "--eval-file"}


def _env(project: Path, home: Path, **extra: str) -> dict[str, str]:
    env = {**cli_env(project), "HOME": str(home), "PREFECT_HOME": str(project / ".prefect"),
           "OMP_WAIT_POLICY": "PASSIVE", **extra}
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):  # the profile names the servers
        env.pop(name, None)
    return env


def _run(argv: list[str], project: Path, home: Path, timeout: int = 1800, **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=project, env=_env(project, home, **extra), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (argv, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def _credentials(home: Path) -> dict[str, str]:
    path = home / ".config" / "alignflow" / "team.env"
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def _versioned_clone(base: Path, team: dict) -> Path:
    """Clone A: micro params (one alignment stage), a git repository whose data is DVC-tracked, not in git."""
    project = team_clone(base, "a", team)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["flow"]["stages"] = ["dpo"]  # one alignment stage is enough to show the mechanism
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/models/\n/metrics/\n/reports/\n/checkpoints/\n"
                                        "/.prefect/\n/.alignflow/\n__pycache__/\n")
    git(project, "config", "user.name", "Test User")
    git(project, "config", "user.email", "test@example.com")
    return project


def test_a_fresh_clone_reproduces_a_team_run_from_the_object_store(team_base):
    home = team_base / "home"
    home.mkdir()
    team = team_section(team_base)
    a = _versioned_clone(team_base, team)
    cli = [sys.executable, "-m", "flows.cli"]
    dvc = [sys.executable, "-m", "dvc"]
    _run([*cli, "services", "up"], a, home)
    try:
        _run([*cli, "generate", "--profile", "team"], a, home)
        (a / "data" / "team").mkdir()
        for name in DATA:  # a team's own data (data/embedded is the generate stage's output in dvc.yaml)
            shutil.copyfile(a / "data" / "embedded" / f"{name}.jsonl", a / "data" / "team" / f"{name}.jsonl")
        files = [f"data/team/{name}.jsonl" for name in DATA]
        _run([*dvc, "add", *files], a, home)
        git(a, "add", "-A")
        git(a, "commit", "-q", "-m", "project and its data, versioned by DVC")
        flags = [arg for name in DATA for arg in (FLAGS[name], f"data/team/{name}.jsonl")]
        _run([*cli, "flow", "align", "--profile", "team", *flags], a, home)
        run_id = json.loads((a / "metrics" / "align_summary.json").read_text())["parent_run_id"]
        _run([*dvc, "push"], a, home, **_credentials(home))  # to the team remote the profile wrote

        b = team_base / "b"
        subprocess.run(["git", "clone", "-q", str(a), str(b)], check=True)
        assert not (b / "data" / "team" / "sft.jsonl").exists() and not (b / ".dvc" / "cache").exists()
        again = _run([*cli, "reproduce", "--profile", "team", run_id, "--report", "report.json"], b, home)
        print(again.stdout)
        report = json.loads((b / "report.json").read_text())
        assert report["identical"] and not report["differences"], report["differences"]
        assert report["commit"] == git(a, "rev-parse", "HEAD")
        for flag in ("sft_file", "preference_file", "prompts_file", "eval_file"):  # reproduce.json's input names
            assert report["inputs"][flag]["from"] == "the DVC remote", report["inputs"]
        assert again.stdout.strip().splitlines()[-1] == "IDENTICAL"
    finally:
        subprocess.run([*cli, "services", "down"], cwd=a, env=_env(a, home), capture_output=True, timeout=300)
