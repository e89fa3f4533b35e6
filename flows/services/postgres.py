"""PostgreSQL for the MLflow and Prefect servers: a cluster of the project's own, or a team's managed server.

The local cluster is ``initdb``'d into ``<data_dir>/postgres`` with a password-protected role (scram-sha-256), and
listens on TCP only (``team.host``:``team.postgres_port``; no Unix socket, whose path length a deep project folder
would exceed). PostgreSQL refuses to run as root, so under root its programs run as the ``postgres`` user that
Debian's packages create, and the data folder is that user's. The server binaries come from PATH or Debian's
``/usr/lib/postgresql/<version>/bin`` (``make setup-team`` installs them).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
from pathlib import Path
from typing import Any

from flows.services.processes import ServiceError, ServiceFiles, log_tail, record_pid, wait_until
from rlhf_core.config import TeamConfig

SERVER_USER = "postgres"
"""Who runs PostgreSQL when this command runs as root."""


def binary(name: str) -> str:
    """A PostgreSQL server program: on PATH, else Debian's newest ``/usr/lib/postgresql/*/bin``."""
    found = shutil.which(name)
    if found:
        return found
    debian = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[4]))
    if debian:
        return debian[-1]
    raise ServiceError(f"PostgreSQL's {name} not found on PATH or in /usr/lib/postgresql/*/bin: run `make setup-team` "
                       "(it installs Debian's postgresql package), or point team.database_host at a managed server")


def _as_server_user() -> dict[str, Any]:
    """subprocess arguments that run a PostgreSQL program as :data:`SERVER_USER` when this process is root."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam(SERVER_USER)
    except KeyError:
        raise ServiceError(f"PostgreSQL refuses to run as root and there is no {SERVER_USER!r} user to run it as: "
                           "install Debian's postgresql package (make setup-team) or run as another user") from None
    return {"user": SERVER_USER, "group": SERVER_USER}


def _give_to_server_user(*folders: Path) -> None:
    """Make ``folders`` :data:`SERVER_USER`'s, after checking it can reach them (every parent searchable)."""
    if os.geteuid() != 0:
        return
    entry = pwd.getpwnam(SERVER_USER)
    for folder in folders:
        for parent in folder.resolve().parents:
            st = parent.stat()
            if not (st.st_mode & 0o001 or (st.st_uid == entry.pw_uid and st.st_mode & 0o100)):
                raise ServiceError(f"team.data_dir: {parent} is not searchable by user {SERVER_USER}, as whom "
                                   f"PostgreSQL runs (it refuses root): chmod o+x {parent}, or set team.data_dir "
                                   "to a folder it can reach")
        os.chown(folder, entry.pw_uid, entry.pw_gid)


def data_folder(root: Path) -> Path:
    return root / "postgres"


def initialise(cfg: TeamConfig, root: Path, password: str) -> bool:
    """``initdb`` the cluster in ``<root>/postgres`` unless it exists; the role ``team.database_user`` gets
    ``password``. Returns True when it made one."""
    data = data_folder(root)
    if (data / "PG_VERSION").exists():
        return False
    data.mkdir(parents=True, exist_ok=True, mode=0o700)
    _give_to_server_user(data)
    pwfile = root / "run" / ".initdb-password"  # initdb wants its data folder empty
    pwfile.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(password + "\n")
    _give_to_server_user(pwfile)
    try:
        done = subprocess.run([binary("initdb"), "-D", str(data), "-U", cfg.database_user, f"--pwfile={pwfile}",
                               "--auth=scram-sha-256", "--encoding=UTF8", "--no-locale", "--no-instructions"],
                              capture_output=True, text=True, **_as_server_user())
    finally:
        pwfile.unlink(missing_ok=True)
    if done.returncode != 0:
        raise ServiceError(f"initdb {data} failed:\n{(done.stderr or done.stdout)[-1500:]}")
    return True


def start(cfg: TeamConfig, root: Path, files: ServiceFiles) -> int:
    """Start the local cluster on ``team.host``:``team.postgres_port`` (TCP only); returns the postmaster's pid."""
    data = data_folder(root)
    files.log.parent.mkdir(parents=True, exist_ok=True)
    files.log.touch()
    _give_to_server_user(files.log)
    options = f"-c listen_addresses={cfg.host} -p {cfg.postgres_port} -c unix_socket_directories=''"
    done = subprocess.run([binary("pg_ctl"), "-D", str(data), "-l", str(files.log), "-o", options, "-w",
                           "-t", str(int(cfg.start_timeout_s)), "start"], capture_output=True, text=True,
                          **_as_server_user())
    if done.returncode != 0:
        raise ServiceError(f"postgres did not start (log {files.log}):\n{log_tail(files)}")
    pid = int((data / "postmaster.pid").read_text().split()[0])
    record_pid(files, pid)
    return pid


def stop(root: Path, files: ServiceFiles) -> bool:
    """``pg_ctl stop -m fast``: sessions closed, the cluster shut down cleanly; False when it was not running."""
    data = data_folder(root)
    if not (data / "postmaster.pid").exists():
        files.pid_file.unlink(missing_ok=True)
        return False
    done = subprocess.run([binary("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], capture_output=True,
                          text=True, **_as_server_user())
    if done.returncode != 0:
        raise ServiceError(f"pg_ctl stop {data} failed:\n{(done.stderr or done.stdout)[-1000:]}")
    files.pid_file.unlink(missing_ok=True)
    return True


def connect(cfg: TeamConfig, password: str, database: str = "postgres") -> Any:
    """A psycopg connection (autocommit) to ``database`` as ``team.database_user``; a wrong password or an
    unreachable server is a ServiceError naming the server, never the password."""
    import psycopg  # lazy: psycopg (the team extra)

    host, port = cfg.database_address
    try:
        return psycopg.connect(host=host, port=port, user=cfg.database_user, password=password, dbname=database,
                               autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        reason = str(exc).replace(password, "***") if password else str(exc)
        raise ServiceError(f"PostgreSQL at {host}:{port} refused {cfg.database_user!r} (team.database_user; password "
                           f"from PGPASSWORD or team.env_file): {reason.strip().splitlines()[-1]}") from None


def answering(cfg: TeamConfig, password: str) -> bool:
    """True when the server accepts the role's login."""
    try:
        connect(cfg, password).close()
    except ServiceError:
        return False
    return True


def ensure_databases(cfg: TeamConfig, password: str) -> list[str]:
    """Create the MLflow and Prefect databases where missing; returns those it made."""
    from psycopg import sql  # lazy: psycopg (the team extra)

    made = []
    with connect(cfg, password) as conn:
        for name in (cfg.mlflow_database, cfg.prefect_database):
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                made.append(name)
    return made


def wait_ready(cfg: TeamConfig, password: str, files: ServiceFiles, pid: int | None) -> None:
    wait_until(files, lambda: answering(cfg, password), cfg.start_timeout_s, pid)
