"""Acceptance (slow) of issue 49 items 1-3, as the new user met them: ``alignflow init myproj``, TRL-format
files of their own ``dvc add``-ed and committed, a tiny SFT -> DPO ``alignflow flow align`` (5 steps each,
registered under a name of their own with ``--set cycles.registered_model=...``), then:

* ``alignflow reproduce --trust RUN_ID`` ends with ``IDENTICAL`` and exit 0 (the rerun's model folders,
  ``alignflow.json`` included, match the original's: input paths are recorded project-relative);
* after the SFT file is edited, re-added and committed, reproducing the same run id (without ``--trust``:
  the only stored difference that needs it elsewhere is a naming setting, and the store is the project's
  own SQLite file) still reads the data the run read, by md5, and is ``IDENTICAL``;
* neither reproduction registers a version or moves an alias (``MlflowClient`` before and after); each
  records its rerun on the original run (``alignflow.reproduced_by``).

Real CLI, MLflow, DVC, git and Prefect; about 5 minutes on 2 shared CPU cores (one flow, two reruns).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, git

pytestmark = pytest.mark.slow

MICRO = ["flow.stages=[dpo]", "flow.isolation=inline", "sft.max_steps=5", "dpo.max_steps=5", "sft.eval_items=20",
         "dpo.eval_items=20", "evaluate.max_items=20", "model.hidden_size=32", "model.num_layers=2",
         "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64", "model.vocab_size=280",
         "cycles.registered_model=my-policy"]
FILES = {"sft": ("--sft-file", "data/sft.jsonl"), "preferences": ("--preference-file", "data/prefs.jsonl"),
         "prompts": ("--prompts-file", "data/prompts.jsonl"), "eval": ("--eval-file", "data/eval.jsonl")}


def _alignflow(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=project, env=cli_env(project),
                          capture_output=True, text=True, timeout=900)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _registry(project: Path) -> dict[str, object]:
    """Every registered model's versions (with their source runs) and aliases."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cli_env(project)["MLFLOW_TRACKING_URI"])
    return {m.name: {"versions": sorted((v.version, v.run_id)
                                        for v in client.search_model_versions(f"name='{m.name}'")),
                     "aliases": dict(m.aliases)} for m in client.search_registered_models()}


def _own_project(tmp_path: Path) -> Path:
    """``alignflow init``, the user's own TRL-format files (the embedded task's format: prompt/completion,
    prompt/chosen/rejected, prompt/label), ``dvc add``-ed and committed."""
    from rlhf_core.embedded.tasks import generate_datasets

    _ok(subprocess.run([sys.executable, "-m", "flows.cli", "init", "myproj"], cwd=tmp_path, env=cli_env(tmp_path),
                       capture_output=True, text=True, timeout=300))
    project = tmp_path / "myproj"
    made = generate_datasets(tmp_path / "mine", seed=7, n_sft=200, n_preference=60, n_prompts=40, n_eval=40,
                             sft_noise=0.2)
    for name, (_, rel) in FILES.items():
        shutil.copy(made[name], project / rel)
    _ok(subprocess.run([sys.executable, "-m", "dvc", "add", *[rel for _, rel in FILES.values()]], cwd=project,
                       env=cli_env(project), capture_output=True, text=True))
    git(project, "add", "data")
    git(project, "-c", "user.name=u", "-c", "user.email=u@u", "commit", "-qm", "my data")
    return project


def _reproduce(project: Path, run_id: str, *extra: str) -> tuple[dict, list[str]]:
    proc = _alignflow(project, "reproduce", run_id, "--report", "reproduce-report.json", *extra)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == "IDENTICAL", proc.stdout[-4000:] + proc.stderr[-3000:]
    return json.loads((project / "reproduce-report.json").read_text()), lines


def test_reproducing_an_own_project_run_is_identical_reads_its_data_and_changes_no_registry(tmp_path):
    project = _own_project(tmp_path)
    flags = [f"{flag}={rel}" for flag, rel in FILES.values()]
    _ok(_alignflow(project, "flow", "align", *flags, *[a for s in MICRO for a in ("--set", s)]))
    run_id = json.loads((project / "metrics" / "align_summary.json").read_text())["parent_run_id"]
    recorded_md5 = {name: subprocess.run(["md5sum", rel], cwd=project, capture_output=True, text=True,
                                         check=True).stdout.split()[0] for name, (_, rel) in FILES.items()}
    registry = _registry(project)
    assert registry["my-policy"]["versions"] and registry["my-policy"]["aliases"].get("candidate")

    report, lines = _reproduce(project, run_id, "--trust")
    assert report["compared"]["weights"] == {"compared": 3, "different": 0, "ignored": 0}  # base, SFT, DPO
    assert report["compared"]["data"]["compared"] == 4 and report["compared"]["metrics"]["compared"] >= 4
    assert report["ignored"] == [] and report["differences"] == []
    assert {i["from"] for i in report["inputs"].values()} == {"the DVC cache"}
    assert "Cached" not in report["task_states"] and report["task_states"]["Completed"] >= 8
    assert "registry: 2 registered model(s), unchanged: no version registered, no alias moved" in " ".join(lines)
    assert _registry(project) == registry

    # the user edits their SFT data and commits it: the run id still means the data it ran on
    sft = project / "data" / "sft.jsonl"
    sft.write_text("".join(sft.read_text().splitlines(keepends=True)[:150]))
    _ok(subprocess.run([sys.executable, "-m", "dvc", "add", "data/sft.jsonl"], cwd=project, env=cli_env(project),
                       capture_output=True, text=True))
    git(project, "-c", "user.name=u", "-c", "user.email=u@u", "commit", "-qam", "less SFT data")
    again, lines = _reproduce(project, run_id)  # no --trust: my-policy is a name, the store this project's file
    assert "[naming setting: allowed, the store is this project's own SQLite file]" in "\n".join(lines)
    assert again["inputs"]["sft_file"]["md5"] == recorded_md5["sft"] != subprocess.run(
        ["md5sum", "data/sft.jsonl"], cwd=project, capture_output=True, text=True, check=True).stdout.split()[0]
    assert again["md5"]["rerun"]["dvc.md5.sft"] == recorded_md5["sft"]
    assert _registry(project) == registry

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cli_env(project)["MLFLOW_TRACKING_URI"])
    tags = client.get_run(run_id).data.tags
    assert tags["alignflow.reproduced_by"] == again["rerun_id"] != report["rerun_id"]
    assert tags["alignflow.reproduction"] == "IDENTICAL"
    assert client.get_run(again["rerun_id"]).data.tags["alignflow.reproduces"] == run_id
    assert "reproduction.json" in [a.path for a in client.list_artifacts(again["rerun_id"])]
    assert git(project, "worktree", "list").count("\n") == 0  # the temporary worktrees are gone
