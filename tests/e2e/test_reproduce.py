"""Reproduce from a commit for real: an align run in a git project, then `alignflow reproduce RUN_ID`
reruns every stage from that commit with no cache hit and finds identical metrics and md5s.

And reproduce trusts nothing from the tracking store: a tampered ``reproduce.json`` (a reward
function in another file, an output folder outside the project) or ``git.commit`` tag is
refused before anything runs — real MLflow sqlite store, real git worktrees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.reproduce import version_warning
from flows.reproduce_trust import enforce, review_config
from helpers import cli_env, copy_project


def _git(root, *args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def committed_project(tmp_path_factory) -> Path:
    """A fresh copy of the project (micro params, one alignment stage) committed to its own git repository."""
    project = copy_project(tmp_path_factory.mktemp("proj"))
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["flow"]["stages"] = ["dpo"]  # one alignment stage is enough to show the mechanism
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/models/\n/metrics/\n/data/\n/reports/\n"
                                        "/checkpoints/\n/.prefect/\n/.alignflow/\n__pycache__/\n")
    _git(project, "add", "-A")
    _git(project, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "project at a commit")
    return project


def _env(project):
    return {**cli_env(project), "PYTHONPATH": str(project), "OMP_WAIT_POLICY": "PASSIVE"}


def _reproduce(project, *args):
    return subprocess.run([sys.executable, "-m", "flows.cli", "reproduce", *args], cwd=project, env=_env(project),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # 57 s: `make test` stays under 20 minutes (the refusals below keep the default tier's coverage)
def test_reproduce_a_flow_run_from_its_commit(committed_project):
    project = committed_project
    env = _env(project)

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
    assert report["config_differences"] == [] and "config: reproduce.json equals params.yaml" in again.stdout
    assert report["commit"] == _git(project, "rev-parse", "HEAD")
    assert report["md5"]["original"]["dvc.md5.model_sft"] == report["md5"]["rerun"]["dvc.md5.model_sft"]
    assert "eval/accuracy_dpo" in report["metrics"]["rerun"]
    states = report["task_states"]
    assert states.get("Completed", 0) >= 8 and "Cached" not in states, states  # every task executed
    assert again.stdout.strip().splitlines()[-1] == "IDENTICAL"
    assert report["registry"]["before"] == report["registry"]["after"]  # the rerun registered nothing
    assert _git(project, "worktree", "list").count("\n") == 0  # the temporary worktree is gone


# --------------------------------------------------------------------------------------
# A tracking store that lies
# --------------------------------------------------------------------------------------


def _commit_params(project: Path) -> dict:
    """What an align run at this commit logs as reproduce.json's params: every section, defaults filled in."""
    from rlhf_core.config import SECTIONS, config_to_dict, load_config

    return {s: config_to_dict(load_config(cls, s, project / "params.yaml")) for s, cls in SECTIONS.items()}


