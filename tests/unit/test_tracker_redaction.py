"""Every table and text artifact a run writes is redacted by the tracker itself, whoever calls it:
a completion, a data-report page or a trajectory can carry a token like any other text."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from rlhf_core.tracking.mlflow_runs import LocalFileTracker, MlflowTracker

ROW = {"step": 1, "prompt": "call https://api.example/v1?token=TOK3N-VALUE-42", "completion": "Bearer abc.DEF-123",
       "reward": 0.5}
TEXT = "<p>https://alice:S3cretPass@host/ and ?api_key=KEY-VALUE-77</p>"
SECRETS = ("TOK3N-VALUE-42", "abc.DEF-123", "S3cretPass", "KEY-VALUE-77")


def _all_text(root) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


def test_local_tracker_redacts_tables_and_text(tmp_path):
    run = LocalFileTracker(tmp_path / "runs", "r1")
    run.log_table([ROW], "rollouts.json")
    run.log_text(TEXT, "page.html")
    written = _all_text(tmp_path / "runs")
    assert "***" in written and not any(s in written for s in SECRETS)


def test_mlflow_tracker_redacts_tables_and_text(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("redaction", artifact_location=(tmp_path / "artifacts").as_uri())
    run = MlflowTracker(client, client.create_run(exp).info.run_id)
    run.log_table([ROW], "rollouts.json")
    run.log_text(TEXT, "page.html")
    written = _all_text(tmp_path / "artifacts")
    assert "rollouts.json" in str(list((tmp_path / "artifacts").rglob("*.json")))
    assert "***" in written and not any(s in written for s in SECRETS)
