"""iterative_dpo and raft flows for real: Prefect, MLflow registry aliases, git + DVC per cycle."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from helpers import git, seed_versioned_project, write_micro_params
from rlhf_core.tracking.lineage import dvc_md5

pytestmark = pytest.mark.usefixtures("prefect_server")


@pytest.fixture(scope="session")
def seeded_project(tmp_path_factory):
    """A git + DVC project (local remote) with micro data, a micro SFT model and reward model, made once per
    session (five CLI processes, about 85 s on 2 cores) and copied for each test."""
    root = tmp_path_factory.mktemp("seeded") / "project"
    root.mkdir()
    write_micro_params(root)
    seed_versioned_project(root, tmp_path_factory.mktemp("dvc-remote"))
    return root


@pytest.fixture()
def project(isolated_project, seeded_project):
    """A copy of the seeded project (git history, DVC cache and remote settings included) as this test's own
    root, with an empty MLflow store: the flows' runs are the only ones the test sees.

    The micro policy is almost always wrong, so rule scores tie and give no pairs (the gate
    then stops the flow, as it should); the reward model separates the samples."""
    shutil.copytree(seeded_project, isolated_project, symlinks=True, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("mlflow.db", "mlruns", ".prefect"))
    return isolated_project


def _client(project):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")


MICRO = {"cycles": {"cycles": 2, "scorer": "reward_model", "max_prompts": 24, "n_samples": 4, "retrain_reward": True},
         "dpo": {"max_steps": 4, "batch_size": 8, "warmup_steps": 1, "eval_items": 30},
         "raft": {"max_steps": 4, "batch_size": 8, "warmup_steps": 1, "eval_items": 30},
         "reward": {"max_steps": 3, "batch_size": 8, "warmup_steps": 1}}


def test_iterative_dpo_versions_every_cycle_and_tracks_lineage(project, chromium):
    from flows.cycles import iterative_dpo

    head_before = git(project, "rev-parse", "HEAD")
    summary = iterative_dpo(params_file="params.yaml", overrides=MICRO)
    history = summary["cycles"]
    assert [h["cycle"] for h in history] == [1, 2]
    commits = [h["commit"] for h in history]
    _assert_one_commit_per_cycle(project, head_before, commits)
    _assert_cycle_data_restores(project, commits, history)
    client = _client(project)
    exp = client.get_experiment_by_name("alignflow-test")
    cycles, dpo_runs = _assert_runs_nested(client, exp, commits)
    champion = _assert_registry_versions(client, history, dpo_runs)
    _assert_ui_shows_the_champion(project, chromium, client, exp, champion)
    _assert_cycle_data_reports(project, chromium, client, exp, cycles)


def _assert_one_commit_per_cycle(project, head_before, commits):
    """One commit per cycle, named after the flow and cycle, holding only .dvc/.gitignore files."""
    assert len(set(commits)) == 2 and head_before not in commits
    subjects = git(project, "log", "--format=%s", f"{head_before}..HEAD").splitlines()
    assert len(subjects) == 2 and "cycle 2/2" in subjects[0] and "cycle 1/2" in subjects[1]
    for c in commits:
        files = git(project, "show", "--name-only", "--format=", c).split()
        assert files and all(f.endswith((".dvc", ".gitignore")) for f in files), files
    assert any(f.endswith("reward.dvc") for f in git(project, "show", "--name-only", "--format=", commits[1]).split())



def _assert_cycle_data_restores(project, commits, history):
    # checking out cycle 1's commit restores its pairs byte for byte (from the DVC remote)
    pairs = project / "data/cycles/iterative_dpo/pairs.jsonl"
    git(project, "checkout", "-q", commits[0], "--", "data/cycles/iterative_dpo/pairs.jsonl.dvc")
    subprocess.run(["rm", "-rf", str(project / ".dvc/cache"), str(pairs)], check=True)
    from dvc.repo import Repo

    with Repo(str(project)) as repo:
        repo.pull(targets=[str(pairs)])
    assert dvc_md5(pairs) == history[0]["data_md5"]["pairs"]
    # the retrained reward model's pool holds cycle 1's pairs too (no cycle overwrote another), once each
    key = lambda r: (r["prompt"], r["chosen"], r["rejected"])  # noqa: E731
    pool = [key(json.loads(x)) for x in (project / "data/cycles/iterative_dpo/reward_pairs.jsonl").read_text().splitlines()]
    assert len(pool) == len(set(pool))
    assert {key(json.loads(x)) for x in pairs.read_text().splitlines()} <= set(pool)
    git(project, "checkout", "-q", "HEAD", "--", "data/cycles/iterative_dpo/pairs.jsonl.dvc")



def _assert_runs_nested(client, exp, commits):
    # MLflow: parent, cycles nested with their index and parent cycle, stages nested in cycles
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.info.run_name == "iterative_dpo")
    cycles = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
              and r.info.run_name.startswith("cycle-")}
    assert set(cycles) == {"cycle-1", "cycle-2"}
    assert cycles["cycle-2"].data.tags["alignflow.parent_cycle_run_id"] == cycles["cycle-1"].info.run_id
    assert cycles["cycle-1"].data.tags["git.version_commit"] == commits[0]
    dpo_runs = [r for r in runs if r.info.run_name == "dpo"]
    assert {r.data.tags["mlflow.parentRunId"] for r in dpo_runs} == {c.info.run_id for c in cycles.values()}
    assert parent.data.tags["prefect.flow_run_id"]

    return cycles, dpo_runs


def _assert_registry_versions(client, history, dpo_runs):
    # registry: each cycle a version; candidate = the last; champion = the best so far
    versions = client.search_model_versions("name='alignflow-policy'")
    assert len(versions) == 2
    candidate = client.get_model_version_by_alias("alignflow-policy", "candidate")
    champion = client.get_model_version_by_alias("alignflow-policy", "champion")
    assert str(candidate.version) == history[1]["registry"]["version"]
    best = max(history, key=lambda h: (h["accuracy"], -h["cycle"]))
    assert str(champion.version) == best["registry"]["version"]
    assert {v.run_id for v in versions} == {r.info.run_id for r in dpo_runs}
    assert "champion" in client.get_model_version("alignflow-policy", candidate.version).tags["promotion"]

    return champion


def _assert_ui_shows_the_champion(project, chromium, client, exp, champion):
    # the MLflow UI itself (headless Chromium): the champion, its source run, that run's
    # datasets and its parent (cycle) run
    from ui import mlflow_ui, page_text

    source = client.get_run(champion.run_id)
    parent_cycle = client.get_run(source.data.tags["mlflow.parentRunId"])
    with mlflow_ui(f"sqlite:///{project / 'mlflow.db'}") as url:
        model_page = page_text(chromium, f"{url}/#/models/alignflow-policy/versions/{champion.version}",
                               project / "mlflow_ui_champion.png")
        run_page = page_text(chromium, f"{url}/#/experiments/{exp.experiment_id}/runs/{champion.run_id}",
                             project / "mlflow_ui_source_run.png")
    assert f"Version {champion.version}" in model_page and "@ champion" in model_page, model_page[:3000]
    assert "Source Run : dpo" in model_page
    # its model card (the version's description): parent, data with DVC md5s, eval with paired errors, guards
    source_tags = source.data.tags
    for text in (f"Parent: {source_tags['input.model']} (DVC md5 {source_tags['dvc.md5.model']}",
                 f"preferences {source_tags['input.preferences']} {source_tags['dvc.md5.preferences']}",
                 f"eval {source_tags['input.eval']} {source_tags['dvc.md5.eval']}", "Held-out eval (30 items",
                 "accuracy", "change ± paired s.e.", "Guards (fired:", "reward_hacking", "entropy_collapse",
                 "Promotion", "promoted to champion"):
        assert text in model_page, (text, model_page[:6000])
    assert champion.run_id in run_page and f"Parent run {parent_cycle.info.run_name}" in run_page, run_page[:4000]
    pairs_digest = source.data.tags["dvc.md5.preferences"]
    assert f"preferences ({pairs_digest[:36]})" in run_page
    assert (project / "mlflow_ui_champion.png").stat().st_size > 10_000



def _assert_cycle_data_reports(project, chromium, client, exp, cycles):
    from ui import mlflow_ui, page_text

    # --- issue 20.3: each cycle run holds its data report (GX data docs as HTML), shown by the MLflow UI ---
    for name, cycle in cycles.items():
        files = [a.path for a in client.list_artifacts(cycle.info.run_id, "data_report")]
        assert f"data_report/{name}-pairs.html" in files, files
        assert cycle.data.metrics["data/near_duplicate_rate"] <= 0.05 and cycle.data.metrics["data/eval_exact_matches"] == 0
    artifact = f"{url_path(exp, cycles['cycle-2'])}/artifactPath/data_report/cycle-2-pairs.html"
    with mlflow_ui(f"sqlite:///{project / 'mlflow.db'}") as url:
        report_page = page_text(chromium, f"{url}/{artifact}", project / "mlflow_ui_data_report.png")
    assert "cycle-2" in report_page and "Artifacts" in report_page, report_page[:3000]
    assert "data_report/cycle-2-pairs.html" in report_page and "Oops" not in report_page, report_page[:3000]
    assert (project / "mlflow_ui_data_report.png").stat().st_size > 10_000


def url_path(exp, run):
    """The MLflow UI's hash route of ``run``."""
    return f"#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"


def test_raft_flow_trains_on_kept_samples(project):
    from flows.cycles import raft

    summary = raft(params_file="params.yaml", overrides={**MICRO, "cycles": {**MICRO["cycles"], "cycles": 1}})
    (h,) = summary["cycles"]
    assert h["commit"] and (project / "data/cycles/raft/kept.jsonl.dvc").exists()
    assert h["model_md5"] == dvc_md5(project / "models/cycles/raft/cycle_1")
    assert git(project, "status", "--porcelain", "--untracked-files=no") == ""
