"""Versioning with real git and DVC: per-cycle commits, exact restores, user changes untouched, a lock."""

from __future__ import annotations

import logging
import subprocess
import threading
import time

import pytest

from rlhf_core.tracking.lineage import file_md5
from tasks.versioning import LOCK_FILE, acquire_lock, version_paths


def _git(root, *args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture()
def project(tmp_path):
    from dvc.repo import Repo

    root = tmp_path / "proj"
    root.mkdir()
    _git(root, "init", "-q")
    _git(root, "config", "user.name", "Test User")
    _git(root, "config", "user.email", "test@example.com")
    Repo.init(str(root)).close()
    (root / ".dvc" / "config").write_text(f"[core]\n    remote = local\n['remote \"local\"']\n    url = {tmp_path / 'remote'}\n")
    (root / ".gitignore").write_text(".alignflow/\n")
    (root / "notes.txt").write_text("v1\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "init")
    return root


def test_each_cycle_is_a_commit_that_restores_its_data_exactly(project, tmp_path):
    data = project / "data" / "cycles"
    data.mkdir(parents=True)
    pairs = data / "pairs.jsonl"
    # A user's own work in progress: one staged file, one modified tracked file.
    (project / "staged.txt").write_text("mine\n")
    _git(project, "add", "staged.txt")
    (project / "notes.txt").write_text("v2, not for the pipeline to commit\n")

    commits, md5s = [], []
    for cycle in (1, 2, 3):
        pairs.write_text(f'{{"prompt": "p", "chosen": "a{cycle}", "rejected": "b"}}\n')
        md5s.append(file_md5(pairs))
        v = version_paths(project, ["data/cycles/pairs.jsonl"], f"iterative_dpo run-x cycle {cycle}")
        assert v.committed and v.md5["data/cycles/pairs.jsonl"] == md5s[-1]
        commits.append(v.commit)
    assert len(set(commits)) == 3
    assert _git(project, "log", "-1", "--format=%s") == "iterative_dpo run-x cycle 3"
    for c in commits:  # only the .dvc file and DVC's .gitignore are in each commit
        assert set(_git(project, "show", "--name-only", "--format=", c).split()) <= {
            "data/cycles/pairs.jsonl.dvc", "data/cycles/.gitignore"}
    status = _git(project, "status", "--porcelain")
    assert "A  staged.txt" in status and "M notes.txt" in status  # user changes untouched, not committed
    assert _git(project, "diff", "--name-only") == "notes.txt"

    # unchanged content: nothing new to commit
    again = version_paths(project, ["data/cycles/pairs.jsonl"], "iterative_dpo run-x cycle 3 again")
    assert not again.committed and again.commit == commits[-1]

    # restore cycle 2 exactly, from git + the DVC remote (local cache emptied first)
    _git(project, "checkout", "-q", commits[1], "--", "data/cycles/pairs.jsonl.dvc")
    subprocess.run(["rm", "-rf", str(project / ".dvc" / "cache"), str(pairs)], check=True)
    from dvc.repo import Repo

    with Repo(str(project)) as repo:
        repo.pull(targets=[str(pairs)])
    assert file_md5(pairs) == md5s[1]


def test_a_second_writer_waits_on_the_lock(project, caplog):
    (project / "a.jsonl").write_text('{"x": 1}\n')
    held = acquire_lock(project, 5, "test")
    done = {}

    def second():
        done["v"] = version_paths(project, ["a.jsonl"], "second writer", push=False, lock_timeout_s=30)

    with caplog.at_level(logging.WARNING, logger="tasks.versioning"):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(1.0)
        assert "v" not in done  # blocked while the first holds the lock
        held.release()
        thread.join(timeout=60)
    assert done["v"].committed
    assert "another flow is versioning" in caplog.text and str(LOCK_FILE) in caplog.text


def test_missing_path_is_a_clear_error(project):
    from tasks.versioning import VersioningError

    with pytest.raises(VersioningError, match="missing path"):
        version_paths(project, ["nope.jsonl"], "x", push=False)


def test_a_failed_push_commits_nothing_and_a_retry_pushes_then_commits(project, tmp_path):
    """The DVC remote's URL names a regular file, so DVC cannot create its folders there (as root
    too, unlike a chmod): the push fails, HEAD and the index stay as they were, the error names the
    push step. With the remote fixed, the same call pushes and then commits."""
    from dvc.repo import Repo

    from tasks.versioning import VersioningError

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the remote's folder should be\n")
    config = project / ".dvc" / "config"
    good = config.read_text()
    config.write_text(good.replace(str(tmp_path / "remote"), str(blocker / "remote")))
    (project / "pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    head = _git(project, "rev-parse", "HEAD")

    with pytest.raises(VersioningError, match=r"dvc push of \['pairs.jsonl'\] to the DVC remote failed, so "
                                              r"nothing was committed"):
        version_paths(project, ["pairs.jsonl"], "cycle 1")
    assert _git(project, "rev-parse", "HEAD") == head
    assert _git(project, "diff", "--cached", "--name-only") == ""  # nothing staged either
    assert not (tmp_path / "remote").exists()

    config.write_text(good)
    v = version_paths(project, ["pairs.jsonl"], "cycle 1")
    assert v.committed and v.commit != head
    assert set(_git(project, "show", "--name-only", "--format=", v.commit).split()) == {"pairs.jsonl.dvc",
                                                                                         ".gitignore"}
    with Repo(str(project)) as repo:  # the remote holds exactly what the commit names
        assert repo.status(cloud=True, targets=[str(project / "pairs.jsonl")]) == {}
