"""`alignflow reproduce GIT_REV` on a one-stage DVC pipeline of its own (real git, DVC and CLI; no training):
a deterministic stage is IDENTICAL, its model folder's ``alignflow.json`` naming the project's absolute path
listed as an ignored metadata difference (the folder's md5 differs, its weights do not); a stage writing
random weights is DIFFERENT, the verdict naming the weight file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, git

STAGE = '''import json, os, pathlib
random_weights = {random}
out = pathlib.Path("out/model")
out.mkdir(parents=True, exist_ok=True)
(out / "model.safetensors").write_bytes(os.urandom(64) if random_weights else bytes(range(64)))
(out / "alignflow.json").write_text(json.dumps({{"config": {{"train_file": os.path.abspath("data.txt")}}}}))
pathlib.Path("out/data.txt").write_text("rows\\n")
pathlib.Path("metrics").mkdir(exist_ok=True)
pathlib.Path("metrics/m.json").write_text(json.dumps({{"eval/accuracy": 0.5}}))
'''
DVC_YAML = """stages:
  make:
    cmd: python make.py
    deps: [make.py]
    outs: [out/model, out/data.txt]
    metrics:
      - metrics/m.json:
          cache: false
"""


def _commit_pipeline(root: Path, random_weights: bool) -> None:
    (root / "make.py").write_text(STAGE.format(random=random_weights))
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=cli_env(root), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"pipeline (random: {random_weights})")


def _reproduce(root: Path) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "reproduce", "HEAD"], cwd=root, env=cli_env(root),
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()


@pytest.fixture
def pipeline(tmp_path) -> Path:
    from dvc.repo import Repo

    root = tmp_path / "pipe"
    root.mkdir()
    git(root, "init", "-q")
    Repo.init(str(root)).close()
    (root / "dvc.yaml").write_text(DVC_YAML)
    return root


def test_a_revision_is_identical_or_different_by_what_matters(pipeline):
    _commit_pipeline(pipeline, random_weights=False)
    code, lines = _reproduce(pipeline)
    assert code == 0 and lines[-1] == "IDENTICAL", lines[-20:]
    assert "  weights:  1 model folder(s), identical" in lines
    assert "  data:     2 dataset md5(s), identical" in lines  # out/data.txt and metrics/m.json
    (ignored,) = [line for line in lines if line.startswith("  ignored ")]
    assert "make:out/model/alignflow.json config.train_file" in ignored and "project-relative" in ignored

    _commit_pipeline(pipeline, random_weights=True)
    code, lines = _reproduce(pipeline)
    assert code == 1 and lines[-1].startswith("DIFFERENT: weights make:out/model/model.safetensors: "), lines[-20:]
    assert git(pipeline, "worktree", "list").count("\n") == 0
