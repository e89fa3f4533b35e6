"""MLflow trouble costs seconds, not runs: a down server fails a stage fast and clearly, a retried
task continues its MLflow run, and Prefect task results are stored as plain JSON.

Real components throughout: the real ``alignflow`` CLI against a closed loopback port (nothing
listens there: the same refusal a stopped server gives), a real Prefect test server with the
production ``train-dpo`` task and its retry policy, MLflow on sqlite, and Prefect's own result
store under the test session's ``PREFECT_HOME``. A tracking server stopped *during* a stage is in
``test_mlflow_outage.py`` (slow tier: it starts ``mlflow server``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import cli_env, free_port
from rlhf_core.config import DPOConfig, GenerateConfig, TrackingConfig, config_to_dict
from rlhf_core.tracking.lineage import dvc_md5


def test_down_tracking_server_fails_the_stage_within_30_s(isolated_project, micro_model, micro_data, monkeypatch):
    """The SFT stage with MLFLOW_TRACKING_URI at a port nothing listens on and the default
    patience (20 s): TrackingUnavailable within 30 s of the stage's start (its data gate
    included), naming the server and what to do, and nothing trained."""
    from rlhf_core.stages import wrappers as stages
    from rlhf_core.config import SFTConfig
    from rlhf_core.tracking.mlflow_runs import TrackingUnavailable

    port = free_port()  # bound and released: nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    cfg = SFTConfig(model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
                    output_dir=str(isolated_project / "models" / "sft"), max_steps=4, batch_size=8, num_threads=1)
    started = time.monotonic()
    with pytest.raises(TrackingUnavailable) as failure:
        stages.sft(cfg, TrackingConfig(experiment="down", log_model=False), show_progress=False)
    elapsed = time.monotonic() - started
    print(f"stage failed {elapsed:.1f} s after it started")
    assert 20 <= elapsed < 30, f"took {elapsed:.1f} s"
    assert str(failure.value).startswith(f"tracking server http://127.0.0.1:{port} did not answer within 20 s "
                                         "([Errno 111] Connection refused). Start it")
    assert not (isolated_project / "models" / "sft").exists(), "nothing trained without tracking"


def test_cli_reports_a_down_tracking_server_in_one_line(tmp_path, micro_model, micro_data):
    """``alignflow sft`` against a down server (patience 1 s from params.yaml): exit status 2 and
    one ``error:`` line naming the server, its password redacted, and what to do; no traceback."""
    port = free_port()
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "sft": {"model_path": str(micro_model), "train_file": str(micro_data["sft"]),
                "eval_file": str(micro_data["eval"]), "max_steps": 4, "batch_size": 8, "num_threads": 1},
        "tracking": {"experiment": "down", "log_model": False, "connect_patience_s": 1}}))
    env = {**cli_env(tmp_path), "MLFLOW_TRACKING_URI": f"http://alice:hunter2-secret@127.0.0.1:{port}"}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "sft"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"error: tracking server http://***@127.0.0.1:{port} did not answer within 1 s "
            "([Errno 111] Connection refused). Start it, point MLFLOW_TRACKING_URI or tracking.tracking_uri at a "
            "running server (unset both for the local sqlite store), or raise tracking.connect_patience_s to wait "
            "longer for it.") in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "hunter2" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("patience", [1.0, 3.0])
def test_connect_patience_is_how_long_a_run_waits(isolated_project, monkeypatch, patience):
    """A longer ``tracking.connect_patience_s`` waits at least that long, and not much longer
    (one more try of at most a second past the deadline, then the error); the body never runs."""
    from rlhf_core.tracking.mlflow_runs import TrackingUnavailable, start_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(TrackingUnavailable, match=rf"did not answer within {patience:g} s"):
        with start_run(TrackingConfig(connect_patience_s=patience), "stage"):
            raise AssertionError("the run opened without a server")
    elapsed = time.monotonic() - started
    print(f"patience {patience:g} s: failed after {elapsed:.2f} s")
    assert patience <= elapsed < patience + 1.5


def test_bounded_http_leaves_the_users_settings_alone(monkeypatch):
    """While a run opens, MLflow's retries are bounded (patience 9 s: 2 retries, 3 s per try) only
    where the user set nothing; afterwards every variable is as it was, so mid-stage calls keep
    MLflow's default minutes of patience."""
    from rlhf_core.tracking.mlflow_runs import bounded_http

    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")
    with bounded_http(9):
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
        assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    assert "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"


def test_negative_patience_is_refused():
    from rlhf_core.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"^params.yaml: tracking.connect_patience_s: must be >= 0 seconds, "
                                          r"got -1.0$"):
        build_config(TrackingConfig, "tracking", {"connect_patience_s": -1}, "params.yaml")


