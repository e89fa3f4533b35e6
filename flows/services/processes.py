"""The services' processes: started detached in a session of their own, tracked by pid files, stopped cleanly.

Each service has ``<data_dir>/run/<name>.pid`` and ``<data_dir>/logs/<name>.log``. A pid file whose process is
gone is stale and is removed on the next look. Stopping signals the service's whole process group (a server's
workers with it): SIGTERM, then SIGKILL after the grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlhf_core.common.redact import redact_secrets


class ServiceError(RuntimeError):
    """A service that could not be started, reached or stopped; the message names it and its log."""


@dataclass(frozen=True)
class ServiceFiles:
    """Where one service's pid file and log live."""

    name: str
    root: Path

    @property
    def pid_file(self) -> Path:
        return self.root / "run" / f"{self.name}.pid"

    @property
    def log(self) -> Path:
        return self.root / "logs" / f"{self.name}.log"


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[-1].startswith("Z"))


def running_pid(files: ServiceFiles) -> int | None:
    """The pid in the service's pid file if that process is alive; a stale pid file is removed."""
    try:
        pid = int(files.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if alive(pid):
        return pid
    files.pid_file.unlink(missing_ok=True)
    return None


def record_pid(files: ServiceFiles, pid: int) -> None:
    files.pid_file.parent.mkdir(parents=True, exist_ok=True)
    files.pid_file.write_text(f"{pid}\n")


def start_detached(files: ServiceFiles, argv: list[str], env: dict[str, str]) -> int:
    """Start ``argv`` in a session of its own (it outlives this command), output to the service's log; returns
    its pid, also written to the pid file."""
    files.log.parent.mkdir(parents=True, exist_ok=True)
    with open(files.log, "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=files.root)
    record_pid(files, proc.pid)
    return proc.pid


def log_tail(files: ServiceFiles, lines: int = 15) -> str:
    """The last lines of the service's log, secrets redacted."""
    try:
        text = files.log.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return redact_secrets("\n".join(text.splitlines()[-lines:]))


def wait_until(files: ServiceFiles, ready: Callable[[], bool], timeout_s: float, pid: int | None = None) -> None:
    """Poll ``ready`` until it holds; a ServiceError with the log's tail if ``pid`` dies or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if pid is not None and not alive(pid):
            raise ServiceError(f"{files.name} exited while starting (log {files.log}):\n{log_tail(files)}")
        if time.monotonic() > deadline:
            raise ServiceError(f"{files.name} did not answer within {timeout_s:.0f} s (team.start_timeout_s; log "
                               f"{files.log}):\n{log_tail(files)}")
        time.sleep(0.5)


def stop_group(files: ServiceFiles, grace_s: float = 30.0) -> bool:
    """Stop the service's process group (SIGTERM, SIGKILL after ``grace_s``); False when it was not running."""
    pid = running_pid(files)
    if pid is None:
        return False
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if group_alive(pid):
        _signal_group(pid, signal.SIGKILL)
        while group_alive(pid) and time.monotonic() < deadline + 10:
            time.sleep(0.2)
    files.pid_file.unlink(missing_ok=True)
    return True


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` lives (zombies, which only their parent can reap, aside)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[-1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
