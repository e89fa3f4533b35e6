"""The MLflow tracking server goes away mid-stage and comes back: no metric is lost.

A real ``mlflow server`` (sqlite behind it) on 127.0.0.1, a real ``alignflow sft`` logging to it
over HTTP. After the first training metrics arrive the test stops the server, waits, and starts
it again on the same port; MLflow's client retries with exponential backoff
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, default 7: minutes of patience), so the stage finishes and
every metric it logged is in the store. A server that goes away for good never hides the stage's
own outcome: a failed stage reports its own error (marking the run FAILED is only a warning), a
successful one a clear ``TrackingLost``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from helpers import cli_env, free_port, start_mlflow_server, stop_group

# Five `mlflow server` start-ups (about 20 s each on 2 busy cores): run with `make test-slow`.
pytestmark = pytest.mark.slow


def _start_server(root: Path, port: int) -> subprocess.Popen:
    return start_mlflow_server(root, port)


def _stop_server(proc: subprocess.Popen) -> None:
    stop_group(proc, signal.SIGTERM, timeout=30)


def _metric_steps(port: int, run_id: str, key: str) -> list[int]:
    reply = requests.get(f"http://127.0.0.1:{port}/api/2.0/mlflow/metrics/get-history",
                         params={"run_id": run_id, "metric_key": key}, timeout=10).json()
    return sorted(m["step"] for m in reply.get("metrics", []))


def _sft_project(tmp_path, micro_model, micro_data, sft: dict, tracking: dict) -> tuple:
    """A project whose sft stage logs to an MLflow server on a free loopback port: (store, project, port, env)."""
    store, project = tmp_path / "store", tmp_path / "project"
    store.mkdir()
    project.mkdir()
    port = free_port()
    (project / "params.yaml").write_text(yaml.safe_dump({
        "sft": {"model_path": str(micro_model), "train_file": str(micro_data["sft"]),
                "eval_file": str(micro_data["eval"]), "save_every": 20, "num_threads": 1, **sft},
        "tracking": {"log_model": False, **tracking}}))
    return store, project, port, {**cli_env(project), "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}


def test_server_restart_mid_stage_loses_no_metric(tmp_path, micro_model, micro_data):
    store, project, port, env = _sft_project(
        tmp_path, micro_model, micro_data, {"max_steps": 80, "batch_size": 16, "eval_every": 40, "eval_items": 20},
        {"experiment": "outage"})

    server = _start_server(store, port)
    stage = subprocess.Popen([sys.executable, "-m", "flows.cli", "sft"], cwd=project, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # wait for the run and its first training metrics, then take the server away
        run_id, deadline = None, time.time() + 180
        while time.time() < deadline:
            runs = requests.post(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
                                 json={"experiment_ids": ["1"], "max_results": 5}, timeout=10).json().get("runs", [])
            if runs and _metric_steps(port, runs[0]["info"]["run_id"], "train/loss"):
                run_id = runs[0]["info"]["run_id"]
                break
            assert stage.poll() is None, stage.communicate()[1][-3000:]
            time.sleep(0.2)
        assert run_id, "no training metric reached the server"
        before = _metric_steps(port, run_id, "train/loss")
        _stop_server(server)
        down_at = time.time()
        time.sleep(5)
        assert stage.poll() is None, "the stage should be waiting on MLflow, not finished or dead"
        server = _start_server(store, port)
        outage_s = time.time() - down_at
        out, err = stage.communicate(timeout=600)
        assert stage.returncode == 0, err[-3000:]
    finally:
        if stage.poll() is None:
            stage.kill()
        _stop_server(server)
        server = _start_server(store, port)  # read back what was stored

    try:
        steps = _metric_steps(port, run_id, "train/loss")
        assert steps == list(range(10, 81, 10)), (before, steps)
        assert _metric_steps(port, run_id, "eval/accuracy") == [40, 80]
        run = requests.get(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get", params={"run_id": run_id},
                           timeout=10).json()["run"]
        assert run["info"]["status"] == "FINISHED"
        print(f"server down for {outage_s:.1f} s after step {before[-1]}; all {len(steps)} train/loss points stored")
    finally:
        _stop_server(server)


def test_server_gone_when_a_stage_fails_keeps_the_stage_error(tmp_path, micro_model, micro_data):
    """The server is stopped mid-stage, then the stage fails (SIGTERM: it checkpoints and stops).
    Marking its run FAILED cannot reach MLflow: that is a warning, given up after about the
    2 s patience, and the stage's own error is what the user sees, not MLflow's."""
    # No MLflow call inside the loop (log_every past max_steps, no evals): once the run is open and
    # the first checkpoint is written, the stage touches MLflow again only when it ends.
    store, project, port, env = _sft_project(
        tmp_path, micro_model, micro_data, {"max_steps": 100000, "log_every": 100000, "batch_size": 8, "eval_every": 0},
        {"experiment": "gone", "connect_patience_s": 2})

    server = _start_server(store, port)
    stage = subprocess.Popen([sys.executable, "-m", "flows.cli", "sft"], cwd=project, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while not list((project / "checkpoints" / "sft").glob("step-*")):
            assert stage.poll() is None and time.time() < deadline, stage.communicate()[1][-3000:]
            time.sleep(0.2)
        [run] = requests.post(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
                              json={"experiment_ids": ["1"]}, timeout=10).json()["runs"]
        assert run["info"]["status"] == "RUNNING"
        _stop_server(server)
        stage.send_signal(signal.SIGTERM)
        signalled = time.time()
        out, err = stage.communicate(timeout=300)
        took = time.time() - signalled
    finally:
        if stage.poll() is None:
            stage.kill()
        if server.poll() is None:
            _stop_server(server)
    print(f"the stage exited {took:.1f} s after SIGTERM with the server gone")
    assert stage.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped: sft: stopped by SIGTERM after step" in err, err[-3000:]
    assert (f"could not mark MLflow run {run['info']['run_id']} FAILED at http://127.0.0.1:{port} "
            "([Errno 111] Connection refused)") in err, err[-3000:]
    assert "MlflowException" not in err and "Traceback" not in err, err[-3000:]
    assert took < 20, f"{took:.1f} s: closing the run waited on MLflow's full retries"


def test_server_gone_when_a_stage_succeeds_is_a_clear_error(tmp_path, monkeypatch):
    """The body succeeded but the server is gone when its run is marked FINISHED: TrackingLost,
    naming the run and the server, instead of MLflow's exception. The user's own
    MLFLOW_HTTP_REQUEST_MAX_RETRIES=1 is kept (the bounded opening does not override it), so
    the close gives up in seconds rather than MLflow's default minutes."""
    from rlhf_core.config import TrackingConfig
    from rlhf_core.tracking.mlflow_runs import TrackingLost, start_run

    port = free_port()
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    server = _start_server(tmp_path, port)
    try:
        with pytest.raises(TrackingLost) as lost:
            with start_run(TrackingConfig(experiment="gone", log_model=False), "stage") as run:
                run.log_metrics({"train/loss": 1.0}, 1)
                _stop_server(server)
    finally:
        if server.poll() is None:
            _stop_server(server)
    assert str(lost.value).startswith(
        f"stage: the stage finished and wrote its outputs, but MLflow at http://127.0.0.1:{port} did not record "
        f"run {run.run_id} as FINISHED ([Errno 111] Connection refused). Once the server is back")
