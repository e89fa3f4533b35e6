"""No secrets in MLflow, logs, errors or model folders: a reward-server URL with credentials or a
query token, and a token passed by environment-variable name (``reward.token_env``)."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from flows.cli import main
from rlhf_core.config import ConfigError, RLConfig, build_config
from rlhf_core.common.redact import redact_secrets, register_secret, register_url_secrets
from rlhf_core.rewards.sources import HttpRewardSource, RewardError

SECRETS = ("s3cr3t-pass", "tok-abc123")
ENV_NAME, ENV_TOKEN = "ALIGNFLOW_TEST_RM_TOKEN", "tok-env-3c8a51f2"
QUERY_TOKEN, USER_PASS = "tok-query-7d1e9b", "pw-userinfo-91ab"
BASIC = base64.b64encode(f"bob:{USER_PASS}".encode()).decode()  # how requests sends user:pass@


class _EchoServer:
    """127.0.0.1 server that echoes the request line and Authorization header back: ``/ok`` with
    rewards (401 unless the env token is sent), ``/4xx`` as a 400, ``/5xx`` as a 500, ``/slow``
    after 2 s — the worst case of a server that quotes the request in its error pages."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
                echo = f"{self.command} {self.path} Authorization: {self.headers.get('Authorization')}"
                server_self.authorizations.append(self.headers.get("Authorization"))
                route = self.path.split("?")[0]
                if route == "/slow":
                    time.sleep(2.0)
                if route == "/ok":
                    ok = self.headers.get("Authorization") == f"Bearer {ENV_TOKEN}"
                    status, body = (200, {"rewards": [0.1] * n}) if ok else (401, {"error": f"refused: {echo}"})
                else:
                    status, body = {"/4xx": 400, "/5xx": 500}.get(route, 200), {"error": f"cannot serve {echo}"}
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out first

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def echo_server():
    server = _EchoServer()
    yield server
    server.close()


def _closed_port() -> int:
    with socket.socket() as s:  # nothing listens here once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode,expect", [("refused", "connection failed"), ("timeout", "timed out after 0.5s"),
                                         ("4xx", "HTTP 400 Bad Request (not retried)"), ("5xx", "HTTP 500: ")])
@pytest.mark.parametrize("where", ["query", "userinfo", "env"])
def test_no_secret_in_any_failure_of_the_reward_client(echo_server, mode, expect, where, monkeypatch, capfd):
    """Each failure path of HttpRewardSource, with the secret in the URL's query, in its
    user:pass@ or in an env var named by token_env: the error (message, repr, traceback) and
    everything printed name the server and the failure but hold no secret — though the 4xx and
    5xx pages quote the request line and Authorization header verbatim."""
    monkeypatch.setenv(ENV_NAME, ENV_TOKEN)
    port = _closed_port() if mode == "refused" else echo_server.port
    route = {"refused": "/ok", "timeout": "/slow", "4xx": "/4xx", "5xx": "/5xx"}[mode]
    url = {"query": f"http://127.0.0.1:{port}{route}?token={QUERY_TOKEN}&batch=4",
           "userinfo": f"http://bob:{USER_PASS}@127.0.0.1:{port}{route}",
           "env": f"http://127.0.0.1:{port}{route}"}[where]
    source = HttpRewardSource(url, timeout_s=0.5, retries=0, **({"token_env": ENV_NAME} if where == "env" else {}))
    with pytest.raises(RewardError) as err:
        source(["1+1="], ["2"], ["2"])
    printed = capfd.readouterr()
    text = "\n".join([str(err.value), repr(err.value), *traceback.format_exception(err.value), printed.out,
                      printed.err, source.name])
    for secret in (QUERY_TOKEN, USER_PASS, BASIC, ENV_TOKEN):
        assert secret not in text, (secret, text)
    assert f"127.0.0.1:{port}{route}" in str(err.value) and expect in str(err.value), str(err.value)
    if mode == "5xx":  # an excerpt of the page is kept, with the echoed secrets replaced
        assert f"cannot serve POST {route}" in str(err.value) and "***" in str(err.value)


def test_redaction_of_registered_secrets_and_env_names():
    """A registered value is scrubbed anywhere; a URL's secrets are registered raw and decoded;
    a ``*_env`` field holds a variable's name and is kept; Bearer values are scrubbed."""
    register_secret("tok-registered-41c7")
    register_secret("abc")  # too short to register: it would mangle ordinary text
    assert redact_secrets("server said: bad tok-registered-41c7!") == "server said: bad ***!"
    assert redact_secrets("abc") == "abc"
    register_url_secrets("https://rm.example/score?access_token=a%2Bb%2Fc-9f3e&batch=8")
    assert redact_secrets("echo: a+b/c-9f3e and a%2Bb%2Fc-9f3e") == "echo: *** and ***"
    assert redact_secrets({"reward_token_env": ENV_NAME, "hf_token": "x1"}) == {"reward_token_env": ENV_NAME,
                                                                              "hf_token": "***"}
    assert redact_secrets("Authorization: Bearer eyJhbGciOi.x-y_z") == "Authorization: Bearer ***"
    once = redact_secrets("reward server http://h/score?token=tok-9a8b7c: failed")
    assert once == "reward server http://h/score?token=***: failed" and redact_secrets(once) == once
    assert redact_secrets("Max retries exceeded with url: /score?sig=99&api_key=k-7 (Caused by X)") == \
        "Max retries exceeded with url: /score?sig=***&api_key=*** (Caused by X)"


