"""The align flow for real: Prefect server, MLflow sqlite store, GX gate, tiny models.

Micro sizes; the same flow as ``make demo``. Checks the lineage a user reviews in the MLflow
UI: a parent run, one nested run per stage, the registered model, git and DVC md5 tags.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from helpers import one_error, run_cli, write_micro_params
from rlhf_core.data.io import DataError
from rlhf_core.data.validate import ValidationFailed
from rlhf_core.tracking.lineage import dvc_md5

pytestmark = pytest.mark.usefixtures("prefect_server")


@pytest.fixture()
def project(isolated_project):
    """Micro params with the shipped default isolation: every training stage in its own process."""
    import yaml

    path = write_micro_params(isolated_project)
    params = yaml.safe_load(path.read_text())
    params["flow"]["isolation"] = "process"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return isolated_project


def _client(project):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")


def test_align_flow_records_lineage_and_caches(project):
    from flows.align import align

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("prefect.flow_runs").addHandler(handler)
    try:
        summary = align(params_file="params.yaml")
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
    # no base model given: one line says which model the flow builds, and why
    assert [m for m in said if m.startswith("no --base-model given: building alignflow's embedded tiny qwen2")], said
    client = _client(project)
    exp = client.get_experiment_by_name("alignflow-test")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.info.run_name == "align")
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert {"generate", "validate-sft", "validate-preferences", "validate-prompts", "validate-eval", "build-model",
            "evaluate-base", "sft", "evaluate-sft", "reward", "dpo", "kto", "rejection", "validate-rejection-kept",
            "raft", "distill", "rl"} <= set(children) <= {*children, "validate-rejection-pairs"}
    assert all(r.info.status == "FINISHED" for r in runs)

    # lineage: git commit and the DVC md5 of every input, on the parent and on the stage
    for tags in (parent.data.tags, children["sft"].data.tags):
        assert tags["git.commit"]
        assert tags["dvc.md5.eval"] == dvc_md5(project / "data/embedded/eval.jsonl")
    assert parent.data.tags["dvc.md5.sft"] == dvc_md5(project / "data/embedded/sft.jsonl")
    assert children["sft"].data.tags["dvc.md5.output_model"] == dvc_md5(project / "models/sft")
    digests = {d.dataset.name: d.dataset.digest for d in children["sft"].inputs.dataset_inputs}
    assert digests["sft_train"] == dvc_md5(project / "data/embedded/sft.jsonl")

    # namespaced metrics and the registered model
    sft_metrics = children["sft"].data.metrics
    assert {"train/loss", "eval/accuracy", "perf/tokens_per_s"} <= set(sft_metrics)
    assert "eval/accuracy_sft" in parent.data.metrics
    versions = client.search_model_versions("name='alignflow-sft'")
    assert versions and versions[0].run_id == children["sft"].info.run_id
    assert summary["md5"]["model_sft"] == dvc_md5(project / "models/sft")
    # the end product (the rl stage's model) is the policy registry's candidate, and champion
    champion = client.get_model_version_by_alias("alignflow-policy", "champion")
    assert champion.run_id == children["rl"].info.run_id and summary["promotion"]["stage"] == "rl"
    assert client.get_model_version_by_alias("alignflow-policy", "candidate").version == champion.version

    # the offline stages start from the SFT model and record their inputs
    for stage in ("reward", "dpo", "kto", "raft", "distill", "rl"):
        tags = children[stage].data.tags
        assert tags["dvc.md5.model"] == summary["md5"]["model_sft"], stage
        assert tags["dvc.md5.output_model"] == dvc_md5(project / f"models/{stage}"), stage
    assert children["distill"].data.tags["dvc.md5.teacher"] == dvc_md5(project / "models/dpo")
    # curves as PNG, the GX report, and the RL rollout table as artifacts
    for stage in ("sft", "dpo", "reward", "rl"):
        assert "curves.png" in {a.path for a in client.list_artifacts(children[stage].info.run_id)}, stage
    assert "validation_report.json" in {a.path for a in client.list_artifacts(children["validate-sft"].info.run_id)}
    assert "rollouts.json" in {a.path for a in client.list_artifacts(children["rl"].info.run_id)}
    assert children["rejection"].data.tags["dvc.md5.reward_model"] == dvc_md5(project / "models/reward")
    assert children["raft"].data.tags["dvc.md5.kept_samples"] == dvc_md5(project / "data/rejection/best.jsonl")
    assert {"eval/accuracy_dpo", "eval/reward_accuracy_reward", "rejection/kept_accuracy_rejection"} \
        <= set(parent.data.metrics)

    # second run: every task is a cache hit (same outputs, no new SFT run)
    again = align(params_file="params.yaml")
    assert again["md5"] == summary["md5"]
    from flows.reproduce import task_states

    states = task_states(client.get_run(again["parent_run_id"]).data.tags["prefect.flow_run_id"])
    # generate, build-model, both evaluations, sft and the 7 alignment stages are cache hits;
    # only the validation gates (never cached) and the registry step execute again
    assert states.get("Cached", 0) == 12, states
    names = [r.info.run_name for r in client.search_runs([exp.experiment_id])]
    for stage in ("sft", "reward", "dpo", "kto", "rejection", "raft", "distill", "rl"):
        assert names.count(stage) == 1, (stage, names)

    # a deleted output defeats the cache: SFT runs again and reproduces the same weights
    shutil.rmtree(project / "models/sft")
    third = align(params_file="params.yaml")
    assert third["md5"]["model_sft"] == summary["md5"]["model_sft"]
    assert len([r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "sft"]) == 2


def test_bad_data_stops_flow_before_training(project, tmp_path):
    from flows.align import align

    bad = tmp_path / "bad_prefs.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n"
                   + json.dumps({"prompt": "1+2=", "rejected": "4"}) + "\n")
    with pytest.raises(ValidationFailed, match="field 'chosen': missing"):
        align(params_file="params.yaml", preference_file=str(bad))
    broken = tmp_path / "broken_sft.jsonl"
    broken.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": \n')
    with pytest.raises(DataError, match="broken_sft.jsonl:2: not valid JSON"):
        align(params_file="params.yaml", sft_file=str(broken))
    assert not (project / "models").exists()
    runs = _client(project).search_runs([_client(project).get_experiment_by_name("alignflow-test").experiment_id])
    status = {(r.info.run_name, r.info.status) for r in runs}
    assert ("validate-preferences", "FAILED") in status and ("align", "FAILED") in status
    assert not {name for name, _ in status} & {"build-model", "sft", "evaluate-base"}  # nothing downstream ran


@pytest.mark.slow  # a flow run up to its validation (about 30 s): test_bad_inputs checks each stage's bad files
def test_cli_flow_with_bad_file_exits_nonzero(project, tmp_path):
    bad = tmp_path / "bad_prefs.jsonl"
    bad.write_text(json.dumps({"prompt": "1+2=", "rejected": "4"}) + "\n")
    proc = run_cli(["flow", "align", "--preference-file", str(bad)], project)
    # once, bounded, file:line:field, no traceback: not again in Prefect's task and flow failure logs; the file
    # named as the run records it, relative to the project it lies in (rlhf_core.tracking.lineage.project_relative)
    named = bad.relative_to(project) if bad.is_relative_to(project) else bad
    one_error(proc, 1, f"{named}: INVALID preference dataset", f"{named}:1: field 'chosen': missing")
    assert proc.stderr.count("field 'chosen': missing") == 1, proc.stderr[-5000:]
    assert not (project / "models").exists()
