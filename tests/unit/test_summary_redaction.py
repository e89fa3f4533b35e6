"""The run summary (printed by ``alignflow flow align`` and written to metrics/*_summary.json)
never carries the tracking server's credentials."""

from __future__ import annotations

import json

from flows.align import align_summary, load_all
from flows.cli import _write_summary


def _summary(cfg):
    sft = {"md5": {"model": "0" * 32 + ".dir"}, "outputs": {"model": "models/sft"}, "metrics": {}, "model_uri": None}
    return align_summary(cfg, "run123", {"sft": "data/sft.jsonl"}, {"sft": "1" * 32}, "2" * 32 + ".dir", sft, {},
                         None, {"eval/accuracy_base": 0.5})


def test_summary_tracking_uri_has_no_password(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_all(None, {"tracking": {"tracking_uri": "https://alice:Pa55wordXYZ@mlflow.example:5000"}})
    summary = _summary(cfg)
    assert summary["tracking_uri"] == "https://***@mlflow.example:5000"
    _write_summary(summary, str(tmp_path / "metrics" / "align_summary.json"))
    assert "Pa55wordXYZ" not in (tmp_path / "metrics" / "align_summary.json").read_text()

    # the environment variable wins over the config, and is redacted the same way (a query token too)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://bob:Hunter2pass@mlflow.example/?token=TOKENVALUE42")
    text = json.dumps(_summary(cfg))
    assert "Hunter2pass" not in text and "TOKENVALUE42" not in text and "mlflow.example" in text
