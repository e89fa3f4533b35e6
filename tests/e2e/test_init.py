"""``alignflow init PATH`` for real: the scaffold's files, git and DVC, refusal to overwrite.

The real CLI in a fresh process, real ``git`` and DVC; a few seconds. The slow acceptance
test (test_init_project_slow.py) then runs flows in such a project with alignflow installed
from a built wheel.
"""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import yaml

from helpers import cli_env, git
from rlhf_core.config import SECTIONS, load_config


def _init(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = cli_env(cwd)
    env.pop("ALIGNFLOW_HOME")  # a user's shell: the project is wherever they run from
    return subprocess.run([sys.executable, "-m", "flows.cli", "init", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_init_scaffolds_a_git_and_dvc_project(tmp_path):
    proc = _init(tmp_path, "demo-project")
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / "demo-project"
    for rel in ("params.yaml", "dvc.yaml", "prefect.yaml", ".gitignore", "README.md", "data", ".dvc/config"):
        assert (root / rel).exists(), rel

    # params: every section loads through the typed configs; the DVC pipeline names only sections that exist
    for section, cls in SECTIONS.items():
        assert isinstance(load_config(cls, section, root / "params.yaml"), cls)
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert {"generate", "validate", "init_model", "sft", "dpo", "rl"} <= set(stages)
    assert "rlhf_core/" not in (root / "dvc.yaml").read_text().split("stages:", 1)[1]

    # git: a repository of its own whose first commit is the scaffold, nothing left uncommitted
    assert Path(git(root, "rev-parse", "--show-toplevel")).resolve() == root.resolve()
    assert git(root, "log", "--format=%s") == "alignflow init: project scaffold"
    committed = set(git(root, "ls-files").split())
    assert {"params.yaml", "dvc.yaml", "prefect.yaml", ".gitignore", "README.md", "data/.gitkeep",
            ".dvc/config", ".dvcignore"} <= committed
    assert git(root, "status", "--porcelain") == ""
    assert git(root, "check-ignore", "mlflow.db", ".dvc-remote/x", "models/sft/x", ".alignflow/x").count("\n") == 3

    # DVC: the default remote is .dvc-remote/ in the project, stored relative to .dvc/ (the project can move)
    config = configparser.ConfigParser()
    config.read(root / ".dvc" / "config")
    assert config["core"]["remote"] == "local"
    assert config["'remote \"local\"'"]["url"] == "../.dvc-remote"
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        assert Path(repo.cloud.get_remote().path).resolve() == (root / ".dvc-remote").resolve()
    assert str(root / ".dvc-remote") in proc.stdout and "alignflow flow align" in proc.stdout

    readme = (root / "README.md").read_text()
    assert "alignflow flow align" in readme and "alignflow flow iterative_dpo" in readme


def test_init_with_the_real_recipe_writes_a_recipe_dvc_can_run(tmp_path):
    """``--recipe real``: the recipe's dvc.yaml and params sections beside the scaffold's, its outputs ignored;
    DVC reads both pipelines (the recipe's stages run from the project's root) and every section loads."""
    proc = _init(tmp_path, "real-project", "--recipe", "real")
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / "real-project"
    assert "dvc repro recipes/real/dvc.yaml" in proc.stdout
    for section, cls in SECTIONS.items():
        assert isinstance(load_config(cls, section, root / "params.yaml"), cls)
    recipe = (root / "recipes" / "real" / "dvc.yaml").read_text()
    assert "rlhf_core/" not in recipe.split("stages:", 1)[1] and "wdir: ../.." in recipe
    assert git(root, "status", "--porcelain") == "" and "recipes/real/dvc.yaml" in git(root, "ls-files")
    assert git(root, "check-ignore", "data/real/eval.jsonl", "models/real_base/x").count("\n") == 1
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        names = {(Path(stage.path).relative_to(root).as_posix(), stage.name) for stage in repo.index.stages}
    assert {("recipes/real/dvc.yaml", "real_import"), ("recipes/real/dvc.yaml", "real_rl"), ("dvc.yaml", "sft")} <= names
    refused = _init(tmp_path, "other", "--recipe", "nope")
    assert refused.returncode == 2 and "nope" in refused.stderr and not (tmp_path / "other").exists()


def test_init_refuses_to_overwrite_and_names_the_files(tmp_path):
    root = tmp_path / "mine"
    root.mkdir()
    (root / "params.yaml").write_text("sft: {max_steps: 3}\n")
    (root / "README.md").write_text("my notes\n")
    proc = _init(tmp_path, "mine")
    assert proc.returncode == 2
    assert "params.yaml" in proc.stderr and "README.md" in proc.stderr and "--force" in proc.stderr
    assert "nothing was written" in proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["README.md", "params.yaml"]  # no git, no DVC, no files
    assert (root / "params.yaml").read_text() == "sft: {max_steps: 3}\n"

    forced = _init(tmp_path, "mine", "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "generate:" in (root / "params.yaml").read_text() and (root / ".dvc").is_dir()


def test_init_inside_an_existing_repository_makes_no_repository_and_no_commit(tmp_path):
    git(tmp_path, "init", "-q")
    proc = _init(tmp_path, "sub/project")
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / "sub" / "project"
    assert not (root / ".git").exists()
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, check=False).returncode != 0
    assert "commit the scaffold" in proc.stdout
    assert (root / ".dvc" / "config").exists()  # a DVC subdir project of the outer repository
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        assert Path(repo.root_dir).resolve() == root.resolve()


def test_a_reproduce_worktree_pulls_data_the_project_pushed(tmp_path, monkeypatch):
    """``alignflow reproduce GIT_REV`` reruns a commit in a git worktree: a file the user ``dvc add``-ed and
    pushed to the scaffold's remote (``../.dvc-remote``, relative to ``.dvc/``) must reach it, though the
    worktree has no cache of its own and that relative path points inside the worktree."""
    import shutil

    from flows.reproduce import add_worktree, remove_worktree, share_dvc_storage

    assert _init(tmp_path, "demo-project").returncode == 0
    root = tmp_path / "demo-project"
    env = cli_env(root)
    dvc = [sys.executable, "-m", "dvc"]
    (root / "data" / "mine.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    for cmd in (["add", "data/mine.jsonl"], ["push"]):
        assert subprocess.run([*dvc, *cmd], cwd=root, env=env, capture_output=True).returncode == 0, cmd
    git(root, "add", "-A")
    git(root, "commit", "-qm", "my data")
    shutil.rmtree(root / ".dvc" / "cache")  # only the remote holds the data now
    monkeypatch.chdir(root)  # reproduce runs from the project folder, as the CLI does
    worktree = tmp_path / "rerun"
    add_worktree(worktree, git(root, "rev-parse", "HEAD"))
    try:
        share_dvc_storage(worktree, root, env)
        # reproduce's pull is best effort: outputs of stages this project never ran (no dvc.lock) fail it
        proc = subprocess.run([*dvc, "pull"], cwd=worktree, env=env, capture_output=True, text=True)
        assert (worktree / "data" / "mine.jsonl").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
        assert (worktree / "data" / "mine.jsonl").read_text() == (root / "data" / "mine.jsonl").read_text()
        assert "../.dvc-remote" in (worktree / ".dvc" / "config").read_text()  # the commit's file is untouched
        assert (root / ".dvc" / "cache").is_dir()  # pulled into the project's cache, shared with the worktree
    finally:
        remove_worktree(worktree)
