"""Our md5s equal the ones DVC itself records (so MLflow digests match dvc.lock)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from rlhf_core.tracking.lineage import dvc_md5, git_commit

DVC = [sys.executable, "-m", "dvc"]


def test_md5_matches_dvc_add(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(DVC + ["init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "file.txt").write_text("hello\nworld\n")
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(bytes(range(256)))
    (folder / "sub" / "b.json").write_text('{"x": 1}\n')
    subprocess.run(DVC + ["add", "-q", "file.txt", "folder"], cwd=tmp_path, check=True)
    for name in ("file.txt", "folder"):
        recorded = yaml.safe_load((tmp_path / f"{name}.dvc").read_text())["outs"][0]["md5"]
        assert dvc_md5(tmp_path / name) == recorded


def test_git_commit_outside_repo(tmp_path):
    assert git_commit(tmp_path) == "unknown"
    assert git_commit(Path(__file__).parent) != ""


def test_untracked_files_are_marked_beside_a_dirty_tree(tmp_path, monkeypatch):
    """A run made beside files git does not know records them (``git.untracked``); ignored files do not count."""
    import subprocess

    from rlhf_core.tracking.lineage import lineage_tags

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("runs/\n")
    (tmp_path / "train.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "init")
    monkeypatch.chdir(tmp_path)
    assert "git.untracked" not in lineage_tags({}, "sft")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "log.txt").write_text("ignored\n")
    assert "git.untracked" not in lineage_tags({}, "sft")
    (tmp_path / "helper.py").write_text("y = 2\n")
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "a.jsonl").write_text("{}\n")
    tags = lineage_tags({}, "sft")
    assert tags["git.untracked"] == "2 untracked: extra/, helper.py"
    assert not tags["git.commit"].endswith("-dirty")  # untracked files alone leave the commit clean