@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize("isolation", ["inline", pytest.param("process", marks=pytest.mark.slow)])
def test_retried_task_continues_its_mlflow_run(isolated_project, micro_model, micro_data, monkeypatch, isolation):
    """``train-dpo`` under a parent run fails after step 10 (fault hook, first attempt only) and
    Prefect retries it from the step-8 checkpoint. MLflow then holds one run for the stage, not
    two: FINISHED, tagged attempt 2, resumed from step 8, and one point per logged step. Inline
    the attempt is Prefect's ``run_count``; in a child process (no task context there) it is
    counted from the run's own tag (slow tier: two child start-ups).

    log_every 2, max_steps 12: attempt 1 logs train/loss at 2, 4, 6, 8, 10, then fails; attempt 2
    resumes after step 8, redoes 9 and 10 (step 10's point is already there: not logged again)
    and logs 12. So the history is exactly 2, 4, 6, 8, 10, 12; the final eval is at 12 only.
    """
    from mlflow.tracking import MlflowClient
    from prefect import flow

    from rlhf_core.tracking.mlflow_runs import start_run
    from tasks.training import train_dpo

    project = isolated_project
    params = config_to_dict(DPOConfig(
        model_path=str(micro_model), train_file=str(micro_data["preferences"]), eval_file=str(micro_data["eval"]),
        output_dir=str(project / "models" / "dpo"), checkpoint_dir=str(project / "checkpoints" / "dpo"),
        max_steps=12, batch_size=8, lr=3e-3, warmup_steps=2, eval_items=20, save_every=4, log_every=2, beta=0.5,
        num_threads=1))
    tracking = {"experiment": "continue-test", "log_model": False}
    marker = project / "fault-fired"
    monkeypatch.setenv("ALIGNFLOW_FAULT", f"dpo:10:{marker}")

    @flow(name="one-dpo-stage-under-a-parent")
    def one_stage() -> str:
        with start_run(TrackingConfig(**tracking), "parent") as parent:
            train_dpo(params, tracking, input_md5={"preferences": dvc_md5(micro_data["preferences"])},
                      parent_run_id=parent.run_id, isolation=isolation)
            return parent.run_id

    parent_id = one_stage()
    assert marker.exists(), "the fault fired on the first attempt"

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("continue-test")
    stage_runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert len(stage_runs) == 1, [(r.info.run_name, r.info.status) for r in stage_runs]
    run = stage_runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["alignflow.attempt"] == "2"
    history = {key: [m.step for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}
    assert sorted(history["train/loss"]) == [2, 4, 6, 8, 10, 12], history["train/loss"]
    assert history["checkpoint/resumed_from_step"] == [8]
    assert history["eval/accuracy"] == [12]
    duplicated = {key: steps for key, steps in history.items() if len(steps) != len(set(steps))}
    assert not duplicated, duplicated


@pytest.mark.usefixtures("prefect_server")
def test_task_results_are_stored_as_plain_json(isolated_project):
    """A cache hit of ``generate-data`` is served from a result file that is plain JSON: the
    record's serializer is Prefect's JSON one with no object hook (nothing imported on read), its
    result is the task's returned dict as JSON text, and no pickle is anywhere in it. A failed
    task's record (Prefect persists the exception) is JSON data too: type name and message."""
    from prefect import flow

    from tasks.data import generate_data

    params = {"out_dir": str(isolated_project / "data"), "n_sft": 20, "n_preference": 10, "n_prompts": 10,
              "n_eval": 10, "seed": 3}
    tracking = {"experiment": "json-results", "log_model": False}

    @flow(name="generate-twice-and-fail-once")
    def run() -> dict:
        first = generate_data(params, tracking, return_state=True)
        second = generate_data(params, tracking, return_state=True)
        bad = generate_data({**params, "bogus": 1}, tracking, return_state=True)
        return {"states": [first.name, second.name, bad.name], "returned": second.result(),
                "file": second.data.metadata.storage_key, "failed_file": bad.data.metadata.storage_key}

    seen = run()
    assert seen["states"] == ["Completed", "Cached", "Failed"], seen["states"]
    assert seen["returned"]["outputs"]["sft"] == params["out_dir"] + "/sft.jsonl"

    raw = Path(seen["file"]).read_bytes()
    record = json.loads(raw)
    assert record["metadata"]["serializer"] == {
        "type": "json", "jsonlib": "json", "object_encoder": "tasks.common.encode_failure", "object_decoder": None,
        "dumps_kwargs": {}, "loads_kwargs": {}}
    assert json.loads(record["result"]) == seen["returned"]
    # cloudpickle's base64 starts gAS/gAW (protocol 4/5); md5s and paths here are lower-case
    assert b"pickle" not in raw and b"__class__" not in raw and b"gAS" not in raw and b"gAW" not in raw

    failed = json.loads(Path(seen["failed_file"]).read_bytes())
    assert failed["metadata"]["serializer"]["type"] == "json"
    assert json.loads(failed["result"]) == {
        "error": "ConfigError", "message": "<overrides>: generate.bogus: unknown field; known fields are "
        + ", ".join(sorted(config_to_dict(GenerateConfig())))}