def test_reward_token_env_must_name_a_set_variable(monkeypatch):
    base = {"reward.kind": "http", "reward.url": "http://127.0.0.1:9/score"}
    monkeypatch.delenv("ALIGNFLOW_UNSET_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"rl\.reward\.token_env: environment variable ALIGNFLOW_UNSET_TOKEN is not "
                                          r"set"):
        build_config(RLConfig, "rl", {**base, "reward.token_env": "ALIGNFLOW_UNSET_TOKEN"})
    with pytest.raises(ConfigError, match=r"rl\.reward\.token_env: must be the NAME of an environment variable") as err:
        build_config(RLConfig, "rl", {**base,
                                      "reward.token_env": "tok-pasted-by-mistake"})  # the token itself, not a name
    assert "tok-pasted-by-mistake" not in str(err.value)
    monkeypatch.setenv(ENV_NAME, ENV_TOKEN)
    assert build_config(RLConfig, "rl", {**base, "reward.token_env": ENV_NAME}).reward.token_env == ENV_NAME
    # unused (and unchecked) when rewards do not come from a server
    assert build_config(RLConfig, "rl", {"reward.token_env": "ALIGNFLOW_UNSET_TOKEN"}).reward.kind == "function"


def test_redact_secrets_rules():
    cfg = {"reward_url": "https://bob:s3cr3t-pass@rm.example.com/score?token=tok-abc123&batch=8",
           "hf_token": "hf_xyz", "nested": {"API_KEY": "k1", "auth_header": "Bearer x"},
           "tokenizer_dir": "models/tok", "max_new_tokens": 8, "urls": ["http://u:p@h/"]}
    out = redact_secrets(cfg)
    assert out["reward_url"] == "https://***@rm.example.com/score?token=***&batch=8"
    assert out["hf_token"] == out["nested"]["API_KEY"] == out["nested"]["auth_header"] == "***"
    assert out["tokenizer_dir"] == "models/tok" and out["max_new_tokens"] == 8  # not secrets
    assert out["urls"] == ["http://***@h/"]


