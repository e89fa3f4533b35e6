"""``alignflow gc`` on a month of simulated nightly runs: real MLflow (sqlite store, artifacts, registry, logged
models), real git commits dated a night apart, real DVC (cache and a local remote), the real CLI.

Each night commits new data and a new model folder (DVC-tracked: 3 objects), pushes them, and records a flow run
(a root run with an sft and a dpo stage run, each with an artifact), registers the dpo run's model and may leave a
checkpoint folder. Night 5's version is the champion: its flow run, night 4's flow run (named by its
``alignflow.sft_run_id`` tag), night 5's commit and an object only its ``dvc.md5`` tag names must all survive;
night 2's flow run is tagged ``alignflow.keep``. With keep_runs 10 and keep_days 7, nights 21-30 are kept by count.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from helpers import run_cli

NIGHTS = 30
CHAMPION_NIGHT, LINEAGE_NIGHT, KEPT_NIGHT = 5, 4, 2
LOGGED_MODEL_NIGHTS = (1, 3, CHAMPION_NIGHT)
CHECKPOINT_NIGHTS = tuple(range(1, NIGHTS + 1, 3))
NAME = "policy"


def _git(project: Path, *args: str, when: datetime | None = None) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@x"}
    if when:
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = when.isoformat()
    return subprocess.run(["git", *args], cwd=project, env=env, check=True, capture_output=True, text=True).stdout


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _cache_has(project: Path, md5: str) -> bool:
    return (project / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]).is_file()


def _init_project(project: Path, remote: Path) -> None:
    (project / "params.yaml").write_text(yaml.safe_dump({"tracking": {"experiment": "gc-test"}}))
    (project / ".gitignore").write_text("mlflow.db\nmlartifacts/\ncheckpoints/\n.alignflow/\n")
    _git(project, "init", "-q")
    subprocess.run(["dvc", "init", "-q"], cwd=project, check=True)
    subprocess.run(["dvc", "config", "core.analytics", "false"], cwd=project, check=True)
    subprocess.run(["dvc", "remote", "add", "-d", "store", str(remote)], cwd=project, check=True)
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "init", when=datetime.now(timezone.utc) - timedelta(days=NIGHTS + 1))


def _night_data(project: Path, repo, night: int, when: datetime) -> tuple[str, dict[str, str]]:
    """Commit night ``night``'s data and model with DVC; returns the commit and the md5s."""
    (project / "data").mkdir(exist_ok=True)
    (project / "data" / "prompts.jsonl").write_text(f'{{"prompt": "night {night}"}}\n')
    (project / "models" / "policy").mkdir(parents=True, exist_ok=True)
    (project / "models" / "policy" / "weights.bin").write_bytes(bytes([night]) * 2048)
    repo.add(["data/prompts.jsonl", "models/policy"])
    md5s = {"input_prompts": yaml.safe_load((project / "data/prompts.jsonl.dvc").read_text())["outs"][0]["md5"],
            "output_model": yaml.safe_load((project / "models/policy.dvc").read_text())["outs"][0]["md5"]}
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", f"night {night}", when=when)
    return _git(project, "rev-parse", "HEAD").strip(), md5s


