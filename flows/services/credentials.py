"""The team services' credentials: the environment, else a KEY=VALUE file outside the repository (mode 0600).

``PGPASSWORD`` is the PostgreSQL role's password (the MLflow and Prefect servers log in with it; libpq and asyncpg
read it from their environment, so it is never on a command line or in a URL); ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY`` open the object store (MLflow's server, DVC). ``alignflow services up`` writes fresh
random ones to ``team.env_file`` for what it runs itself when neither place has them. Error messages name
the file and the line, never a value.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from rlhf_core.config import ConfigError, TeamConfig

KEYS = ("PGPASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
"""The variables the team services read."""


def credentials_path(cfg: TeamConfig, project: Path) -> Path:
    """``team.env_file``, ``~`` expanded; refused inside the project folder (it would be one ``git add``
    away from the repository)."""
    path = Path(os.path.expanduser(cfg.env_file)).resolve()
    if path.is_relative_to(project.resolve()):
        raise ConfigError(f"team.env_file: {path} is inside the project folder {project}; credentials live "
                          "outside the repository (default ~/.config/alignflow/team.env)")
    return path


def read_credentials(path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of ``path`` (``#`` comments and blank lines skipped); {} when it does not exist. Refused
    when others may read it."""
    if not path.exists():
        return {}
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"{path}: mode {mode:04o} lets others read the team's credentials; chmod 600 {path}")
    out: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ConfigError(f"{path}:{number}: not a KEY=VALUE line (the line is not shown: it may hold a secret)")
        out[key.strip()] = value.strip().strip("'\"")
    return out


def team_credentials(cfg: TeamConfig, project: Path) -> dict[str, str]:
    """Each of :data:`KEYS` that is set: the environment's value, else the file's."""
    found = read_credentials(credentials_path(cfg, project))
    return {key: os.environ.get(key) or found[key] for key in KEYS if os.environ.get(key) or found.get(key)}


def ensure_credentials(cfg: TeamConfig, project: Path) -> dict[str, str]:
    """:func:`team_credentials`, with fresh random values written to the file (folder 0700, file 0600) for each
    key that neither place has; a managed service's missing credentials are an error instead."""
    have = team_credentials(cfg, project)
    missing = [k for k in KEYS if k not in have]
    managed = [k for k in missing if (k == "PGPASSWORD" and not cfg.local_database)
               or (k.startswith("AWS_") and not cfg.local_object_store)]
    path = credentials_path(cfg, project)
    if managed:
        raise ConfigError(f"team: {', '.join(managed)} not set for the team's managed service(s): export them or "
                          f"write them to {path} (KEY=VALUE, mode 0600)")
    if missing:
        fresh = {k: secrets.token_urlsafe(24) for k in missing}
        _write_private(path, {**read_credentials(path), **fresh})
        have.update(fresh)
    return have


def _write_private(path: Path, values: dict[str, str]) -> None:
    """Write ``values`` as KEY=VALUE lines to ``path``, mode 0600 from its first byte, replacing it whole."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write("".join(f"{k}={v}\n" for k, v in values.items()))
    os.replace(tmp, path)
