"""Faults of the team deployment, each with nothing lost and one clear message: the outage tests
(test_mlflow_outage.py) extended to the services ``alignflow services up`` starts.

One set of services for the module: PostgreSQL, the MLflow server and the Prefect server started by
``alignflow services up``; the object store is the team's own S3 endpoint (``team.s3_endpoint_url``): a
``moto_server`` started here, reached through a TCP forwarder (:class:`helpers.Forwarder`). Cutting the forwarder
makes the store unreachable (connection refused) while moto runs on and keeps the objects it holds in memory, as a
team's S3 behind a network fault would; stopping moto itself would discard them.

- The tracking server stopped mid-stage: the stage waits on MLflow's retries, the server comes back
  (``services up`` restarts it), the stage finishes, and its metrics are in the server with the steps and values
  of the same stage run without an outage.
- The object store unreachable when a flow pushes (the flow frozen mid-DPO while the store is cut, then let go:
  DPO's artifacts at the end of its training are the next push): the flow fails with one message naming the push,
  the champion and candidate aliases stay on the previous version, no version of the failed run is left, and every
  object the store held before is still there.
- The object store unreachable exactly at a stage's model push (the stage paused there by the fault hook): one
  message naming the model and the run, no version registered, nothing the store held lost; run again, it registers.
- Wrong database credentials: ``services up`` refuses them before it starts a server, a run then stops at
  its start before any stage, and the password is printed nowhere (output, service logs, project files).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from flows.services import servers
from flows.services.processes import ServiceFiles, running_pid, stop_group
from helpers import Forwarder, cli_env, free_port, one_error, team_clone, team_section, wait_for
from rlhf_core.config import TeamConfig

pytestmark = pytest.mark.slow

POLICY = "alignflow-policy"
S3_KEYS = {"AWS_ACCESS_KEY_ID": "team-faults-key", "AWS_SECRET_ACCESS_KEY": "team-faults-secret"}


@dataclass
class Team:
    """The module's services: the ``team`` params section, where they keep their data, the object store's path."""

    base: Path
    home: Path
    section: dict
    store: Forwarder
    moto_port: int

    @property
    def services(self) -> Path:
        return Path(self.section["data_dir"])

    def env(self, project: Path, **extra: str) -> dict[str, str]:
        env = {**cli_env(project), "HOME": str(self.home), "PREFECT_HOME": str(project / ".prefect"),
               "OMP_WAIT_POLICY": "PASSIVE", **S3_KEYS, **extra}
        for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):  # the profile names the servers
            env.pop(name, None)
        return env

    def alignflow(self, args: list[str], project: Path, timeout: int = 1200, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=project, env=self.env(project, **extra),
                              capture_output=True, text=True, timeout=timeout)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=f"http://127.0.0.1:{self.section['mlflow_port']}")

    def keys(self) -> set[str]:
        """Every object in the bucket, read from moto directly (the forwarder may be cut)."""
        import boto3

        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.moto_port}", region_name="us-east-1",
                          aws_access_key_id=S3_KEYS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"])
        return {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="alignflow")
                for o in page.get("Contents", [])}


@pytest.fixture(scope="module")
def team(team_base_module):
    base = team_base_module
    home = base / "home"
    home.mkdir()
    moto_port, front = free_port(), free_port()
    moto = ServiceFiles("object-store", base / "s3")
    # moto started by the project's own code, on a port of its own; the services reach it through the forwarder
    servers.start_object_store(TeamConfig(object_store_port=moto_port, start_timeout_s=300), moto,
                               {**os.environ, **S3_KEYS})
    store = Forwarder(front, moto_port)
    world = Team(base, home, {**team_section(base), "s3_endpoint_url": f"http://127.0.0.1:{front}"}, store,
                 moto_port)
    first = team_clone(base, "services", world.section)
    try:
        up = world.alignflow(["services", "up"], first)
        assert up.returncode == 0, up.stdout + up.stderr
        yield world
    finally:
        store.restore()  # a test that failed half-way may have left it cut
        world.alignflow(["services", "down"], first, timeout=300)
        stop_group(moto)
        store.cut()


def _clone(team: Team, name: str, **sections: dict) -> Path:
    project = team_clone(team.base, name, team.section)
    params = yaml.safe_load((project / "params.yaml").read_text())
    for section, values in sections.items():
        params[section] = {**params.get(section, {}), **values}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _sft_runs(client) -> list:
    exp = client.get_experiment_by_name("alignflow-test")
    return client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'sft'",
                              order_by=["attributes.start_time ASC"]) if exp else []


# ---- the tracking server stopped mid-stage ----------------------------------------------------------------------


def test_tracking_server_stopped_mid_stage_loses_no_metric(team):
    project = _clone(team, "outage", sft={"max_steps": 120, "batch_size": 16, "eval_every": 60, "eval_items": 20,
                                          "save_every": 20, "log_every": 10})
    for cmd in (["generate"], ["init-model"], ["sft"]):  # the last: the same stage without an outage
        done = team.alignflow([*cmd, "--profile", "team"], project)
        assert done.returncode == 0, (cmd, done.stderr[-3000:])
    client = team.client()
    [reference] = _sft_runs(client)

    stage = subprocess.Popen([sys.executable, "-m", "flows.cli", "sft", "--profile", "team"], cwd=project,
                             env=team.env(project), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def first_points():
            runs = [r for r in _sft_runs(client) if r.info.run_id != reference.info.run_id]
            assert stage.poll() is None, stage.communicate()[1][-3000:]
            return runs and _history(client, runs[0].info.run_id, "train/loss") and runs[0].info.run_id

        run_id = wait_for(first_points, 600, "the stage's first training metrics on the server")
        before = _history(client, run_id, "train/loss")
        assert stop_group(ServiceFiles("mlflow", team.services)), "the MLflow server was running"
        down_at = time.monotonic()
        time.sleep(5)
        assert stage.poll() is None, "the stage waits on MLflow, neither finished nor dead"
        again = team.alignflow(["services", "up"], project, timeout=600)  # starts what is not running: MLflow
        assert again.returncode == 0, again.stdout + again.stderr
        outage_s = time.monotonic() - down_at
        out, err = stage.communicate(timeout=900)
        assert stage.returncode == 0, err[-3000:]
    finally:
        if stage.poll() is None:
            stage.kill()

    for key in ("train/loss", "eval/accuracy"):
        assert _history(client, run_id, key) == _history(client, reference.info.run_id, key), key
    assert [s for s, _ in _history(client, run_id, "train/loss")] == list(range(10, 121, 10))
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [v.run_id for v in client.search_model_versions(f"run_id='{run_id}'")] == [run_id], \
        "the stage's model reached the object store through the restarted server and was registered"
    print(f"MLflow down {outage_s:.0f} s after step {before[-1][0]}; all 12 train/loss points stored, as without it")


# ---- the object store unreachable at push time ------------------------------------------------------------------


def _dpo_training(client, flow: subprocess.Popen, first_parent: str):
    """The second flow's DPO run id once it has logged a training metric (its opening uploads are done)."""
    assert flow.poll() is None, flow.communicate()[1][-3000:]
    exp = client.get_experiment_by_name("alignflow-test")
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'dpo'")
    runs = [r for r in runs if r.data.tags.get("mlflow.parentRunId") != first_parent]
    return runs and client.get_metric_history(runs[0].info.run_id, "train/loss") and runs[0].info.run_id