def _night_runs(client, exp: str, night: int, when: datetime, commit: str, md5s: dict[str, str],
                sft_of: dict[int, str]) -> str:
    """The night's flow run (root, sft, dpo with artifacts) and a registered version; returns the version."""
    ms = int(when.timestamp() * 1000)
    root = client.create_run(exp, start_time=ms, run_name=f"align-night-{night}",
                             tags={"git.commit": commit, **({"alignflow.keep": "true"} if night == KEPT_NIGHT else {})})
    ids = {}
    for offset, stage in enumerate(("sft", "dpo")):
        tags = {"mlflow.parentRunId": root.info.run_id, "git.commit": commit, "alignflow.stage": stage,
                **{f"dvc.md5.{k}": v for k, v in md5s.items()}}
        if stage == "dpo" and night == CHAMPION_NIGHT:
            tags["alignflow.sft_run_id"] = sft_of[LINEAGE_NIGHT]
        run = client.create_run(exp, start_time=ms + offset + 1, run_name=stage, tags=tags)
        client.log_text(run.info.run_id, f"{stage} night {night}\n" * 200, "model/weights.txt")
        client.set_terminated(run.info.run_id, end_time=ms + 60_000)
        ids[stage] = run.info.run_id
    sft_of[night] = ids["sft"]
    client.set_terminated(root.info.run_id, end_time=ms + 120_000)
    dpo = client.get_run(ids["dpo"])
    if night in LOGGED_MODEL_NIGHTS:
        model = client.create_logged_model(exp, name="model", source_run_id=ids["dpo"])
        client.log_model_artifacts(model.model_id, str(Path(os.getcwd()) / "models" / "policy"))
        return client.create_model_version(NAME, f"models:/{model.model_id}", run_id=ids["dpo"],
                                           model_id=model.model_id).version
    return client.create_model_version(NAME, f"{dpo.info.artifact_uri}/model", run_id=ids["dpo"],
                                       tags={"dvc.md5": md5s["output_model"]}).version


def _checkpoint(project: Path, night: int, when: datetime) -> None:
    step = project / "checkpoints" / f"sft_{night}" / "step-0000010"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"\0" * 4096)
    os.utime(step, (when.timestamp(), when.timestamp()))


def _lineage_only_object(project: Path, repo) -> str:
    """An object in the DVC cache that no commit refers to (added, then its .dvc file dropped uncommitted)."""
    (project / "extra.jsonl").write_text('{"prompt": "held-out, champion only"}\n')
    repo.add(["extra.jsonl"])
    md5 = yaml.safe_load((project / "extra.jsonl.dvc").read_text())["outs"][0]["md5"]
    (project / "extra.jsonl.dvc").unlink()
    (project / "extra.jsonl").unlink()
    (project / ".gitignore").write_text((project / ".gitignore").read_text().replace("/extra.jsonl\n", ""))
    return md5


@pytest.fixture()
def month(isolated_project, tmp_path_factory):
    """(project, facts) after 30 simulated nights: the champion's version, runs and md5s."""
    import mlflow
    from dvc.repo import Repo
    from mlflow import MlflowClient

    project = isolated_project
    _init_project(project, tmp_path_factory.mktemp("remote"))
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    # create_model_version looks a models:/ source up through MLflow's process-wide tracking URI, which an
    # earlier test in this process may have set to its own store (as the pipeline's stages do).
    mlflow.set_tracking_uri(uri)
    exp = client.create_experiment("gc-test", artifact_location=(project / "mlartifacts").as_uri())
    client.create_registered_model(NAME)
    now = datetime.now(timezone.utc)
    facts: dict = {"sft_of": {}, "versions": {}, "md5s": {}, "commits": {}}
    with Repo(str(project)) as repo:
        for night in range(1, NIGHTS + 1):
            when = now - timedelta(days=NIGHTS - night, hours=1)
            commit, md5s = _night_data(project, repo, night, when)
            if night == CHAMPION_NIGHT:
                md5s["input_extra"] = facts["extra_md5"] = _lineage_only_object(project, repo)
            facts["versions"][night] = _night_runs(client, exp, night, when, commit, md5s, facts["sft_of"])
            facts["md5s"][night], facts["commits"][night] = md5s, commit
            if night in CHECKPOINT_NIGHTS:
                _checkpoint(project, night, when)
        repo.push(all_commits=True)  # every night's objects; the champion-only object is in the cache alone
    client.set_registered_model_alias(NAME, "champion", facts["versions"][CHAMPION_NIGHT])
    return project, facts, client