def test_reward_url_secrets_stay_out_of_mlflow_and_the_model(isolated_project, micro_model, micro_data, capsys):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    from mlflow.tracking import MlflowClient

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
            body = json.dumps({"rewards": [0.1] * n}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://bob:{SECRETS[0]}@127.0.0.1:{server.server_address[1]}/score?token={SECRETS[1]}"
        (isolated_project / "params.yaml").write_text(yaml.safe_dump({
            "rl": {"model_path": str(micro_model), "prompts_file": str(micro_data["prompts"]),
                   "eval_file": str(micro_data["eval"]), "reward.kind": "http", "reward.url": url, "max_steps": 1,
                   "rollout.prompts_per_step": 2, "rollout.group_size": 2, "algorithm.mini_batch_size": 4,
                   "rollout.max_new_tokens": 4,
                   "eval_items": 8, "eval_at_start": False, "num_threads": 1},
            "tracking": {"experiment": "secrets", "log_model": False}}))
        assert main(["rl"]) == 0
    finally:
        server.shutdown()
    printed = capsys.readouterr()

    client = MlflowClient(tracking_uri=f"sqlite:///{isolated_project / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
    stored = json.dumps({"params": run.data.params, "tags": run.data.tags})
    assert "reward.url" in run.data.params and "***" in run.data.params["reward.url"]
    beside_model = (isolated_project / "models" / "rl" / "alignflow.json").read_text()
    for secret in SECRETS:
        assert secret not in stored and secret not in beside_model
        assert secret not in printed.out and secret not in printed.err


def test_failing_rl_stage_leaks_no_token_to_stderr_or_mlflow(isolated_project, micro_model, micro_data, echo_server,
                                                             monkeypatch, capsys):
    """``alignflow rl`` against a server whose 500 page quotes the request (query token) and the
    Authorization header (token from reward_token_env): exit 1 with the server and status on
    stderr; the token was sent, and is in neither stderr nor MLflow, which holds the variable's name."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv(ENV_NAME, ENV_TOKEN)
    url = f"http://127.0.0.1:{echo_server.port}/5xx?token={QUERY_TOKEN}"
    (isolated_project / "params.yaml").write_text(yaml.safe_dump({
        "rl": {"model_path": str(micro_model), "prompts_file": str(micro_data["prompts"]),
               "eval_file": str(micro_data["eval"]), "reward.kind": "http", "reward.url": url,
               "reward.token_env": ENV_NAME, "reward.retries": 0, "max_steps": 1, "rollout.prompts_per_step": 2,
               "rollout.group_size": 2, "algorithm.mini_batch_size": 4, "rollout.max_new_tokens": 4, "eval_items": 8,
               "eval_at_start": False,
               "num_threads": 1},
        "tracking": {"experiment": "secrets-fail", "log_model": False}}))
    echo_server.authorizations.clear()
    assert main(["rl"]) == 1
    printed = capsys.readouterr()
    assert echo_server.authorizations == [f"Bearer {ENV_TOKEN}"]  # sent once (no retries), as a bearer header
    assert f"127.0.0.1:{echo_server.port}/5xx?token=***" in printed.err and "HTTP 500: " in printed.err, printed.err

    client = MlflowClient(tracking_uri=f"sqlite:///{isolated_project / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("secrets-fail").experiment_id])
    assert run.info.status == "FAILED" and run.data.params["reward.token_env"] == ENV_NAME
    stored = json.dumps({"params": run.data.params, "tags": run.data.tags})
    for secret in (QUERY_TOKEN, ENV_TOKEN):
        assert secret not in stored and secret not in printed.out and secret not in printed.err


def _prefect_records(flow_run_id: str):
    """The flow run (parameters included) and everything Prefect's API holds about it, as one text:
    the flow run, its states, its task runs (their inputs) and their states, and its logs."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    async def fetch():
        async with get_client() as client:
            flow_run = await client.read_flow_run(flow_run_id)
            texts = [flow_run.model_dump_json()]
            texts += [s.model_dump_json() for s in await client.read_flow_run_states(flow_run_id)]
            task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            for task_run in task_runs:
                texts.append(task_run.model_dump_json())
                texts += [s.model_dump_json() for s in await client.read_task_run_states(task_run.id)]
            logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            texts += [log.message for log in logs]
            return flow_run, "\n".join(texts), [t.name for t in task_runs]

    flow_run, text, names = asyncio.run(fetch())
    return flow_run, text + "\n" + " ".join(names)


def test_set_secrets_stay_out_of_prefect(isolated_project, echo_server, prefect_server):
    """``alignflow flow align --set rl.reward.url=http://bob:PW@host/5xx?token=TOK``: the URL reaches
    the rl stage (the server sees the request and its Basic auth), yet Prefect's API holds no
    secret: the flow-run parameters show the override redacted, plus the path of a private 0600
    file with the real value (named by its sha256, so a changed value is a changed parameter);
    task runs, state messages and logs hold none either. Fails where --set values were passed
    as flow-run parameters verbatim."""
    import os
    import stat
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from helpers import write_micro_params

    write_micro_params(isolated_project)
    url = f"http://bob:{USER_PASS}@127.0.0.1:{echo_server.port}/5xx?token={QUERY_TOKEN}"
    echo_server.authorizations.clear()
    started = time.time()
    code = main(["flow", "align", "--set", "flow.stages=[rl]", "--set", "flow.retries=0", "--set",
                 "rl.reward.kind=http",
                 "--set", f"rl.reward.url={url}", "--set", "rl.reward.retries=0", "--set", "rl.eval_at_start=false"])
    assert code == 1  # the 500 page fails the rl stage (RewardError)
    assert echo_server.authorizations == [f"Basic {BASIC}"], "the real URL, credentials included, reached the stage"

    client = MlflowClient(tracking_uri=f"sqlite:///{isolated_project / 'mlflow.db'}")
    [parent] = [r for r in client.search_runs([client.get_experiment_by_name("alignflow-test").experiment_id])
                if r.info.run_name == "align"]
    flow_run, prefect_text = _prefect_records(parent.data.tags["prefect.flow_run_id"])
    for secret in (QUERY_TOKEN, USER_PASS, BASIC):
        assert secret not in prefect_text, (secret, prefect_text[:5000])
    assert "train-rl" in prefect_text and "HTTP 500" in prefect_text  # the task ran and failed on the server
    params = flow_run.parameters
    assert params["overrides"]["rl"]["reward.url"] == f"http://***@127.0.0.1:{echo_server.port}/5xx?token=***"
    assert params["overrides"]["flow"] == {"stages": ["rl"], "retries": 0}  # what holds no secret stays readable
    private = Path(params["private_overrides"])
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and stat.S_IMODE(private.parent.stat().st_mode) == 0o700
    assert json.loads(private.read_text()) == {"rl": {"reward.url": url}}
    # the result files Prefect wrote for this flow hold no secret either
    storage = Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"])
    for path in (p for p in storage.rglob("*") if p.is_file() and p.stat().st_mtime >= started):
        assert not any(s in path.read_text(errors="replace") for s in (QUERY_TOKEN, USER_PASS)), path

    # the parameter names the value by its hash: the same value, the same file; another, another
    from flows.cli import _flow_overrides

    other = url.replace(QUERY_TOKEN, "tok-other-5e6f7a")
    assert _flow_overrides([f"rl.reward.url={url}"])[1] == str(private)
    assert _flow_overrides([f"rl.reward.url={other}"])[1] != str(private)
    assert _flow_overrides(["dpo.max_steps=4"]) == ({"dpo": {"max_steps": 4}}, None)  # no secret, no file
