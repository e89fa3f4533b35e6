"""Versioning: put generated datasets and models under DVC and commit their ``.dvc`` files.

Each alignment cycle's preference data (and reward model, when retrained) is ``dvc add``-ed,
its ``.dvc`` file (plus the ``.gitignore`` DVC maintains next to it) is committed to git
with a message naming the flow run and cycle, after the data is pushed to the default DVC
remote (push first: a commit never points at data the remote lacks).
``git checkout <commit> && dvc checkout`` then restores exactly that cycle.

Two guarantees a nightly job needs:

* Only the files versioned here are committed (``git commit -- <paths>``): a user's staged
  or modified files are left exactly as they were.
* One writer at a time: a second flow that wants to version while another one is doing so
  waits on a file lock in ``.alignflow/`` and logs that it is waiting, rather than failing
  or interleaving its ``git`` and ``dvc`` calls with the other's.

DVC's Python API (``dvc.repo.Repo``) does the tracking and pushing; git is driven through
its CLI because DVC has no commit API and GitPython is not a dependency.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from filelock import FileLock, Timeout
from prefect import task

from rlhf_core.tracking.lineage import dvc_md5

LOCK_FILE = Path(".alignflow") / "versioning.lock"
_FALLBACK_IDENTITY = ["-c", "user.name=alignflow", "-c", "user.email=alignflow@localhost"]
log = logging.getLogger(__name__)


class VersioningError(RuntimeError):
    """A git or DVC step of versioning failed; the message carries the command's output."""


@dataclass
class Versioned:
    """What one versioning call recorded."""

    commit: str
    md5: dict[str, str]
    committed: bool  # False when the content was identical to the last commit's


def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VersioningError(f"git {' '.join(args)} failed in {root}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()


def commit_identity(root: Path) -> list[str]:
    """``-c user.name=… -c user.email=…`` only where the repository has no committer identity (fresh CI
    clones, a new machine); empty otherwise."""
    has_name = subprocess.run(["git", "config", "user.name"], cwd=root, capture_output=True).returncode == 0
    has_mail = subprocess.run(["git", "config", "user.email"], cwd=root, capture_output=True).returncode == 0
    return [] if has_name and has_mail else list(_FALLBACK_IDENTITY)


def acquire_lock(root: Path, timeout_s: float, who: str) -> FileLock:
    """The project's versioning lock; logs once when another flow holds it and we wait."""
    path = root / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("%s: another flow is versioning in %s; waiting for %s (up to %.0f s)", who, root, path, timeout_s)
        try:
            lock.acquire(timeout=timeout_s)
        except Timeout:
            raise VersioningError(f"{who}: gave up waiting {timeout_s:.0f} s for the versioning lock {path}") from None
    return lock


def version_paths(root: str | Path, paths: Sequence[str | Path], message: str, *, push: bool = True,
                  lock_timeout_s: float = 600.0) -> Versioned:
    """``dvc add`` ``paths`` (relative to ``root``), push them, then commit only their
    ``.dvc``/``.gitignore`` files.

    A failed push raises :class:`VersioningError` before anything is committed. Returns the
    commit holding this version and each path's DVC md5. When every path is unchanged since
    the last commit nothing is committed and HEAD is returned.
    """
    from dvc.repo import Repo  # lazy: dvc (only when data is versioned)

    root = Path(root).resolve()
    rel = [str(Path(p).resolve().relative_to(root)) if Path(p).is_absolute() else str(p) for p in paths]
    missing = [p for p in rel if not (root / p).exists()]
    if missing:
        raise VersioningError(f"cannot version missing path(s) {missing} in {root}")
    lock = acquire_lock(root, lock_timeout_s, message.splitlines()[0])
    try:
        with Repo(str(root)) as repo:
            try:
                repo.add([str(root / p) for p in rel])  # DVC resolves relative paths against the cwd
            except Exception as exc:  # noqa: BLE001 - e.g. the .dvc file would be git-ignored
                raise VersioningError(f"dvc add of {rel} in {root} failed: {exc}") from exc
            if push:
                # Push before committing: a commit must never name data the remote lacks. A failed
                # push leaves git untouched (the .dvc files stay unstaged) and a retry pushes again.
                try:
                    repo.push(targets=[str(root / p) for p in rel])
                except Exception as exc:  # noqa: BLE001 - DVC raises many types; say which step failed
                    raise VersioningError(f"dvc push of {rel} to the DVC remote failed, so nothing was "
                                          f"committed: {exc}") from exc
            touched = [f"{p}.dvc" for p in rel]
            touched += sorted({str(Path(p).parent / ".gitignore") for p in rel
                               if (root / Path(p).parent / ".gitignore").exists()})
            _git(root, "add", "--", *touched)
            changed = subprocess.run(["git", "diff", "--cached", "--quiet", "--", *touched], cwd=root).returncode != 0
            if changed:
                # `git commit -- paths` commits those paths only, whatever else is staged.
                _git(root, *commit_identity(root), "commit", "-q", "-m", message, "--", *touched)
        return Versioned(_git(root, "rev-parse", "HEAD"), {p: dvc_md5(root / p) for p in rel}, changed)
    finally:
        lock.release()


@task(name="version-outputs", retries=2, retry_delay_seconds=5)
def version_outputs(paths: list[str], message: str, push: bool = True, lock_timeout_s: float = 600.0,
                    root: str = ".") -> dict[str, Any]:
    """Prefect task around :func:`version_paths`; returns ``{commit, md5, committed}``."""
    result = version_paths(root, paths, message, push=push, lock_timeout_s=lock_timeout_s)
    return {"commit": result.commit, "md5": result.md5, "committed": result.committed}
