"""Nightly runs that tell someone: on the team profile's Prefect server (``alignflow services up``), ``alignflow
nightly`` with ``ALIGNFLOW_NOTIFY_WEBHOOK`` set makes the alert automations (flows/nightly_alerts.py), and a local
webhook receiver started by this test, a real HTTP server, gets their posts:

- failed: a triggered nightly run that fails (its params name an unknown stage) is posted, naming the run and ``Failed``;
- missed: with the serving process stopped, a triggered run never starts; Prefect marks it late and, the deadline
  after that, the receiver gets a post naming that run. The failed run, final within its deadline, is never posted
  as missed. (The deadline is 30 minutes while runs are served, as a run's start can take minutes on busy cores; it
  is then set to 20 s, as ``alignflow nightly --deadline 20`` would at its start, so the missed run's post comes
  soon.)

The URL carries a token, printed nowhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows import nightly_alerts as alerts
from helpers import cli_env, free_port, stop_group, team_clone, team_section, wait_for

pytestmark = pytest.mark.slow

TOKEN = "hook-token-5150"
SERVED_DEADLINE_S = 1800
DEADLINE_S = 20


class Receiver(BaseHTTPRequestHandler):
    """The webhook: records every POST's path and JSON body on the server object."""

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.posts.append({"path": self.path, "body": json.loads(body or b"{}"), "at": time.monotonic()})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture()
def receiver():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Receiver)
    server.posts = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def _env(project: Path, home: Path, **extra: str) -> dict[str, str]:
    env = {**cli_env(project), "HOME": str(home), "PREFECT_HOME": str(project / ".prefect"),
           "PYTHONUNBUFFERED": "1", **extra}
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):  # the profile names the servers
        env.pop(name, None)
    return env


def _posts_about(receiver, run_id: str, timeout: float, what: str) -> list[dict]:
    return wait_for(lambda: [p for p in receiver.posts if run_id in p["body"].get("text", "")], timeout, what)


def test_failed_and_missed_nightly_runs_reach_the_webhook(team_base, receiver):
    home = team_base / "home"
    home.mkdir()
    team = team_section(team_base)
    project = team_clone(team_base, "p", team)
    api = f"http://127.0.0.1:{team['prefect_port']}/api"
    url = f"http://127.0.0.1:{receiver.server_port}/hook?token={TOKEN}"
    up = subprocess.run([sys.executable, "-m", "flows.cli", "services", "up"], cwd=project, env=_env(project, home),
                        capture_output=True, text=True, timeout=1200)
    serve = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        log = team_base / "nightly.log"
        # params whose flow section names no stage the flow knows: each run fails at once, in the flow
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["flow"]["stages"] = ["no_such_stage"]
        (project / "broken.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "nightly", "--profile", "team", "--params",
                                  "broken.yaml", "--deadline", str(SERVED_DEADLINE_S)], cwd=project,
                                 env=_env(project, home, ALIGNFLOW_NOTIFY_WEBHOOK=url), stdout=open(log, "w"),
                                 stderr=subprocess.STDOUT, start_new_session=True)

        def deployment():
            found = httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()
            return next((d for d in found if d["name"] == "nightly-align"), None)

        dep = wait_for(deployment, 1200, "the served nightly deployment")
        automations = httpx.post(f"{api}/automations/filter", json={}, timeout=10).json()
        assert sorted(a["name"] for a in automations) == ["alignflow nightly failed",
                                                          "alignflow nightly missed its deadline"]
        failed = httpx.post(f"{api}/deployments/{dep['id']}/create_flow_run", json={}, timeout=30).json()
        (post,) = _posts_about(receiver, failed["id"], 1200, "the failed run's post")
        assert post["path"] == f"/hook?token={TOKEN}"
        assert post["body"]["subject"].endswith(": Failed") and "state Failed" in post["body"]["text"], post
        assert "align/nightly-align" in post["body"]["text"], post

        stop_group(serve)  # the machine that serves the nightly runs is gone: the next run never starts
        with temporary_settings(updates={PREFECT_API_URL: api}):
            alerts.ensure_nightly_alerts(url, DEADLINE_S)
        missed = httpx.post(f"{api}/deployments/{dep['id']}/create_flow_run", json={}, timeout=30).json()
        created = time.monotonic()
        (post,) = _posts_about(receiver, missed["id"], 900, "the missed run's post")
        assert "not finished within its deadline" in post["body"]["subject"], post
        assert "state Late" in post["body"]["text"] or "state Scheduled" in post["body"]["text"], post
        assert post["at"] - created >= DEADLINE_S, "posted after the deadline, not before"
        state = httpx.get(f"{api}/flow_runs/{missed['id']}", timeout=10).json()["state_type"]
        assert state == "SCHEDULED", "the missed run never started"
        time.sleep(DEADLINE_S)  # the failed run was final within its deadline: never posted as missed
        assert len([p for p in receiver.posts if failed["id"] in p["body"]["text"]]) == 1, receiver.posts
        printed = log.read_text()
        assert f"nightly alerts: failed, crashed or not finished within {SERVED_DEADLINE_S} s -> http://127.0.0.1" \
            in printed, printed
        assert TOKEN not in printed + up.stdout + up.stderr, "the webhook's token is printed nowhere"
        print(f"posts: {[(p['body']['subject']) for p in receiver.posts]}")
    finally:
        if serve is not None and serve.poll() is None:
            stop_group(serve)
        down = subprocess.run([sys.executable, "-m", "flows.cli", "services", "down"], cwd=project,
                              env=_env(project, home), capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
