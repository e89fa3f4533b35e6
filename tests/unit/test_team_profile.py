"""The team section, its credentials file and the profile switch (rlhf_core/config/team.py, flows/services/
credentials.py, flows/profiles.py): bad values name their field, credentials never appear in an error, a file
others may read is refused, and ``--profile team`` points the process at the section's services."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flows.profiles import Profile, apply_team_profile, params_file, take_profile
from flows.services.credentials import ensure_credentials, read_credentials, team_credentials
from rlhf_core.config import ConfigError, TeamConfig, load_config


@pytest.mark.parametrize("values, message", [
    ({"mlflow_port": 70000}, "team.mlflow_port: must be a TCP port"),
    ({"prefect_port": 5000}, "team.postgres_port: the four local services need four ports"),
    ({"bucket": "Bad_Bucket"}, "team.bucket: must be an S3 bucket name"),
    ({"s3_endpoint_url": "https://key:secret@s3.example.com"}, "team.s3_endpoint_url: holds a user name or password"),
    ({"database_host": "admin:pw@db.example.com"}, "team.database_host: holds a user name or password"),
    ({"s3_endpoint_url": "s3.example.com"}, "team.s3_endpoint_url: must be an http"),
    ({"prefect_database": "alignflow_mlflow"}, "team.prefect_database: MLflow and Prefect each need a database"),
    ({"database_user": "al; DROP"}, "team.database_user: must be a plain PostgreSQL name"),
])
def test_bad_team_values_name_their_field(values, message):
    with pytest.raises(ConfigError, match=message) as err:
        TeamConfig(**values)
    assert "secret" not in str(err.value) and "pw@" not in str(err.value)


def test_the_shipped_params_file_has_a_team_section_of_defaults():
    cfg = load_config(TeamConfig, "team", Path(__file__).resolve().parents[2] / "params.yaml")
    assert cfg == TeamConfig()
    assert (cfg.tracking_uri, cfg.prefect_api_url, cfg.endpoint_url) == (
        "http://127.0.0.1:5000", "http://127.0.0.1:4200/api", "http://127.0.0.1:9000")
    assert (cfg.artifact_root, cfg.dvc_remote_url) == ("s3://alignflow/mlflow", "s3://alignflow/dvc")
    managed = TeamConfig(database_host="db.internal", s3_endpoint_url="https://s3.eu-west-1.amazonaws.com")
    assert managed.database_address == ("db.internal", 5432) and not managed.local_object_store


def test_env_file_refused_when_others_may_read_it(tmp_path):
    path = tmp_path / "team.env"
    path.write_text("PGPASSWORD=hunter2\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0644 lets others read") as err:
        read_credentials(path)
    assert "hunter2" not in str(err.value)
    path.write_text("PGPASSWORD hunter2\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=r"team.env:1: not a KEY=VALUE line") as err:
        read_credentials(path)
    assert "hunter2" not in str(err.value)


def test_credentials_come_from_the_environment_first_and_are_made_when_missing(tmp_path, monkeypatch):
    for key in ("PGPASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    project = tmp_path / "project"
    project.mkdir()
    cfg = TeamConfig(env_file=str(tmp_path / "home" / "team.env"))
    made = ensure_credentials(cfg, project)
    path = tmp_path / "home" / "team.env"
    assert set(made) == {"PGPASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert path.stat().st_mode & 0o777 == 0o600 and read_credentials(path) == made
    assert ensure_credentials(cfg, project) == made  # a second `up` keeps them
    monkeypatch.setenv("PGPASSWORD", "from-env")
    assert team_credentials(cfg, project)["PGPASSWORD"] == "from-env"
    inside = TeamConfig(env_file=str(project / "team.env"))
    with pytest.raises(ConfigError, match="team.env_file: .* is inside the project folder"):
        team_credentials(inside, project)


def test_a_managed_service_without_credentials_is_an_error(tmp_path, monkeypatch):
    for key in ("PGPASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    project = tmp_path / "project"
    project.mkdir()
    cfg = TeamConfig(database_host="db.internal", env_file=str(tmp_path / "team.env"))
    with pytest.raises(ConfigError, match="PGPASSWORD not set for the team's managed service"):
        ensure_credentials(cfg, project)
    assert not (tmp_path / "team.env").exists()


def test_the_profile_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv("ALIGNFLOW_PROFILE", raising=False)
    assert take_profile(["flow", "align"]) == (Profile.EMBEDDED, ["flow", "align"])
    assert take_profile(["flow", "--profile", "team", "align"]) == (Profile.TEAM, ["flow", "align"])
    monkeypatch.setenv("ALIGNFLOW_PROFILE", "team")
    assert take_profile(["flow", "align"])[0] is Profile.TEAM
    assert take_profile(["--profile=embedded", "flow"])[0] is Profile.EMBEDDED
    monkeypatch.setenv("ALIGNFLOW_PROFILE", "tema")
    with pytest.raises(ConfigError, match="ALIGNFLOW_PROFILE: unknown profile 'tema'; known: embedded, team"):
        take_profile(["flow"])
    assert params_file(["flow", "align", "--params", "other.yaml"]) == "other.yaml"


def test_the_team_profile_points_the_process_and_dvc_at_the_services(tmp_path, monkeypatch):
    import subprocess

    project = tmp_path / "project"
    project.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "-q"], cwd=project, check=True)
    (project / "params.yaml").write_text(f"team:\n  mlflow_port: 15000\n  env_file: {tmp_path}/team.env\n")
    (tmp_path / "team.env").write_text("AWS_ACCESS_KEY_ID=key\nAWS_SECRET_ACCESS_KEY=secret\n")
    (tmp_path / "team.env").chmod(0o600)
    monkeypatch.setenv("ALIGNFLOW_HOME", str(project))
    # setenv then delenv: monkeypatch restores (here: removes) only what it recorded, and a delenv of an unset
    # variable records nothing, so the profile's settings would outlive the test (later flows would call 4200)
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "MLFLOW_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    apply_team_profile(str(project / "params.yaml"))
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:15000"
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "secret"
    local = (project / ".dvc" / "config.local").read_text()
    assert "remote = team" in local and "s3://alignflow/dvc" in local and "secret" not in local


def test_the_team_section_is_logged_unredacted():
    """Every run logs every section's params, redacted by field name and value: the team section holds no secret,
    so it must come out whole (a field named like a secret would be logged as *** and differ on reproduce)."""
    from rlhf_core.common.redact import redact_secrets
    from rlhf_core.config import config_to_dict

    values = config_to_dict(TeamConfig())
    assert redact_secrets(values) == values
