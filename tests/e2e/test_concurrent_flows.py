"""Two `align` flows started at the same moment on one project: both complete, the MLflow store
holds both runs intact, and the second waited for the first (the project's flow lock) rather than
writing the same data, models and DVC cache at the same time."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from helpers import cli_env, write_micro_params

# Two micro align flows back to back on 2 cores: a few minutes. Run with `make test-slow`.
pytestmark = pytest.mark.slow


def test_two_align_flows_at_once(isolated_project, prefect_api):
    project = isolated_project
    write_micro_params(project)
    env = {**cli_env(project), "PREFECT_API_URL": prefect_api, "OMP_WAIT_POLICY": "PASSIVE",
           "PREFECT_HOME": str(project / ".prefect-client")}
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "flow", "align", "--summary", f"metrics/flow/{i}.json"],
                              cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (1, 2)]
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-5000:]
    waited = [log for log in logs if "another flow is running" in log]
    assert len(waited) == 1, "exactly one of the two flows should have waited for the other"

    from mlflow.tracking import MlflowClient

    db = project / "mlflow.db"
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("alignflow-test")
    runs = client.search_runs([exp.experiment_id], max_results=500)
    parents = [r for r in runs if r.info.run_name == "align"]
    assert len(parents) == 2 and all(r.info.status == "FINISHED" for r in parents)
    assert all(r.info.status == "FINISHED" for r in runs), [(r.info.run_name, r.info.status) for r in runs]
    for parent in parents:
        assert parent.data.tags["prefect.flow_run_id"] and parent.data.tags["git.commit"]
        assert {"eval/accuracy_sft", "eval/accuracy_dpo", "eval/accuracy_rl"} <= set(parent.data.metrics)
        assert "reproduce.json" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    # the first flow trained every stage; the second found them in the cache (same inputs)
    first, second = sorted(parents, key=lambda r: r.info.start_time)
    children = {p.info.run_id: [r for r in runs if r.data.tags.get("mlflow.parentRunId") == p.info.run_id]
                for p in parents}
    assert {"sft", "dpo", "rl"} <= {r.info.run_name for r in children[first.info.run_id]}
    assert second.info.start_time >= first.info.end_time, "the second flow's run began after the first ended"
    assert first.data.metrics == second.data.metrics  # same inputs, cached stages: the same results