def _stored_run(project: Path, params: dict, commit: str) -> str:
    """An MLflow run in the project's sqlite store tagged with ``commit`` and carrying ``params`` as
    its reproduce.json, as an align run logs them (and as anyone with write access could rewrite them)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=cli_env(project)["MLFLOW_TRACKING_URI"])
    name = "reproduce-tampered"
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        name, artifact_location=(project / "mlartifacts").resolve().as_uri())
    run_id = client.create_run(exp_id, tags={"git.commit": commit}).info.run_id
    client.log_dict(run_id, {"flow": "align", "params": params, "inputs": {}}, "reproduce.json")
    client.set_terminated(run_id)
    return run_id


def test_a_tampered_reproduce_json_is_refused_before_anything_runs(committed_project, tmp_path):
    """Reward function pointed at another file, sft.output_dir at a folder outside the project: refused
    without --trust (both listed); with --trust the code change passes but the escaping output path is still
    refused. Neither run executes the reward file nor touches the folder."""
    project = committed_project
    evil, marker, precious = tmp_path / "evil.py", tmp_path / "executed", tmp_path / "precious"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef reward(prompts, completions, labels):\n"
                    "    return [0.0] * len(completions)\n")
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    stored = _commit_params(project)
    stored["flow"]["stages"] = ["rl"]
    stored["rl"]["reward"]["function"] = f"{evil}:reward"
    stored["rl"]["max_steps"] = 3  # an ordinary difference: shown, allowed
    stored["sft"]["output_dir"] = str(precious)
    run_id = _stored_run(project, stored, _git(project, "rev-parse", "HEAD"))

    refused = _reproduce(project, run_id)
    assert refused.returncode != 0
    assert "rl.max_steps: 3 (stored) vs 2 (commit)" in refused.stdout  # the user always sees the difference
    assert f'rl.reward.function: "{evil}:reward" (stored)' in refused.stdout
    assert "rl.reward.function" in refused.stderr and "[code" in refused.stderr
    assert "sft.output_dir" in refused.stderr and "--trust" in refused.stderr
    assert "rl.max_steps" not in refused.stderr

    trusted = _reproduce(project, run_id, "--trust")
    assert trusted.returncode != 0
    assert "sft.output_dir" in trusted.stderr and "even with --trust" in trusted.stderr
    assert "rl.reward.function" not in trusted.stderr  # trusted: only the escape is refused

    assert not marker.exists()  # the tampered reward file never ran
    assert (precious / "keep.txt").read_text() == "mine"  # nor was the folder removed
    assert _git(project, "worktree", "list").count("\n") == 0  # the temporary worktrees are gone


def test_a_revision_starting_with_a_dash_is_a_revision_not_an_option(committed_project):
    """Both ways a revision reaches git: a user's git rev after '--', and a run's git.commit tag."""
    project = committed_project
    as_rev = _reproduce(project, "--", "--show-toplevel")
    assert as_rev.returncode != 0
    assert "revision '--show-toplevel' is not a commit of this repository" in as_rev.stderr
    assert str(project) not in as_rev.stdout  # git never ran it as `rev-parse --show-toplevel`

    tagged = _reproduce(project, _stored_run(project, _commit_params(project), "--orphan=x"))
    assert tagged.returncode != 0
    assert "git.commit tag '--orphan=x' is not a commit sha" in tagged.stderr
    unknown = _reproduce(project, _stored_run(project, _commit_params(project), "0123abcd" * 5))
    assert unknown.returncode != 0 and "is not a commit of this repository" in unknown.stderr
    assert _git(project, "worktree", "list").count("\n") == 0


def test_review_refuses_code_urls_tracking_and_escaping_outputs(tmp_path):
    """The check itself, on a stored dict against a commit's: which differences pass, which need --trust,
    which never pass."""
    worktree, outside = tmp_path / "worktree", tmp_path / "outside"
    worktree.mkdir(), outside.mkdir()
    commit = {"rl": {"reward": {"function": "rlhf_core/embedded/reward.py:reward", "url": ""}, "max_steps": 2,
                     "lr": 3e-4, "rollout": {"max_new_tokens": 12}, "output_dir": "models/rl",
                     "model_path": "models/sft"},
              "tracking": {"experiment": "alignflow"}, "flow": {"ray_address": ""}}

    def review(**changes):
        stored = json.loads(json.dumps(commit))
        for key, value in changes.items():
            section, field = key.split("__")
            stored[section][field] = value
        return review_config(stored, commit, worktree)

    ordinary = review(**{"rl__max_steps": 5, "rl__lr": 1e-3,
                         "rl__rollout.max_new_tokens": 16})  # as `--set` at the time would
    assert len(ordinary.differences) == 3 and not ordinary.untrusted and not ordinary.escapes
    assert "rl.max_steps: 5 (stored) vs 2 (commit)" in ordinary.differences
    enforce(ordinary, trust=False, worktree=worktree)  # allowed, no --trust needed

    for key, value, reason in (("rl__reward.function", "other.py:reward", "code"),
                               ("rl__reward.url", "https://rm.example/score?token=s3cr3t-value", "URL"),
                               ("flow__ray_address", "10.0.0.9:6379", "network"),
                               ("tracking__experiment", "elsewhere", "tracking"),
                               ("rl__output_dir", "models/rl2", "output path"),
                               ("rl__model_path", str(outside), "outside the worktree")):
        r = review(**{key: value})
        assert len(r.untrusted) == 1 and reason in r.untrusted[0], (key, r.untrusted)
        assert "s3cr3t" not in r.untrusted[0]  # shown, but redacted
        with pytest.raises(SystemExit, match=key.replace("__", ".")):
            enforce(r, trust=False, worktree=worktree)
        enforce(r, trust=True, worktree=worktree)  # --trust accepts it

    (worktree / "models").symlink_to(outside)  # inside by name, outside once resolved
    for escaping in (str(outside / "rl"), "../outside/rl", "models/../../outside", "models/rl"):
        r = review(rl__output_dir=escaping)
        assert len(r.escapes) == 1, escaping
        with pytest.raises(SystemExit, match="refused even with --trust"):
            enforce(r, trust=True, worktree=worktree)


def test_a_run_of_another_alignflow_version_is_rerun_with_a_warning():
    """A project's commits hold no alignflow code: the run's alignflow.version tag says which ran."""
    from rlhf_core.tracking.lineage import package_version

    assert version_warning("r1", {"alignflow.version": package_version()}) == []
    assert version_warning("r1", {}) == []  # a run from before the tag existed
    (warning,) = version_warning("r1", {"alignflow.version": "0.0.1"})
    assert "alignflow 0.0.1" in warning and f"installed alignflow is {package_version()}" in warning