def _gc(project: Path, *args: str) -> dict:
    proc = run_cli(["gc", "--json", *args], project, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("{"), proc.stdout[:2000] + proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _sizes(project: Path) -> dict[str, int]:
    return {"mlflow.db": (project / "mlflow.db").stat().st_size, "mlartifacts": _bytes(project / "mlartifacts"),
            "dvc_cache": _bytes(project / ".dvc" / "cache"), "checkpoints": _bytes(project / "checkpoints")}


def test_a_month_of_nights_is_collected_keeping_the_champion_its_lineage_and_kept_runs(month):
    project, facts, client = month
    before = _sizes(project)
    runs_before = len(client.search_runs([client.get_experiment_by_name("gc-test").experiment_id], max_results=1000))

    dry = _gc(project, "--set", "retention.dvc_cloud=true")
    assert not dry["applied"] and _sizes(project) == before  # a dry run deletes nothing
    applied = _gc(project, "--apply", "--set", "retention.dvc_cloud=true")
    assert applied["counts"] == dry["counts"]
    kept_nights = {CHAMPION_NIGHT, LINEAGE_NIGHT, KEPT_NIGHT, *range(NIGHTS - 9, NIGHTS + 1)}
    gone_nights = NIGHTS - len(kept_nights)
    assert applied["counts"] == {"runs": 3 * gone_nights, "versions": gone_nights, "logged_models": 2,
                                 "checkpoints": len([n for n in CHECKPOINT_NIGHTS if n <= NIGHTS - 7]),
                                 "dvc_cache": 3 * gone_nights, "dvc_remote": 3 * gone_nights}, applied["counts"]

    # The champion, its lineage (night 4's sft run by tag) and the kept night survive, with their files.
    exp = client.get_experiment_by_name("gc-test").experiment_id
    names = {r.info.run_name for r in client.search_runs([exp], max_results=1000) if r.info.run_name.startswith("align")}
    assert names == {f"align-night-{n}" for n in kept_nights}
    champion = client.get_model_version_by_alias(NAME, "champion")
    assert champion.version == facts["versions"][CHAMPION_NIGHT]
    model = client.get_logged_model(champion.source.removeprefix("models:/"))
    assert list(Path(model.artifact_location.removeprefix("file://")).rglob("weights.bin"))
    assert client.get_run(facts["sft_of"][LINEAGE_NIGHT]).info.lifecycle_stage == "active"
    for night in (CHAMPION_NIGHT, LINEAGE_NIGHT, KEPT_NIGHT):
        assert all(_cache_has(project, md5) for md5 in facts["md5s"][night].values()), night
    assert _cache_has(project, facts["extra_md5"])  # named only by the champion run's tag
    for night in (1, 3, 6, 20):
        assert not _cache_has(project, facts["md5s"][night]["input_prompts"]), night
    checkout = subprocess.run(["dvc", "checkout", "-q"], cwd=project, capture_output=True, text=True)
    assert checkout.returncode == 0, checkout.stderr  # the workspace's objects are all there

    after = _sizes(project)
    print(f"\nruns {runs_before} -> {runs_before - applied['counts']['runs']}; sizes before {before}, after {after}")
    assert after["mlartifacts"] < before["mlartifacts"] and after["dvc_cache"] < before["dvc_cache"]

    again = _gc(project, "--apply", "--set", "retention.dvc_cloud=true")
    assert not any(again["counts"].values()), again["counts"]


def test_gc_refuses_while_a_flow_of_the_project_runs(month):
    from filelock import FileLock

    project, _, _ = month
    lock = FileLock(str(project / ".alignflow" / "flow.lock"))
    (project / ".alignflow").mkdir(exist_ok=True)
    with lock:
        proc = run_cli(["gc", "--apply"], project, timeout=300)
    assert proc.returncode == 2 and "a flow of this project is running" in proc.stderr, proc.stderr[-2000:]


def test_a_bad_retention_value_names_section_and_field(isolated_project):
    (isolated_project / "params.yaml").write_text("retention:\n  keep_runs: 0\n")
    proc = run_cli(["gc"], isolated_project, timeout=300)
    assert proc.returncode == 2 and "retention.keep_runs" in proc.stderr and "Traceback" not in proc.stderr


def test_dvc_cloud_without_a_remote_is_refused_naming_the_field(isolated_project):
    _git(isolated_project, "init", "-q")
    subprocess.run(["dvc", "init", "-q"], cwd=isolated_project, check=True)
    (isolated_project / "params.yaml").write_text("retention:\n  dvc_cloud: true\n")
    proc = run_cli(["gc"], isolated_project, timeout=300)
    assert proc.returncode == 2 and "retention.dvc_cloud" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-2000:]
