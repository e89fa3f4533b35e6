"""``alignflow services up|down|status``: the team profile's services on this machine.

``up`` starts what is not running, in order (PostgreSQL, the object store, MLflow, Prefect), each waited for until
it answers, and then sizes the GPU limit; a service already running is left as it is. ``down`` stops them in the
reverse order (PostgreSQL last, with a clean shutdown). ``status`` reports each one and exits 1 when any is down.
A service the ``team`` section points at a team's managed server (``database_host``, ``s3_endpoint_url``) is not
started here; ``status`` checks that it answers.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
from typing import Callable, Sequence

from flows import errors
from flows.services import postgres, servers
from flows.services.credentials import ensure_credentials, team_credentials
from flows.services.processes import ServiceError, ServiceFiles, running_pid, stop_group
from rlhf_core.config import FlowConfig, TeamConfig, load_config
from rlhf_core.common.project import project_root

SERVICES = ("postgres", "object-store", "mlflow", "prefect")
"""The services in start order."""


def services_root(cfg: TeamConfig) -> Path:
    """``team.data_dir``, under the project root unless absolute."""
    path = Path(os.path.expanduser(cfg.data_dir))
    return path if path.is_absolute() else project_root() / path


def _files(cfg: TeamConfig) -> dict[str, ServiceFiles]:
    root = services_root(cfg)
    return {name: ServiceFiles(name, root) for name in SERVICES}


def _local(cfg: TeamConfig, name: str) -> bool:
    """True when ``services up`` runs ``name`` on this machine."""
    return {"postgres": cfg.local_database, "object-store": cfg.local_object_store}.get(name, True)


def _start_postgres(cfg: TeamConfig, files: ServiceFiles, creds: dict[str, str]) -> None:
    root = services_root(cfg)
    if cfg.local_database:
        postgres.initialise(cfg, root, creds["PGPASSWORD"])
        if running_pid(files) is None:
            pid = postgres.start(cfg, root, files)
            postgres.wait_ready(cfg, creds["PGPASSWORD"], files, pid)
    postgres.connect(cfg, creds["PGPASSWORD"]).close()  # wrong credentials stop here, before any server starts
    postgres.ensure_databases(cfg, creds["PGPASSWORD"])


TEAM_MODULES = ("psycopg", "boto3", "moto")
"""What the ``team`` extra brings that the services use (PostgreSQL's client, S3's client, the local S3 server)."""


def require_team_extra() -> None:
    """A ServiceError naming ``make setup-team`` when the ``team`` extra is not installed (rather than a
    ModuleNotFoundError traceback from deep inside the first service that needs it)."""
    missing = []
    for name in TEAM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ServiceError(f"the team extra is not installed ({', '.join(missing)} missing): run `make setup-team` "
                           "(or pip install 'alignflow[team]')")


def up(cfg: TeamConfig, flow: FlowConfig, say: Callable[[str], None]) -> None:
    """Start every service that is not running; then the GPU limit on the Prefect server."""
    require_team_extra()
    creds = ensure_credentials(cfg, project_root())
    files = _files(cfg)
    env = servers.server_env(cfg, creds)
    _start_postgres(cfg, files["postgres"], creds)
    say(f"postgres      {'local' if cfg.local_database else 'managed'} at {':'.join(map(str, cfg.database_address))}")
    if cfg.local_object_store and running_pid(files["object-store"]) is None:
        servers.start_object_store(cfg, files["object-store"], env)
    servers.ensure_bucket(cfg, creds)
    say(f"object store  {cfg.endpoint_url} (bucket {cfg.bucket})")
    if running_pid(files["mlflow"]) is None:
        servers.start_mlflow(cfg, files["mlflow"], env)
    say(f"mlflow        {cfg.tracking_uri} (artifacts {cfg.artifact_root})")
    if running_pid(files["prefect"]) is None:
        servers.start_prefect(cfg, services_root(cfg), files["prefect"], env)
    say(f"prefect       {cfg.prefect_api_url}")
    if flow.gpu_limit:
        say(f"gpu limit     {flow.gpu_limit}: {_size_gpu_limit(cfg, flow)} slot(s)")
    say(f"dvc remote    {cfg.dvc_remote_url}; point runs here with --profile team (or ALIGNFLOW_PROFILE=team)")


def _size_gpu_limit(cfg: TeamConfig, flow: FlowConfig) -> int:
    """Make ``flow.gpu_limit`` on the Prefect server with ``team.gpu_devices`` slots (0: this machine's GPUs);
    an existing limit is resized only when ``team.gpu_devices`` is set."""
    os.environ["PREFECT_API_URL"] = cfg.prefect_api_url  # before Prefect is imported: its client reads it then
    from flows.gpu_limit import device_count, ensure_gpu_limit, resize_gpu_limit  # lazy: prefect (after PREFECT_API_URL)

    size = ensure_gpu_limit(flow.gpu_limit, cfg.gpu_devices or device_count())
    if cfg.gpu_devices and size != cfg.gpu_devices:
        size = resize_gpu_limit(flow.gpu_limit, cfg.gpu_devices)
    return size


def down(cfg: TeamConfig, say: Callable[[str], None]) -> None:
    """Stop the local services, PostgreSQL last (``pg_ctl stop -m fast``)."""
    files = _files(cfg)
    for name in reversed(SERVICES):
        if not _local(cfg, name):
            continue
        stopped = (postgres.stop(services_root(cfg), files[name]) if name == "postgres"
                   else stop_group(files[name]))
        say(f"{name:<13} {'stopped' if stopped else 'was not running'}")


def _health(cfg: TeamConfig, name: str, creds: dict[str, str]) -> bool:
    if name == "postgres":
        return postgres.answering(cfg, creds.get("PGPASSWORD", ""))
    url = {"object-store": servers.object_store_health, "mlflow": servers.mlflow_health,
           "prefect": servers.prefect_health}[name](cfg)
    return servers.answers(url)


def status(cfg: TeamConfig, say: Callable[[str], None]) -> bool:
    """One line per service: running (pid) or managed, answering or not; True when every one answers."""
    files, creds = _files(cfg), team_credentials(cfg, project_root())
    where = {"postgres": ":".join(map(str, cfg.database_address)), "object-store": cfg.endpoint_url,
             "mlflow": cfg.tracking_uri, "prefect": cfg.prefect_api_url}
    every = True
    for name in SERVICES:
        pid = running_pid(files[name]) if _local(cfg, name) else None
        ok = _health(cfg, name, creds)
        every &= ok
        how = f"pid {pid}" if pid else ("managed" if not _local(cfg, name) else "not running")
        say(f"{name:<13} {'up' if ok else 'DOWN':<5} {how:<12} {where[name]}  (log {files[name].log})")
    return every


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alignflow services", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down", "status"],
                        help="up: start what is not running; down: stop them; status: report each (exit 1: any down)")
    parser.add_argument("--params", default="params.yaml", help="params file whose team section to read")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(TeamConfig, "team", args.params)
        if args.action == "up":
            up(cfg, load_config(FlowConfig, "flow", args.params), print)
        elif args.action == "down":
            down(cfg, print)
        else:
            return 0 if status(cfg, print) else 1
        return 0
    except Exception as exc:  # noqa: BLE001 - the project's errors (config, a service) become one message
        code = errors.report(exc, debug=False)
        if code is None:
            raise
        return code
