"""Nightly schedule for real: `prefect server start`, `alignflow nightly` serving a cron deployment,
a triggered run that completes, and its MLflow run carrying the Prefect flow-run id."""

from __future__ import annotations

import subprocess
import sys

import httpx
import yaml

from conftest import REPO
from helpers import cli_env, stop_group, wait_for, write_micro_params


def test_prefect_yaml_is_valid():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for dep in spec["deployments"]:
        module, fn = dep["entrypoint"].split(":")  # a module path: it resolves wherever alignflow is installed
        path = REPO / (module.replace(".", "/") + ".py")
        assert path.exists() and f"def {fn}(" in path.read_text()
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

        dep = wait_for(deployment, 180, "the served deployment")
        (schedule,) = dep["schedules"]
        assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["schedule"]["timezone"] == "UTC"
        assert schedule["active"]

        def create_run():
            # A busy server (SQLite under two writers) can answer one request with an error body;
            # that is the server's hiccup, not the deployment's: ask again.
            reply = httpx.post(f"{prefect_api}/deployments/{dep['id']}/create_flow_run", json={}, timeout=10)
            body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
            return body if reply.status_code in (200, 201) and "id" in body else None

        run = wait_for(create_run, 120, "the server to create a flow run of the deployment")

        def finished():
            state = httpx.get(f"{prefect_api}/flow_runs/{run['id']}", timeout=10).json()["state"]
            return state if state and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

        state = wait_for(finished, 900, "the triggered nightly run")
        assert state["type"] == "COMPLETED", (state, (project / "serve.log").read_text()[-5000:])
    finally:
        stop_group(serve)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("alignflow-test")
    (parent,) = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "align"]
    assert parent.data.tags["prefect.flow_run_id"] == run["id"]
    assert parent.info.status == "FINISHED"
