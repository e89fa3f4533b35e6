"""The ``team`` section: where the team profile's services listen and keep their state.

``alignflow services up`` starts them on one machine (PostgreSQL, an S3-compatible object store, an MLflow
tracking server and a Prefect server, both on PostgreSQL); ``--profile team`` (or ``ALIGNFLOW_PROFILE=team``)
points the pipeline at them. A field naming a team's own managed PostgreSQL or S3 endpoint makes ``services up``
start only what is still local. Credentials are never fields here: they come from the environment or
:attr:`TeamConfig.env_file` (``flows/services/credentials.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlhf_core.config.base import _check

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_USERINFO = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@]*@", re.IGNORECASE)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass
class TeamConfig:
    """``team``: the shared services of the team profile and how the pipeline reaches them."""

    host: str = "127.0.0.1"
    """Address every local service listens on and the pipeline connects to."""
    postgres_port: int = 5433
    """Port of the local PostgreSQL that ``alignflow services up`` starts (5433: beside a system one on 5432)."""
    database_host: str = ""
    """A team's managed PostgreSQL (host name); empty: the local one at host:postgres_port."""
    database_port: int = 5432
    """Port of database_host (unused for the local PostgreSQL)."""
    database_user: str = "alignflow"
    """PostgreSQL role the MLflow and Prefect servers log in as (its password: PGPASSWORD)."""
    mlflow_database: str = "alignflow_mlflow"
    """Database of the MLflow tracking server."""
    prefect_database: str = "alignflow_prefect"
    """Database of the Prefect server."""
    object_store_port: int = 9000
    """Port of the local S3-compatible object store (moto in server mode)."""
    s3_endpoint_url: str = ""
    """A team's S3 endpoint (e.g. https://s3.eu-west-1.amazonaws.com or a MinIO URL); empty: the local store."""
    bucket: str = "alignflow"
    """Bucket holding MLflow's artifacts (under mlflow/) and the DVC remote (under dvc/)."""
    mlflow_port: int = 5000
    """Port of the MLflow tracking server."""
    prefect_port: int = 4200
    """Port of the Prefect server (its API at /api)."""
    gpu_devices: int = 0
    """Slots of the GPU concurrency limit (flow.gpu_limit) that ``services up`` creates: the GPUs the flows
    share; 0: this machine's count (nvidia-smi; 1 without GPUs)."""
    data_dir: str = ".alignflow/services"
    """Folder of the local services' data, logs and pid files, relative to the project root unless absolute."""
    env_file: str = "~/.config/alignflow/team.env"
    """KEY=VALUE file (mode 0600, outside the repository) of PGPASSWORD, AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY; the environment wins. ``services up`` writes new random ones here when it is missing.
    (Not named like a secret: every run logs its params, and a field named so is logged as ***.)"""
    start_timeout_s: float = 120.0
    """Seconds ``services up`` waits for each service to answer before it stops and reports its log."""

    def __post_init__(self) -> None:
        s = "team"
        for name in ("postgres_port", "database_port", "object_store_port", "mlflow_port", "prefect_port"):
            port = getattr(self, name)
            _check(isinstance(port, int) and 0 < port < 65536, s, name, f"must be a TCP port (1-65535), got {port!r}")
        local = [self.postgres_port, self.object_store_port, self.mlflow_port, self.prefect_port]
        _check(len(set(local)) == len(local), s, "postgres_port",
               f"the four local services need four ports, got {local} (postgres, object store, mlflow, prefect)")
        _check(bool(_BUCKET.match(self.bucket)), s, "bucket",
               f"must be an S3 bucket name (3-63 of a-z 0-9 . -), got {self.bucket!r}")
        for name in ("database_user", "mlflow_database", "prefect_database"):
            _check(bool(_NAME.match(getattr(self, name))), s, name,
                   f"must be a plain PostgreSQL name (letters, digits, _), got {getattr(self, name)!r}")
        _check(self.mlflow_database != self.prefect_database, s, "prefect_database",
               "MLflow and Prefect each need a database of their own")
        for name in ("host", "database_host", "s3_endpoint_url"):
            _check(not _USERINFO.match(getattr(self, name)) and "@" not in getattr(self, name), s, name,
                   "holds a user name or password: credentials go in the environment or team.env_file, "
                   "never in params")
        _check(not self.s3_endpoint_url or self.s3_endpoint_url.startswith(("http://", "https://")), s,
               "s3_endpoint_url", f"must be an http(s) URL or empty (the local store), got {self.s3_endpoint_url!r}")
        _check(self.gpu_devices >= 0, s, "gpu_devices", f"must be >= 0 (0: count this machine's), got {self.gpu_devices}")
        _check(self.start_timeout_s > 0, s, "start_timeout_s", f"must be > 0 seconds, got {self.start_timeout_s}")

    @property
    def local_database(self) -> bool:
        """True when ``services up`` runs PostgreSQL itself (no managed database_host)."""
        return not self.database_host

    @property
    def local_object_store(self) -> bool:
        """True when ``services up`` runs the object store itself (no s3_endpoint_url)."""
        return not self.s3_endpoint_url

    @property
    def database_address(self) -> tuple[str, int]:
        """(host, port) the servers reach PostgreSQL at."""
        return (self.host, self.postgres_port) if self.local_database else (self.database_host, self.database_port)

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint MLflow's server and DVC use."""
        return self.s3_endpoint_url or f"http://{self.host}:{self.object_store_port}"

    @property
    def tracking_uri(self) -> str:
        """The MLflow tracking server's URI."""
        return f"http://{self.host}:{self.mlflow_port}"

    @property
    def prefect_api_url(self) -> str:
        """The Prefect server's API URL."""
        return f"http://{self.host}:{self.prefect_port}/api"

    @property
    def artifact_root(self) -> str:
        """Where the MLflow server keeps artifacts."""
        return f"s3://{self.bucket}/mlflow"

    @property
    def dvc_remote_url(self) -> str:
        """The DVC remote in the same store."""
        return f"s3://{self.bucket}/dvc"
