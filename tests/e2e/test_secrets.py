"""No secrets in MLflow, logs or model folders: a reward-server URL with credentials and a token."""

from __future__ import annotations

import json

import yaml

from flows.cli import main
from rlhf_core.redact import redact_secrets

SECRETS = ("s3cr3t-pass", "tok-abc123")


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
                   "eval_file": str(micro_data["eval"]), "reward_kind": "http", "reward_url": url, "max_steps": 1,
                   "prompts_per_step": 2, "group_size": 2, "mini_batch_size": 4, "max_new_tokens": 4,
                   "eval_items": 8, "eval_at_start": False, "num_threads": 1},
            "tracking": {"experiment": "secrets", "log_model": False}}))
        assert main(["rl"]) == 0
    finally:
        server.shutdown()
    printed = capsys.readouterr()

    client = MlflowClient(tracking_uri=f"sqlite:///{isolated_project / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
    stored = json.dumps({"params": run.data.params, "tags": run.data.tags})
    assert "reward_url" in run.data.params and "***" in run.data.params["reward_url"]
    beside_model = (isolated_project / "models" / "rl" / "alignflow.json").read_text()
    for secret in SECRETS:
        assert secret not in stored and secret not in beside_model
        assert secret not in printed.out and secret not in printed.err
