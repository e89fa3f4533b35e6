"""Nightly schedule for real: `prefect server start`, `alignflow nightly` serving a cron deployment,
a triggered run that completes, and its MLflow run carrying the Prefect flow-run id."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from conftest import REPO
from helpers import cli_env, write_micro_params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        result = check()
        if result:
            return result
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C the process group (serve pauses its schedules on the way out); kill it if that hangs."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture()
def prefect_api(tmp_path):
    """A `prefect server start` of the test's own (its own PREFECT_HOME and SQLite database)."""
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-server"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "true", "PREFECT_UI_ENABLED": "false"}
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"

    def healthy():
        try:
            return httpx.get(f"{api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(healthy, 120, "prefect server start")
        yield api
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_prefect_yaml_is_valid():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for dep in spec["deployments"]:
        path, fn = dep["entrypoint"].split(":")
        assert (REPO / path).exists() and f"def {fn}(" in (REPO / path).read_text()
        assert dep["schedules"][0]["cron"] == "0 2 * * *" and dep["schedules"][0]["timezone"] == "UTC"


def test_cron_deployment_runs_and_its_mlflow_run_has_the_flow_run_id(isolated_project, prefect_api):
    project = isolated_project
    write_micro_params(project)
    env = {**cli_env(project), "PREFECT_API_URL": prefect_api, "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("PREFECT_HOME", None)  # the client side needs no local home of the server's
    env["PREFECT_HOME"] = str(project / ".prefect-client")
    serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "nightly", "--cron", "0 2 * * *"], cwd=project,
                             env=env, stdout=open(project / "serve.log", "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        def deployment():
            found = httpx.post(f"{prefect_api}/deployments/filter", json={}, timeout=10).json()
            return next((d for d in found if d["name"] == "nightly-align"), None)

        dep = _wait(deployment, 180, "the served deployment")
        (schedule,) = dep["schedules"]
        assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["schedule"]["timezone"] == "UTC"
        assert schedule["active"]

        run = httpx.post(f"{prefect_api}/deployments/{dep['id']}/create_flow_run", json={}, timeout=10).json()

        def finished():
            state = httpx.get(f"{prefect_api}/flow_runs/{run['id']}", timeout=10).json()["state"]
            return state if state and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

        state = _wait(finished, 900, "the triggered nightly run")
        assert state["type"] == "COMPLETED", (state, (project / "serve.log").read_text()[-5000:])
    finally:
        _stop(serve)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("alignflow-test")
    (parent,) = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "align"]
    assert parent.data.tags["prefect.flow_run_id"] == run["id"]
    assert parent.info.status == "FINISHED"
