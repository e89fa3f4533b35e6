"""Scale-out against a real Ray cluster that the test starts with ``ray start --head``.

1. ``RAY_ADDRESS=<head> alignflow sft --set num_workers=2``: the two data-parallel ranks are actors of
   that cluster (Ray's own actor listing shows them, on its one node), not of a new local instance.
2. A Prefect flow with ``flow.ray_address`` set submits its training task through prefect-ray: the task
   runs as a Ray task on the cluster (Ray's task listing names it) and reports to the Prefect server.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, run_cli, stop_group, wait_for, write_micro_params
from rlhf_core.common.offline import OFFLINE_ENV

RAY = str(Path(sys.executable).parent / "ray")


def _ray_list(what: str, dashboard: str, *filters: str) -> list[dict]:
    args = [RAY, "list", what, "--address", dashboard, "--format", "json", "--limit", "1000"]
    for f in filters:
        args += ["--filter", f]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture()
def ray_cluster(prefect_api, tmp_path, monkeypatch):
    """``ray start --head --block`` with a dashboard (Ray's state API) and 6 logical CPUs, in a process group
    of its own that is killed afterwards (``ray stop`` would stop every Ray instance on the machine)."""
    port, dash = free_port(), free_port()
    # Ray 2.60 clusters require a token; the head and every client of this test share one.
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for key, value in token.items():
        monkeypatch.setenv(key, value)
    env = {**os.environ, **OFFLINE_ENV, "PREFECT_API_URL": prefect_api}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dash}",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--num-cpus=6",
                             "--disable-usage-stats"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: head.poll() is None and subprocess.run(
            [RAY, "list", "nodes", "--address", f"http://127.0.0.1:{dash}"], capture_output=True, env=env,
            timeout=60).returncode == 0, 180, "ray start --head")
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", prefect_api
    finally:
        stop_group(head, signal.SIGTERM, timeout=60)


@pytest.mark.slow  # 95 s with the cluster's teardown: `make test` stays under 20 minutes; make test-slow runs it
def test_training_uses_the_cluster_ray_address_names(ray_cluster, tmp_path, monkeypatch):
    address, dashboard, prefect_api = ray_cluster
    write_micro_params(tmp_path)
    for cmd in (["generate"], ["init-model"]):
        proc = run_cli(cmd, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]

    # ---- 1. the CLI attaches to RAY_ADDRESS's cluster -----------------------------------------
    monkeypatch.setenv("RAY_ADDRESS", address)
    proc = run_cli(["sft", "--set", "num_workers=2", "--set", "max_steps=4", "--set", "eval_items=10"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"ray: attached to cluster at [0-9.]+:{address.rsplit(':', 1)[1]}", proc.stderr), proc.stderr[-2000:]
    config = json.loads((tmp_path / "models/sft/alignflow.json").read_text())["config"]
    assert config["num_workers"] == 2
    actors = _ray_list("actors", dashboard, "class_name=TrainerActor")
    assert len(actors) == 2, actors
    nodes = _ray_list("nodes", dashboard)
    assert len(nodes) == 1 and {a["node_id"] for a in actors} == {nodes[0]["node_id"]}
    jobs = _ray_list("jobs", dashboard)
    assert any("flows.cli sft" in (j.get("entrypoint") or "") for j in jobs), jobs

    # ---- 2. a Prefect task submitted to the cluster through prefect-ray -----------------------
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    out = subprocess.run([sys.executable, "-c", _FLOW, address, str(tmp_path)], cwd=tmp_path,
                         env={**os.environ, "ALIGNFLOW_HOME": str(tmp_path)}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["outputs"]["model"]).joinpath("model.safetensors").exists()
    tasks = _ray_list("tasks", dashboard)
    ran = [t for t in tasks if "train-sft" in (t.get("name") or "")]
    assert ran and all(t["state"] == "FINISHED" for t in ran), [t.get("name") for t in tasks]
    assert ran[0]["node_id"] == nodes[0]["node_id"]


# A flow run in its own process, as a user's would be; it reports to the test's Prefect server.
_FLOW = r'''
import json, sys
from pathlib import Path
from prefect import flow
from flows.align import _run
from rlhf_core.config import FlowConfig, SFTConfig, TrackingConfig, config_to_dict
from tasks.training import train_sft

address, project = sys.argv[1], Path(sys.argv[2])

@flow(name="sft-on-ray")
def sft_on_ray():
    params = config_to_dict(SFTConfig(model_path=str(project / "models/base"),
                                      train_file=str(project / "data/embedded/sft.jsonl"),
                                      eval_file=str(project / "data/embedded/eval.jsonl"),
                                      output_dir=str(project / "models/sft-ray"),
                                      checkpoint_dir=str(project / "checkpoints/sft-ray"),
                                      max_steps=3, batch_size=16, eval_items=10))
    tracking = config_to_dict(TrackingConfig(tracking_uri=f"sqlite:///{project / 'mlflow.db'}",
                                             artifact_dir=str(project / "mlartifacts"), log_model=False))
    return _run(train_sft, FlowConfig(ray_address=address, use_cache=False, retries=0), params=params,
                tracking=tracking, input_md5={"test": "ray"})

print(json.dumps(sft_on_ray()))
'''
