"""Profiles: where a run is tracked, orchestrated and versioned. (Not ``profile.py``: Prefect puts an entrypoint's
folder, ``flows/``, on ``sys.path``, where such a module would shadow the standard library's ``profile``.)

``embedded`` (the default): MLflow on sqlite in the project, an ephemeral Prefect, the DVC remote the project
names. ``team``: the shared services of the ``team`` section (``alignflow services up``, or a team's own): the
MLflow tracking server, the Prefect server and the DVC remote ``team`` in the object store. Chosen by
``--profile NAME`` anywhere on an ``alignflow`` command line, else ``ALIGNFLOW_PROFILE``.

The team profile sets, before MLflow or Prefect is imported, ``MLFLOW_TRACKING_URI``, ``PREFECT_API_URL``,
``MLFLOW_S3_ENDPOINT_URL`` and the object store's credentials (the environment's or ``team.env_file``'s),
and writes the DVC remote to ``.dvc/config.local`` (per machine, never committed): so every command of the run,
its stage subprocesses and ``dvc`` included, reaches the same services. Credentials stay in the environment.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Sequence

from flows.services.credentials import team_credentials
from rlhf_core.config import ConfigError, TeamConfig, load_config
from rlhf_core.common.project import project_root

PROFILE_ENV = "ALIGNFLOW_PROFILE"
"""The environment variable naming the profile when the command line does not."""
TEAM_REMOTE = "team"
"""The DVC remote the team profile writes and makes the default."""


class Profile(str, enum.Enum):
    """Where a run's tracking, orchestration and data versioning live."""

    EMBEDDED = "embedded"
    TEAM = "team"


def take_profile(argv: Sequence[str]) -> tuple[Profile, list[str]]:
    """The profile (``--profile NAME`` / ``--profile=NAME`` anywhere in ``argv``, else :data:`PROFILE_ENV`, else
    embedded) and ``argv`` without the flag."""
    rest, named = [], os.environ.get(PROFILE_ENV) or Profile.EMBEDDED.value
    source = PROFILE_ENV if os.environ.get(PROFILE_ENV) else "--profile"
    items = list(argv)
    while items:
        item = items.pop(0)
        if item == "--profile":
            if not items:
                raise ConfigError("--profile: needs a name (embedded or team)")
            named, source = items.pop(0), "--profile"
        elif item.startswith("--profile="):
            named, source = item.split("=", 1)[1], "--profile"
        else:
            rest.append(item)
    try:
        return Profile(named), rest
    except ValueError:
        raise ConfigError(f"{source}: unknown profile {named!r}; known: "
                          f"{', '.join(p.value for p in Profile)}") from None


def params_file(argv: Sequence[str]) -> str:
    """The ``--params`` file a command line names (params.yaml by default)."""
    for i, item in enumerate(argv):
        if item == "--params" and i + 1 < len(argv):
            return argv[i + 1]
        if item.startswith("--params="):
            return item.split("=", 1)[1]
    return "params.yaml"


def apply_team_profile(params: str) -> TeamConfig:
    """Point this process and its children at the team services of ``params``'s ``team`` section."""
    cfg = load_config(TeamConfig, "team", params)
    creds = team_credentials(cfg, project_root())
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        if key in creds:
            os.environ[key] = creds[key]
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.update({"MLFLOW_TRACKING_URI": cfg.tracking_uri, "PREFECT_API_URL": cfg.prefect_api_url,
                       "MLFLOW_S3_ENDPOINT_URL": cfg.endpoint_url})
    write_dvc_remote(cfg, project_root())
    return cfg


def write_dvc_remote(cfg: TeamConfig, project: Path) -> bool:
    """The DVC remote :data:`TEAM_REMOTE` (``s3://<bucket>/dvc`` at the team's endpoint) as the project's default,
    in ``.dvc/config.local``; False when the project has no DVC."""
    if not (project / ".dvc").is_dir():
        return False
    from dvc.config import Config  # lazy: dvc (only a team run of a DVC project)

    with Config(dvc_dir=str(project / ".dvc")).edit("local") as conf:
        conf["remote"][TEAM_REMOTE] = {"url": cfg.dvc_remote_url, "endpointurl": cfg.endpoint_url}
        conf["core"]["remote"] = TEAM_REMOTE
    return True
