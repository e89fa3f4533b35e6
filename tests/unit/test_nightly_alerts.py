"""The nightly alerts' pieces without a server (the slow e2e test_nightly_alerts_slow.py fires them): where the
webhook URL comes from, that its token is never shown, and the two triggers Prefect validates."""

from __future__ import annotations

from datetime import timedelta

import pytest

from flows import nightly_alerts as alerts
from rlhf_core.config import ConfigError, TeamConfig


def test_the_webhook_url_comes_from_the_environment_then_the_team_env_file(tmp_path, monkeypatch):
    monkeypatch.delenv(alerts.WEBHOOK_ENV, raising=False)
    project, env_file = tmp_path / "project", tmp_path / "home" / "team.env"
    project.mkdir()
    cfg = TeamConfig(env_file=str(env_file))
    assert alerts.webhook_url(cfg, project) is None
    env_file.parent.mkdir()
    env_file.write_text(f"PGPASSWORD=x\n{alerts.WEBHOOK_ENV}=https://hooks.example/T0/B0/file-secret\n")
    env_file.chmod(0o600)
    assert alerts.webhook_url(cfg, project) == "https://hooks.example/T0/B0/file-secret"
    monkeypatch.setenv(alerts.WEBHOOK_ENV, "http://127.0.0.1:9/hook?token=env-secret")
    assert alerts.webhook_url(cfg, project) == "http://127.0.0.1:9/hook?token=env-secret"
    monkeypatch.setenv(alerts.WEBHOOK_ENV, "hooks.example/no-scheme-secret")
    with pytest.raises(ConfigError, match="must be an http\\(s\\) URL") as err:
        alerts.webhook_url(cfg, project)
    assert "no-scheme-secret" not in str(err.value)


def test_a_shown_url_keeps_only_scheme_and_host():
    assert alerts.shown("https://hooks.example/T0/B0/secret?x=1") == "https://hooks.example/…"
    assert alerts.shown("http://127.0.0.1:8080/hook?token=secret") == "http://127.0.0.1:8080/…"


def test_the_triggers_watch_nightly_runs_for_failure_and_for_a_missed_deadline():
    triggers = alerts.nightly_triggers(deadline_s=3600)
    failed, missed = triggers[alerts.FAILED], triggers[alerts.MISSED]
    assert failed.posture == "Reactive" and failed.expect == {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}
    assert missed.posture == "Proactive" and missed.within == timedelta(hours=1)
    assert missed.after == {"prefect.flow-run.Late", "prefect.flow-run.Pending"}
    # a run that reaches any final state in time (a failure included: FAILED reports it) is not missed
    assert missed.expect == {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Crashed", "Cancelled")}
    assert missed.for_each == {"prefect.resource.id"}, "one deadline per flow run"
    for trigger in (failed, missed):
        related = trigger.match_related
        assert related.get("prefect.resource.id") == ["prefect.tag.nightly"]
        assert related.get("prefect.resource.role") == ["tag"]


def test_a_deadline_under_ten_seconds_is_refused_before_anything_is_made(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing listens: nothing must be called
    with pytest.raises(ConfigError, match="nightly --deadline: at least 10 seconds"):
        alerts.ensure_nightly_alerts("http://127.0.0.1:9/hook", 5)
