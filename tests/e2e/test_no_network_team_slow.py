"""Offline with the team profile, proven: in a network namespace of its own (only a loopback; DNS and every outside
address unreachable), ``alignflow services up`` starts PostgreSQL, the object store, the MLflow server and the
Prefect server, the micro align flow (SFT, DPO and the registration) runs against them with ``--profile team``, and nothing in that whole process
tree attempts to reach a host outside localhost.

Two watches, as in test_no_network.py and beyond it: the audit hook (tests/e2e/netwatch/sitecustomize.py) in every
Python process, the servers and their workers included, logs each connect, datagram and DNS look-up of an outside
host; strace, following every process whatever its language (PostgreSQL, git, ``ip``), records each
connect/sendto/sendmsg, and no IPv4 or IPv6 address in them is outside loopback. The namespace makes an attempt
fail; the watches make it visible. Needs root (CI runs as root) for ``unshare --net`` and strace.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import (
    cli_env,
    in_network_namespace,
    outside_addresses,
    team_clone,
    team_section,
    watched_env,
)

pytestmark = pytest.mark.slow

# Run inside the namespace after the flow, while the services are still up: what the MLflow server (on PostgreSQL)
# and the Prefect server hold of the run.
CHECK = """
import json, sys
import httpx
from mlflow.tracking import MlflowClient
mlflow_port, prefect_port, out = sys.argv[1:4]
client = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_port}")
exp = client.get_experiment_by_name("alignflow-test")
runs = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "align"]
flow_run = runs[0].data.tags["prefect.flow_run_id"] if runs else ""
state = httpx.get(f"http://127.0.0.1:{prefect_port}/api/flow_runs/{flow_run}", timeout=30).json()["state_type"]
json.dump({"align_runs": [r.info.status for r in runs], "artifacts": exp.artifact_location,
           "prefect_state": state}, open(out, "w"))
"""


def _script(team: dict, check: Path, found: Path) -> str:
    """Services up, the flow on them, the check, services down (whatever happened: strace waits for every process
    it follows, the detached servers too); exit: the flow's status, 10 when the services did not come up."""
    cli = f"{sys.executable} -m flows.cli"
    return (f"if {cli} services up; then {cli} flow align --profile team; rc=$?; "
            f"{sys.executable} {check} {team['mlflow_port']} {team['prefect_port']} {found}; else rc=10; fi; "
            f"{cli} services down; exit $rc")


def test_micro_align_flow_on_the_team_services_attempts_nothing_outside_localhost(team_base):
    assert shutil.which("unshare") and shutil.which("ip") and shutil.which("strace"), \
        "util-linux's unshare, iproute2's ip and strace are needed"
    home = team_base / "home"
    home.mkdir()
    team = team_section(team_base)
    project = team_clone(team_base, "p", team)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["flow"]["stages"] = ["dpo"]  # SFT, then one alignment stage and its registration: every service in use
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    attempts, procs, trace = team_base / "attempts.log", team_base / "procs.log", team_base / "trace.log"
    check, found = team_base / "check.py", team_base / "found.json"
    check.write_text(CHECK)
    env = watched_env({**cli_env(project), "HOME": str(home), "PREFECT_HOME": str(project / ".prefect"),
                       "OMP_WAIT_POLICY": "PASSIVE"}, attempts, procs)
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):  # the profile names the servers
        env.pop(name, None)
    try:
        proc = subprocess.run(in_network_namespace(_script(team, check, found), trace), cwd=project, env=env,
                              capture_output=True, text=True, timeout=3600)
    finally:  # a test stopped half-way leaves no server behind (pid files and pg_ctl reach across namespaces)
        subprocess.run([sys.executable, "-m", "flows.cli", "services", "down"], cwd=project, env=env,
                       capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    seen = json.loads(found.read_text())
    assert seen["align_runs"] == ["FINISHED"] and seen["prefect_state"] == "COMPLETED", seen
    assert seen["artifacts"].startswith("mlflow-artifacts:"), "artifacts go through the server to the object store"
    summary = json.loads((project / "metrics" / "align_summary.json").read_text())
    assert summary["tracking_uri"] == f"http://127.0.0.1:{team['mlflow_port']}"

    watched = procs.read_text()
    # (``python -m flows.cli`` shows as ``-m`` while site-packages load: runpy names the module later)
    for program in ("flow align --profile team", "moto_server", "bin/mlflow server", "bin/prefect server start"):
        assert program in watched, f"{program} ran under the audit hook:\n{watched[:3000]}"
    assert (attempts.read_text() if attempts.exists() else "") == "", attempts.read_text()[:3000]
    traced = trace.read_text()
    for service in ("postgres_port", "object_store_port", "mlflow_port", "prefect_port"):
        assert f"htons({team[service]})" in traced, f"the trace shows the connects to {service}"
    outside = outside_addresses(trace)
    assert outside == [], "\n".join(outside[:20])
    print(f"watched {len(watched.splitlines())} Python processes; traced {len(traced.splitlines())} socket calls, "
          "none outside loopback")
