"""The team profile end to end: ``alignflow services up`` starts PostgreSQL, the object store (moto's S3 server), an
MLflow server and a Prefect server; two separate project clones run the micro align flow at once with
``--profile team`` against that one Prefect server, its GPU limit at one slot.

The second run waits, and the wait is the Prefect limit's: the clones are separate folders (each its own flow
lock, and neither log says it waited for one), the limit's state on the server shows its one slot held, and the
waiting run's log lines on the Prefect server say it waits for ``alignflow-gpus``. Both complete; their runs,
lineage tags, registered versions and artifacts are in MLflow on PostgreSQL and in the object store; their flow
runs are in the Prefect server's database; the DVC remote in the store takes a push; wrong database credentials
are refused at start without the password printed; ``services down`` stops every process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.services.processes import alive
from helpers import cli_env, team_clone, team_section

pytestmark = pytest.mark.slow

LIMIT = "alignflow-gpus"


def _env(project: Path, home: Path) -> dict[str, str]:
    env = {**cli_env(project), "HOME": str(home), "PREFECT_HOME": str(project / ".prefect"),
           "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("MLFLOW_TRACKING_URI")  # the profile names the tracking server
    return env


def _alignflow(args: list[str], project: Path, home: Path, timeout: int = 400,
              **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=project,
                          env={**_env(project, home), **extra_env}, capture_output=True, text=True, timeout=timeout)


def _watch_limit(api: str, seen: list[dict], stop: threading.Event) -> None:
    """Record the limit's state on the Prefect server every half second."""
    import httpx

    while not stop.is_set():
        try:
            seen.append(httpx.get(f"{api}/v2/concurrency_limits/{LIMIT}", timeout=5).json())
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _run_two_flows(projects: list[Path], home: Path, api: str) -> tuple[list[str], list[dict]]:
    seen: list[dict] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_limit, args=(api, seen, stop), daemon=True)
    watcher.start()
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "flow", "align", "--profile", "team"], cwd=p,
                              env=_env(p, home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for p in projects]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    stop.set()
    watcher.join(timeout=10)
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-5000:]
    return logs, seen


def _credentials(home: Path) -> dict[str, str]:
    path = home / ".config" / "alignflow" / "team.env"
    assert path.stat().st_mode & 0o777 == 0o600
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def _check_prefect(api: str, run_ids: list[str], waiter: str) -> None:
    import httpx

    runs = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"id": {"any_": run_ids}}}, timeout=30).json()
    assert sorted(r["id"] for r in runs) == sorted(run_ids)
    assert all(r["state_type"] == "COMPLETED" for r in runs), [r["state_type"] for r in runs]
    logs = httpx.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [waiter]}}, "limit": 200},
                      timeout=30).json()
    assert any(f"GPU limit '{LIMIT}': all 1 slot(s) held" in entry["message"] for entry in logs), \
        "the waiting run's log on the Prefect server names the limit it waited for"


def _check_databases(team: dict, creds: dict[str, str], parents: list, run_ids: list[str]) -> None:
    import psycopg

    def query(database: str, sql: str, *args):
        with psycopg.connect(host="127.0.0.1", port=team["postgres_port"], user="alignflow",
                             password=creds["PGPASSWORD"], dbname=database) as conn:
            return conn.execute(sql, args).fetchall()

    rows = query("alignflow_mlflow", "SELECT run_uuid, status FROM runs WHERE name = 'align'")
    assert sorted(rows) == sorted((p.info.run_id, "FINISHED") for p in parents)
    assert query("alignflow_mlflow", "SELECT count(*) FROM model_versions WHERE name = 'alignflow-policy'")[0][0] == 2
    rows = query("alignflow_prefect", "SELECT id::text, state_type FROM flow_run WHERE id::text = ANY(%s)", run_ids)
    assert sorted(rows) == sorted((r, "COMPLETED") for r in run_ids)


