"""The HTTP services: the S3-compatible object store, the MLflow tracking server and the Prefect server.

Each is a server program of its own, started detached (:func:`flows.services.processes.start_detached`) with its
credentials in its environment only, never on its command line: ``ps`` shows a command line to every user.

- object store: moto in server mode (``moto_server``), an S3 API over HTTP; it keeps objects in memory, so
  ``services down`` discards them: a stand-in for the team's S3 (``team.s3_endpoint_url``), which keeps them.
- MLflow: ``mlflow server`` on PostgreSQL (psycopg), artifacts proxied to ``s3://<bucket>/mlflow``; clients reach
  artifacts through the server and need no object-store credentials.
- Prefect: ``prefect server start`` on PostgreSQL (asyncpg).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from flows.services.processes import ServiceFiles, start_detached, wait_until
from rlhf_core.common.offline import OFFLINE_ENV
from rlhf_core.config import TeamConfig


def _program(name: str) -> str:
    """A console script of this environment (the venv's ``mlflow``, ``prefect``, ``moto_server``)."""
    return str(Path(sys.executable).parent / name)


def answers(url: str) -> bool:
    """True when ``url`` answers HTTP 200 within 3 s."""
    try:
        with urllib.request.urlopen(url, timeout=3) as response:  # noqa: S310 - the team's own services
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def server_env(cfg: TeamConfig, credentials: dict[str, str]) -> dict[str, str]:
    """A server's environment: this one, the offline switches, the credentials and the object store's endpoint."""
    env = {**os.environ, **OFFLINE_ENV, **credentials, "MLFLOW_S3_ENDPOINT_URL": cfg.endpoint_url}
    env.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):  # a server never talks to another one of these
        env.pop(name, None)
    return env


def object_store_health(cfg: TeamConfig) -> str:
    return f"{cfg.endpoint_url}/moto-api/"


def start_object_store(cfg: TeamConfig, files: ServiceFiles, env: dict[str, str]) -> int:
    pid = start_detached(files, [_program("moto_server"), "-H", cfg.host, "-p", str(cfg.object_store_port)], env)
    wait_until(files, lambda: answers(object_store_health(cfg)), cfg.start_timeout_s, pid)
    return pid


def ensure_bucket(cfg: TeamConfig, credentials: dict[str, str]) -> bool:
    """Create ``team.bucket`` in the object store if missing; returns True when it made it."""
    import boto3  # lazy: boto3 (the team extra)

    s3 = boto3.client("s3", endpoint_url=cfg.endpoint_url, region_name="us-east-1",
                      aws_access_key_id=credentials.get("AWS_ACCESS_KEY_ID"),
                      aws_secret_access_key=credentials.get("AWS_SECRET_ACCESS_KEY"))
    if cfg.bucket in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        return False
    s3.create_bucket(Bucket=cfg.bucket)
    return True


def database_url(cfg: TeamConfig, driver: str, database: str) -> str:
    """A SQLAlchemy URL of ``database`` with no password in it: the driver reads PGPASSWORD from the environment."""
    host, port = cfg.database_address
    return f"postgresql+{driver}://{cfg.database_user}@{host}:{port}/{database}"


def mlflow_health(cfg: TeamConfig) -> str:
    return f"{cfg.tracking_uri}/health"


def start_mlflow(cfg: TeamConfig, files: ServiceFiles, env: dict[str, str]) -> int:
    argv = [_program("mlflow"), "server", "--host", cfg.host, "--port", str(cfg.mlflow_port),
            "--backend-store-uri", database_url(cfg, "psycopg", cfg.mlflow_database),
            "--artifacts-destination", cfg.artifact_root, "--serve-artifacts", "--workers", "2"]
    pid = start_detached(files, argv, env)
    wait_until(files, lambda: answers(mlflow_health(cfg)), cfg.start_timeout_s, pid)
    return pid


def prefect_health(cfg: TeamConfig) -> str:
    return f"{cfg.prefect_api_url}/health"


def start_prefect(cfg: TeamConfig, root: Path, files: ServiceFiles, env: dict[str, str]) -> int:
    env = {**env, "PREFECT_HOME": str(root / "prefect-home"),
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url(cfg, "asyncpg", cfg.prefect_database)}
    pid = start_detached(files, [_program("prefect"), "server", "start", "--host", cfg.host,
                                 "--port", str(cfg.prefect_port)], env)
    wait_until(files, lambda: answers(prefect_health(cfg)), cfg.start_timeout_s, pid)
    return pid
