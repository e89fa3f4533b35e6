"""The MLflow database's schema revision against the installed client's, checked before a run is opened.

MLflow keeps its tracking database's schema under alembic: the ``alembic_version`` table holds the revision the
database was last migrated to, and the installed ``mlflow`` package carries the migrations up to its own head. A
database behind the client (made by an older MLflow) needs ``mlflow db upgrade``; one ahead of it (migrated by a
newer MLflow) needs a newer client, as migrations only go forward. MLflow's own check reports both as an
"out-of-date database schema" from deep in a traceback, once the first request has already been sent;
:func:`check_schema` refuses either case up front with a :class:`TrackingSchemaMismatch` (a ``ConfigError``:
exit status 2 on the command line, permanent for Prefect) that says which side is behind and what to run.

Only database stores are checked (``sqlite``, ``postgresql``, ``mysql``, ``mssql`` URIs); an http(s) server
checks its own database, and a file store has no schema. A database that does not exist yet, or has no
``alembic_version`` table, is new: MLflow creates it at the client's head.
"""

from __future__ import annotations

import functools
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit

from rlhf_core.common.redact import redact_secrets
from rlhf_core.config import ConfigError

DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
"""URI schemes (before any ``+driver``) whose store is a database MLflow migrates with alembic."""


class TrackingSchemaMismatch(ConfigError):
    """The tracking database's schema revision is not the installed MLflow client's."""


@functools.lru_cache(maxsize=1)
def client_schema_revision() -> str:
    """The newest schema revision the installed MLflow migrates to (its alembic head)."""
    from mlflow.store.db.utils import _get_latest_schema_revision  # lazy: mlflow (untracked commands skip it)

    return _get_latest_schema_revision()


@functools.lru_cache(maxsize=1)
def _known_revisions() -> frozenset[str]:
    """Every revision in the installed MLflow's migration scripts (an older database's revision is one of them)."""
    from alembic.script import ScriptDirectory  # lazy: mlflow (alembic is its migration tool)
    from mlflow.store.db.utils import _get_alembic_config  # lazy: mlflow (untracked commands skip it)

    script = ScriptDirectory.from_config(_get_alembic_config(db_url=""))
    return frozenset(rev.revision for rev in script.walk_revisions())


def database_revision(uri: str) -> str | None:
    """The schema revision recorded in the database at ``uri``; None for a database not created yet."""
    import sqlalchemy  # lazy: mlflow (sqlalchemy is its database layer)

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return None
    engine = sqlalchemy.create_engine(uri)
    try:
        with engine.connect() as connection:
            if not sqlalchemy.inspect(connection).has_table("alembic_version"):
                return None
            row = connection.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).first()
    finally:
        engine.dispose()
    return str(row[0]) if row else None


def is_database_uri(uri: str) -> bool:
    """True for a tracking URI whose store is a database MLflow migrates (``postgresql+psycopg://`` too)."""
    return urlsplit(uri).scheme.split("+", 1)[0] in DATABASE_SCHEMES


def check_schema(uri: str) -> None:
    """Refuse a tracking database whose schema revision is not the installed client's, naming the fix."""
    if not is_database_uri(uri):
        return
    found = database_revision(uri)
    expected = client_schema_revision()
    if found is None or found == expected:
        return
    client = f"MLflow {version('mlflow')}"
    shown = redact_secrets(uri)
    if found in _known_revisions():
        raise TrackingSchemaMismatch(
            f"MLflow database {shown} is at schema revision {found}, older than {client} expects ({expected}): "
            f"back it up, then run `mlflow db upgrade {shown}`.")
    raise TrackingSchemaMismatch(
        f"MLflow database {shown} is at schema revision {found}, which {client} does not know (it expects "
        f"{expected}): a newer MLflow migrated it, and `mlflow db upgrade` cannot bring it back. Use that newer "
        "MLflow (constraints.txt pins mlflow, mlflow-skinny and mlflow-tracing together).")