def _check_object_store(team: dict, creds: dict[str, str], parents: list, project: Path, home: Path) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{team['object_store_port']}", region_name="us-east-1",
                      aws_access_key_id=creds["AWS_ACCESS_KEY_ID"], aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"])
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="alignflow")
            for o in page.get("Contents", [])]
    for parent in parents:
        assert any(k.startswith("mlflow/") and k.endswith(f"{parent.info.run_id}/artifacts/reproduce.json")
                   for k in keys), "the parent run's artifacts are in the object store"
    assert any(k.startswith("mlflow/") and "/artifacts/" in k and k.endswith("model.safetensors") for k in keys)
    (project / "blob.txt").write_text("versioned by the team remote\n")
    env = {**_env(project, home), **creds}
    for cmd in (["add", "blob.txt"], ["push"]):
        proc = subprocess.run([sys.executable, "-m", "dvc", *cmd], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    dvc_keys = [o["Key"] for o in s3.list_objects_v2(Bucket="alignflow", Prefix="dvc/").get("Contents", [])]
    assert dvc_keys, "dvc push reached the remote in the object store"


def test_two_projects_share_the_team_services_and_take_turns_on_the_gpu(team_base):
    home = team_base / "home"
    home.mkdir()
    team = team_section(team_base)
    projects = [team_clone(team_base, name, team) for name in ("a", "b")]
    api = f"http://127.0.0.1:{team['prefect_port']}/api"
    started = time.monotonic()
    up = _alignflow(["services", "up"], projects[0], home)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        print(f"services up: {time.monotonic() - started:.0f} s")
        creds = _credentials(home)
        assert not any(v in up.stdout + up.stderr for v in creds.values()), "no credential printed"
        wrong = _alignflow(["services", "up"], projects[0], home, PGPASSWORD="not-the-password-4711")
        assert wrong.returncode == 1 and "refused 'alignflow'" in wrong.stderr, wrong.stderr
        assert "not-the-password-4711" not in wrong.stdout + wrong.stderr, "the wrong password is not printed"

        started = time.monotonic()
        logs, seen = _run_two_flows(projects, home, api)
        print(f"two flows: {time.monotonic() - started:.0f} s")
        assert not any("another flow is running" in log for log in logs), "no project lock was involved"
        waited = [i for i, log in enumerate(logs) if f"GPU limit '{LIMIT}': all 1 slot(s) held" in log]
        assert len(waited) == 1, "exactly one run waited for the GPU limit"
        assert seen and all(s["limit"] == 1 for s in seen) and max(s["active_slots"] for s in seen) == 1

        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"http://127.0.0.1:{team['mlflow_port']}")
        exp = client.get_experiment_by_name("alignflow-test")
        assert exp.artifact_location.startswith("mlflow-artifacts:"), exp.artifact_location
        parents = [r for r in client.search_runs([exp.experiment_id], max_results=500) if r.info.run_name == "align"]
        assert len(parents) == 2 and all(r.info.status == "FINISHED" for r in parents)
        for parent in parents:
            tags = parent.data.tags
            assert tags["git.commit"] and tags["dvc.md5.sft"] and tags["dvc.md5.model_sft"], tags
            assert tags["prefect.gpu_limit"] == LIMIT
        waits = sorted(float(p.data.tags["prefect.gpu_wait_s"]) for p in parents)
        assert waits[1] > 1.0, waits
        assert len(client.search_model_versions("name='alignflow-policy'")) == 2
        run_ids = [p.data.tags["prefect.flow_run_id"] for p in parents]
        waiter = next(p for p in parents if float(p.data.tags["prefect.gpu_wait_s"]) > 1.0)
        _check_prefect(api, run_ids, waiter.data.tags["prefect.flow_run_id"])
        _check_databases(team, creds, parents, run_ids)
        _check_object_store(team, creds, parents, projects[0], home)
        status = _alignflow(["services", "status"], projects[0], home, timeout=120)
        assert status.returncode == 0 and status.stdout.count(" up ") == 4, status.stdout + status.stderr
    finally:
        pids = [int(p.read_text()) for p in (team_base / "services" / "run").glob("*.pid")]
        down = _alignflow(["services", "down"], projects[0], home, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert len(pids) == 4 and not [pid for pid in pids if alive(pid)], "services down stopped every process"
    assert _alignflow(["services", "status"], projects[0], home, timeout=120).returncode == 1
