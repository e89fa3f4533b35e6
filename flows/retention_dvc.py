"""What ``alignflow gc`` keeps and deletes in the DVC cache and, with ``retention.dvc_cloud``, the DVC remote.

An object is kept when the workspace or a kept commit refers to it, or when a kept run names it by md5 (its
``dvc.md5.*`` tags: the lineage inputs of an aliased version stay even when the commit that added them does not).
The kept commits are the ``retention.keep_runs`` newest commits of HEAD, every commit younger than
``retention.keep_days``, and the commits the kept runs ran at (:func:`flows.retention.kept_commits`).

Which objects a commit uses is DVC's own answer (``Repo.used_objs``, the call under ``dvc gc``), and objects go
through DVC's own collector (``dvc_data``'s ``gc``, the function ``dvc gc`` ends in). Why not the ``dvc gc``
command: it keeps one ``--rev`` and its ``-n`` ancestors, while the kept runs ran at any number of commits on any
branch, and it has no way to keep an object that only a run's md5 tag names.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable

from rlhf_core.config import ConfigError, RetentionConfig
from rlhf_core.tracking.lineage import cached_listing


@dataclass
class DvcPlan:
    """The DVC objects gc deletes from the cache and the remote, and the commits whose objects it keeps."""

    commits: list[str] = field(default_factory=list)
    missing_commits: list[str] = field(default_factory=list)
    cache: list[str] = field(default_factory=list)
    remote: list[str] = field(default_factory=list)
    remote_name: str = ""
    skipped: str = ""
    """Why DVC objects are left alone this pass (DVC could not list what a kept commit uses), else empty."""


def _git(project: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=project, check=True, capture_output=True, text=True).stdout


def recent_commits(project: Path, cfg: RetentionConfig, now: datetime | None = None) -> set[str]:
    """The ``keep_runs`` newest commits of HEAD and those younger than ``keep_days`` (none without a commit)."""
    if subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=project, capture_output=True).returncode:
        return set()
    now = now or datetime.now(timezone.utc)
    since = (now - timedelta(days=cfg.keep_days)).isoformat()
    newest = _git(project, "rev-list", f"--max-count={cfg.keep_runs}", "HEAD").split()
    young = _git(project, "rev-list", f"--since={since}", "HEAD").split()
    return set(newest) | set(young)


def known_commits(project: Path, commits: Iterable[str]) -> tuple[list[str], list[str]]:
    """``commits`` as full hashes, split into those the repository has and those it does not."""
    known, missing = [], []
    for commit in sorted(set(commits)):
        found = subprocess.run(["git", "rev-parse", "--verify", "-q", f"{commit}^{{commit}}"], cwd=project,
                               capture_output=True, text=True)
        (known if found.returncode == 0 else missing).append(found.stdout.strip() or commit)
    return sorted(set(known)), missing


def used_hashes(repo: Any, commits: list[str], md5s: Iterable[str], cache_root: Path) -> set[str]:
    """Every object hash the workspace and ``commits`` use (DVC's ``used_objs``), plus ``md5s`` with the files a
    ``.dir`` md5 lists."""
    used: set[str] = set()
    for obj_ids in repo.used_objs(revs=commits or None, num=1).values():
        used |= {h.value for h in obj_ids}
    for md5 in md5s:
        used.add(md5)
        if md5.endswith(".dir"):
            used |= set((cached_listing(cache_root, md5) or {}).values())
    return used


def _odbs(repo: Any) -> list[Any]:
    """The project's cache databases, each once (DVC's own walk in ``dvc gc``)."""
    seen: list[Any] = []
    for _, odb in repo.cache.by_scheme():
        if odb and odb not in seen:
            seen.append(odb)
    return seen


def unused(odb: Any, used: set[str]) -> list[str]:
    """The hashes ``odb`` holds that are not in ``used``: what DVC's collector removes from it."""
    return sorted(h for h in odb.all() if h not in used)


def plan_dvc(project: Path, cfg: RetentionConfig, run_commits: set[str], md5s: set[str]) -> DvcPlan:
    """What gc would delete from the DVC cache (and remote, with ``dvc_cloud``) now; an empty plan outside a
    DVC project."""
    if not (project / ".dvc").is_dir():
        return DvcPlan()
    from dvc.repo import Repo  # lazy: dvc (light `gc --help`)

    from dvc.exceptions import DvcException  # lazy: dvc (light `gc --help`)

    commits, missing = known_commits(project, recent_commits(project, cfg) | run_commits)
    with Repo(str(project)) as repo, repo.lock:
        cache_root = Path(repo.cache.local.path)
        try:
            used = used_hashes(repo, commits, md5s, cache_root)
        except DvcException as exc:  # an object it cannot list might be in use: delete none
            cause = exc.__cause__ or exc
            return DvcPlan(commits=commits, missing_commits=missing,
                           skipped=f"{exc}: {cause} (`dvc fetch` the missing objects, then gc again)")
        plan = DvcPlan(commits=commits, missing_commits=missing,
                       cache=[h for odb in _odbs(repo) for h in unused(odb, used)])
        if cfg.dvc_cloud:
            plan.remote = unused(remote_odb(repo, cfg), used)
            plan.remote_name = cfg.dvc_remote or repo.config["core"].get("remote", "")
    return plan


def remote_odb(repo: Any, cfg: RetentionConfig) -> Any:
    """The object database of the remote ``retention.dvc_remote`` names (empty: the default remote)."""
    from dvc.exceptions import DvcException  # lazy: dvc (light `gc --help`)

    try:
        return repo.cloud.get_remote_odb(cfg.dvc_remote or None, "gc")
    except DvcException as exc:
        raise ConfigError(f"retention.dvc_cloud: cannot open the DVC remote "
                          f"{cfg.dvc_remote or '(the default)'}: {exc}. Set retention.dvc_remote to a remote "
                          "`dvc remote list` shows, or retention.dvc_cloud: false") from None


def apply_dvc(project: Path, cfg: RetentionConfig, plan: DvcPlan, md5s: set[str]) -> tuple[int, int]:
    """Delete the unused objects with DVC's own collector; returns (cache, remote) objects removed.

    The used set is read again under the repository's lock rather than taken from ``plan``: a commit made since
    the plan keeps its objects."""
    if not (project / ".dvc").is_dir() or plan.skipped:
        return 0, 0
    from dvc.repo import Repo  # lazy: dvc (light `gc --help`)
    from dvc_data.hashfile.db import get_index  # lazy: dvc (light `gc --help`)
    from dvc_data.hashfile.gc import gc as collect  # lazy: dvc (light `gc --help`)

    with Repo(str(project)) as repo, repo.lock:
        used = used_hashes(repo, plan.commits, md5s, Path(repo.cache.local.path))
        cache = sum(collect(odb, _hash_infos(odb, used)) for odb in _odbs(repo))
        remote = 0
        if cfg.dvc_cloud:
            remote_db = remote_odb(repo, cfg)
            remote = collect(remote_db, _hash_infos(remote_db, used))
            if remote:
                get_index(remote_db).clear()  # as `dvc gc --cloud` does: the remote's listing index is stale
    return cache, remote


def _hash_infos(odb: Any, hashes: set[str]) -> list[Any]:
    """``hashes`` as the collector's ids for ``odb``: it skips ids named for another hash than the database's."""
    from dvc_data.hashfile.hash_info import HashInfo  # lazy: dvc (light `gc --help`)

    return [HashInfo(odb.hash_name, h) for h in hashes]