def _cut_store_and_go_on(team: Team, proc: subprocess.Popen, timeout: int) -> tuple[str, str]:
    """Cut the object store while ``proc`` is stopped, let it go on and wait for it; its stdout and stderr. The
    store is restored and the process killed, whatever happens."""
    try:
        team.store.cut()
        os.kill(proc.pid, signal.SIGCONT)
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        team.store.restore()


def test_object_store_unreachable_at_push_time_moves_no_alias(team):
    # use_cache off: the second flow trains again rather than taking the first one's results from Prefect's cache
    project = _clone(team, "push", flow={"stages": ["dpo"], "use_cache": False},
                     dpo={"max_steps": 40, "log_every": 2})
    first = team.alignflow(["flow", "align", "--profile", "team"], project)
    assert first.returncode == 0, first.stderr[-3000:]
    client = team.client()
    aliases = client.get_registered_model(POLICY).aliases
    [champion] = client.search_model_versions(f"name='{POLICY}'")
    assert aliases == {"champion": champion.version, "candidate": champion.version}, aliases
    held = team.keys()
    first_parent = next(r.info.run_id for r in client.search_runs(
        [client.get_experiment_by_name("alignflow-test").experiment_id], filter_string="attributes.run_name = 'align'"))

    # The second flow is frozen (SIGSTOP) while DPO trains, the store is cut, and the flow goes on: the next thing it
    # pushes, DPO's curves and samples at the end of training, meets an unreachable store. MLflow's own retries of
    # the server's 500s kept to one (the user's setting, which alignflow leaves alone): seconds, not minutes.
    flow = subprocess.Popen([sys.executable, "-m", "flows.cli", "flow", "align", "--profile", "team"], cwd=project,
                            env=team.env(project, MLFLOW_HTTP_REQUEST_MAX_RETRIES="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        dpo_run = wait_for(lambda: _dpo_training(client, flow, first_parent), 900, "the second flow's DPO training")
        os.kill(flow.pid, signal.SIGSTOP)
    except BaseException:
        flow.kill()
        raise
    out, err = _cut_store_and_go_on(team, flow, 900)
    block = one_error(subprocess.CompletedProcess(flow.args, flow.returncode, out, err), 1, dpo_run,
                      "could not be pushed to the artifact store", "no alias moves")
    print(block)

    assert client.get_registered_model(POLICY).aliases == aliases, "the previous champion and candidate stay"
    assert [v.version for v in client.search_model_versions(f"name='{POLICY}'")] == [champion.version], \
        "no version of the failed run is left, pending or otherwise"
    exp = client.get_experiment_by_name("alignflow-test")
    parents = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'align'",
                                 order_by=["attributes.start_time ASC"])
    assert [r.info.status for r in parents] == ["FINISHED", "FAILED"]
    assert held <= team.keys(), "every object the store held before the fault is still there"
    import mlflow.artifacts

    weights = Path(mlflow.artifacts.download_artifacts(
        client.get_model_version_download_uri(POLICY, champion.version), dst_path=str(team.base / "champion"),
        tracking_uri=f"http://127.0.0.1:{team.section['mlflow_port']}"))
    assert list(weights.rglob("model.safetensors")), "the champion's weights load from the store"


def _paused(pid: int) -> bool:
    """The process stopped itself (``/proc``'s state ``T``)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("T")


def test_object_store_unreachable_at_the_stage_model_push_registers_nothing(team):
    project = _clone(team, "stage-push", sft={"max_steps": 10, "save_every": 5})
    for cmd in (["generate"], ["init-model"]):
        done = team.alignflow([*cmd, "--profile", "team"], project)
        assert done.returncode == 0, (cmd, done.stderr[-3000:])
    client = team.client()
    before = {r.info.run_id for r in _sft_runs(client)}
    # The stage stops itself where its model is saved and not yet pushed (ALIGNFLOW_FAULT=sft:tracking, PAUSE); the
    # store is cut there, so the model's push is the first thing that meets it.
    stage = subprocess.Popen([sys.executable, "-m", "flows.cli", "sft", "--profile", "team"], cwd=project,
                             env=team.env(project, ALIGNFLOW_FAULT="sft:tracking", ALIGNFLOW_FAULT_SIGNAL="PAUSE",
                                          MLFLOW_HTTP_REQUEST_MAX_RETRIES="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def paused():
        assert stage.poll() is None, stage.communicate()[1][-3000:]
        return _paused(stage.pid)

    try:
        wait_for(paused, 900, "the stage paused before its model push")
        held = team.keys()
    except BaseException:
        stage.kill()
        raise
    out, err = _cut_store_and_go_on(team, stage, 600)
    [run_id] = {r.info.run_id for r in _sft_runs(client)} - before
    block = one_error(subprocess.CompletedProcess(stage.args, stage.returncode, out, err), 1,
                      "the model alignflow-sft", run_id, "could not be pushed to the artifact store")
    print(block)
    assert not client.search_model_versions(f"run_id='{run_id}'"), "no version of the failed run"
    assert held <= team.keys(), "every object the store held before the fault is still there"
    again = team.alignflow(["sft", "--profile", "team"], project)  # the store back: the stage runs again and registers
    assert again.returncode == 0, again.stderr[-3000:]
    new = {r.info.run_id for r in _sft_runs(client)} - before
    assert [v.run_id for v in client.search_model_versions("name='alignflow-sft'") if v.run_id in new], \
        "the rerun registered its model"


# ---- wrong database credentials ------------------------------------------------------------------------------


def test_wrong_database_password_is_refused_at_start_and_never_printed(team):
    project = _clone(team, "creds", flow={"stages": ["dpo"]})
    client = team.client()
    exp = client.get_experiment_by_name("alignflow-test")
    runs_before = len(client.search_runs([exp.experiment_id], max_results=1000)) if exp else 0
    versions_before = sorted(v.version for v in client.search_model_versions(f"name='{POLICY}'"))
    for name in ("prefect", "mlflow"):  # the servers stopped, PostgreSQL left running: as after a server restart
        stop_group(ServiceFiles(name, team.services))
    wrong = "not-the-password-4711"

    refused = team.alignflow(["services", "up"], project, timeout=600, PGPASSWORD=wrong)
    one_error(refused, 1, "PostgreSQL at 127.0.0.1:", "refused 'alignflow'", "PGPASSWORD")
    for name in ("mlflow", "prefect"):
        assert running_pid(ServiceFiles(name, team.services)) is None, f"{name} was not started"
    run = team.alignflow(["flow", "align", "--profile", "team"], project, timeout=600, PGPASSWORD=wrong)
    one_error(run, 2, f"Prefect server http://127.0.0.1:{team.section['prefect_port']}/api", "did not answer",
              "alignflow services up")
    assert not (project / "models").exists() and not (project / "metrics").exists(), "no stage ran"

    printed = refused.stdout + refused.stderr + run.stdout + run.stderr
    files = [p for root in (team.services / "logs", project) for p in root.rglob("*") if p.is_file()]
    leaked = [str(p) for p in files if wrong.encode() in p.read_bytes()]
    assert wrong not in printed and not leaked, leaked

    up = team.alignflow(["services", "up"], project, timeout=600)  # the right password (team.env_file)
    assert up.returncode == 0, up.stdout + up.stderr
    client = team.client()
    exp = client.get_experiment_by_name("alignflow-test")
    assert (len(client.search_runs([exp.experiment_id], max_results=1000)) if exp else 0) == runs_before
    assert sorted(v.version for v in client.search_model_versions(f"name='{POLICY}'")) == versions_before
