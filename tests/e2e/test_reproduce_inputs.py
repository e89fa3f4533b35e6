"""`alignflow reproduce RUN_ID` reads the data the run recorded, never today's: in a real `alignflow init`
project (git + DVC), a file `dvc add`-ed, committed, then edited and committed again is put into a worktree
of the run's commit by its recorded md5, from the DVC cache or, with the cache gone, the DVC remote; an md5
held nowhere, or an outside input whose content changed, stops the reproduction before anything runs.
No training here: the end-to-end reruns are in test_reproduce_own_project_slow.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from flows.reproduce import add_worktree, dvc_cache_folder, dvc_fetcher, remove_worktree
from flows.reproduce_inputs import RecordedInput, place_inputs, recorded_inputs
from helpers import cli_env, git
from rlhf_core.tracking.lineage import cached_listing, dir_listing, dvc_md5, file_md5, restore_from_cache

V1 = '{"prompt": "1+1=", "completion": "2"}\n'
V2 = V1 + '{"prompt": "2+2=", "completion": "4"}\n'


def _dvc_add(root: Path, *paths: str) -> None:
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        repo.add([str(root / p) for p in paths])  # DVC reads a relative path against the working directory


def _commit(root: Path, message: str) -> str:
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return git(root, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """``alignflow init`` of a folder; data/sft.jsonl and a folder models/mine dvc-added and committed (V1),
    then the file edited, re-added and committed (V2). Each test runs in it, as the CLI does."""
    from flows.scaffold import init_project

    root = init_project(tmp_path_factory.mktemp("own") / "proj").root
    (root / "data" / "sft.jsonl").write_text(V1)
    (root / "models" / "mine" / "sub").mkdir(parents=True)
    (root / "models" / "mine" / "config.json").write_text('{"hidden_size": 32}')
    (root / "models" / "mine" / "sub" / "w.bin").write_bytes(b"\x00\x01" * 100)
    _dvc_add(root, "data/sft.jsonl", "models/mine")
    _commit(root, "v1")
    (root / "data" / "sft.jsonl").write_text(V2)
    _dvc_add(root, "data/sft.jsonl")
    _commit(root, "v2")
    return root


@pytest.fixture(autouse=True)
def _in_project(project, monkeypatch):
    monkeypatch.chdir(project)


def test_content_comes_back_from_the_dvc_cache_by_md5(project, tmp_path):
    cache_root = dvc_cache_folder(project) / "files" / "md5"
    folder = project / "models" / "mine"
    md5 = dvc_md5(folder, cache=False)
    assert cached_listing(cache_root, md5) == dir_listing(folder, cache=False)  # DVC's own .dir listing
    assert restore_from_cache(cache_root, md5, tmp_path / "back")
    assert dir_listing(tmp_path / "back", cache=False) == dir_listing(folder, cache=False)
    assert restore_from_cache(cache_root, file_md5(project / "data" / "sft.jsonl"), tmp_path / "sft.jsonl")
    assert (tmp_path / "sft.jsonl").read_text() == V2
    assert not restore_from_cache(cache_root, "0" * 32, tmp_path / "none") and not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="not a DVC md5"):
        restore_from_cache(cache_root, "../../etc/passwd", tmp_path / "x")


def test_a_run_reads_the_md5_it_recorded_not_todays_file(project, tmp_path):
    """The run read V1 at the first commit; the working copy and HEAD hold V2 now."""
    first = git(project, "rev-list", "--max-parents=0", "HEAD")  # the scaffold
    v1_commit = git(project, "rev-parse", "HEAD~1")
    v1_md5 = subprocess.run(["git", "show", f"{v1_commit}:data/sft.jsonl.dvc"], cwd=project, capture_output=True,
                            text=True, check=True).stdout.split("md5: ")[1].split()[0]
    assert first != v1_commit and file_md5(project / "data" / "sft.jsonl") != v1_md5
    tags = {"dvc.md5.sft": v1_md5, "dvc.md5.model_base": dvc_md5(project / "models" / "mine", cache=False)}
    # recorded once as the user typed them: an absolute path inside the project reads as project-relative
    inputs = recorded_inputs("align", {"sft_file": str(project / "data" / "sft.jsonl"), "base_model": "models/mine",
                                       "eval_file": None}, tags, project)
    assert [(i.name, i.path, i.flag) for i in inputs] == [("sft_file", "data/sft.jsonl", "--sft-file"),
                                                          ("base_model", "models/mine", "--base-model")]
    cache_root = dvc_cache_folder(project) / "files" / "md5"
    for commit in (v1_commit, git(project, "rev-parse", "HEAD")):  # at the run's commit, or a later one
        worktree = tmp_path / f"wt-{commit[:7]}"
        add_worktree(worktree, commit)
        try:
            fetch = dvc_fetcher(worktree, project, cli_env(worktree))
            sources = place_inputs(inputs, worktree, commit, cache_root, fetch)
            assert sources == {"sft_file": "the DVC cache", "base_model": "the DVC cache"}
            assert (worktree / "data" / "sft.jsonl").read_text() == V1
            assert (worktree / "models" / "mine" / "sub" / "w.bin").read_bytes() == b"\x00\x01" * 100
        finally:
            remove_worktree(worktree)
    assert (project / "data" / "sft.jsonl").read_text() == V2  # the working copy is untouched


def test_an_input_outside_the_project_is_checked_by_md5(project, tmp_path):
    outside = tmp_path / "hf-model"
    shutil.copytree(project / "models" / "mine", outside)
    recorded = RecordedInput("base_model", str(outside), dvc_md5(outside, cache=False), "--base-model")
    head = git(project, "rev-parse", "HEAD")
    assert recorded.outside
    assert place_inputs([recorded], tmp_path, head, None, lambda path: None) == \
        {"base_model": "in place, outside the project"}
    (outside / "config.json").write_text('{"hidden_size": 64}')  # the model changed since the run
    with pytest.raises(SystemExit, match="base_model .*the run read md5 .*that path now holds md5"):
        place_inputs([recorded], tmp_path, head, None, lambda path: None)


def test_with_the_cache_gone_the_remote_serves_and_an_unknown_md5_stops(project, tmp_path):
    """Last in this module: it empties the project's cache."""
    from dvc.repo import Repo

    with Repo(str(project)) as repo:
        repo.push()
    shutil.rmtree(project / ".dvc" / "cache")
    head = git(project, "rev-parse", "HEAD")
    v2 = RecordedInput("sft_file", "data/sft.jsonl", file_md5(project / "data" / "sft.jsonl"), "--sft-file")
    worktree = tmp_path / "wt"
    add_worktree(worktree, head)
    try:
        fetch = dvc_fetcher(worktree, project, cli_env(worktree))
        cache_root = dvc_cache_folder(project) / "files" / "md5"
        assert place_inputs([v2], worktree, head, cache_root, fetch) == {"sft_file": "the DVC remote"}
        assert (worktree / "data" / "sft.jsonl").read_text() == V2
        lost = RecordedInput("sft_file", "data/sft.jsonl", "f" * 32, "--sft-file")
        refused = r"input sft_file \(data/sft.jsonl\): the run read md5 f{32}.*nothing was rerun"
        with pytest.raises(SystemExit, match=refused):
            place_inputs([lost], worktree, head, cache_root, fetch)
    finally:
        remove_worktree(worktree)
