"""The MLflow tracking server goes away mid-stage and comes back: no metric is lost.

A real ``mlflow server`` (sqlite behind it) on 127.0.0.1, a real ``alignflow sft`` logging to it
over HTTP. After the first training metrics arrive the test stops the server, waits, and starts
it again on the same port; MLflow's client retries with exponential backoff
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, default 7: minutes of patience), so the stage finishes and
every metric it logged is in the store.
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

from helpers import cli_env, free_port, stop_group

# Three `mlflow server` start-ups (about 20 s each on 2 busy cores): run with `make test-slow`.
pytestmark = pytest.mark.slow


def _start_server(root: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                             "--artifacts-destination", str(root / "artifacts")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        assert proc.poll() is None, "mlflow server exited"
        time.sleep(0.5)
    raise AssertionError("mlflow server did not come up in 120 s")


def _stop_server(proc: subprocess.Popen) -> None:
    stop_group(proc, signal.SIGTERM, timeout=30)


def _metric_steps(port: int, run_id: str, key: str) -> list[int]:
    reply = requests.get(f"http://127.0.0.1:{port}/api/2.0/mlflow/metrics/get-history",
                         params={"run_id": run_id, "metric_key": key}, timeout=10).json()
    return sorted(m["step"] for m in reply.get("metrics", []))


def test_server_restart_mid_stage_loses_no_metric(tmp_path, micro_model, micro_data):
    store, project = tmp_path / "store", tmp_path / "project"
    store.mkdir()
    project.mkdir()
    port = free_port()
    (project / "params.yaml").write_text(yaml.safe_dump({
        "sft": {"model_path": str(micro_model), "train_file": str(micro_data["sft"]),
                "eval_file": str(micro_data["eval"]), "max_steps": 80, "batch_size": 16, "eval_every": 40,
                "eval_items": 20, "save_every": 20, "num_threads": 1},
        "tracking": {"experiment": "outage", "log_model": False}}))
    env = {**cli_env(project), "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}

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
