"""Lineage facts recorded with every run: the git commit and DVC-compatible md5s of inputs.

The md5s are computed the way DVC 3 computes them (a file: md5 of its bytes; a directory:
md5 of the JSON list of its files' md5s and relative paths, with a ``.dir`` suffix), so
the digest on an MLflow run equals the one in ``dvc.lock`` and a user can go from a run to
the DVC commit that reproduces it. Pure Python on purpose: ``rlhf_core`` must run on GPU
machines where DVC is not installed; a test checks these against ``dvc`` itself.

Hashing is cached per file, keyed on (absolute path, size, mtime_ns, inode) — the key DVC's
own state database uses — in one JSON file per project, ``<project>/.alignflow/hash-cache.json``
(:class:`HashCache`; the config's ``tracking.hash_cache`` moves it or turns it off, :func:`use_hash_cache`). A 7B
model directory (~15 GB) is hashed several times per stage; with the cache only the first
pass reads its weights (files under 1 MiB are always re-read). The trade-off is DVC's: a file
rewritten in place with the same size, mtime and inode keeps its old md5.

A run records an input path inside the project relative to it (:func:`project_relative`), and
one outside it by its absolute path and md5, so a rerun of the run's commit in another folder
records the same paths. What a run read can be had back by md5 from a DVC cache
(:func:`restore_from_cache`, DVC 3's ``files/md5`` layout), whatever the working copy holds now.

The code a run executes is identified by :func:`core_fingerprint` (the package version and a
hash of the ``rlhf_core`` sources): Prefect's cache key (``tasks.common``) and a checkpoint's
run fingerprint (:mod:`rlhf_core.tracking.checkpoint`) both include it. Not the git HEAD: iterative
cycles commit mid-flow without changing the code that runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import rlhf_core
from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.tracking.mlflow_runs import project_root

log = logging.getLogger(__name__)
_CHUNK = 1 << 20


def _file_digest(path: str | Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def file_md5(path: str | Path) -> str:
    """md5 hex digest of a file's bytes."""
    return _file_digest(path, "md5")


def file_sha256(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes."""
    return _file_digest(path, "sha256")


# --------------------------------------------------------------------------------------
# The hash cache
# --------------------------------------------------------------------------------------

_hash_cache_setting = ""
"""This process's ``tracking.hash_cache`` (:func:`use_hash_cache`): empty for the project's file, off, or a path."""
MAX_CACHE_ENTRIES = 100_000
"""Beyond this, the entries hashed longest ago are dropped (a 7B model is a handful of files)."""
MIN_CACHED_BYTES = 1 << 20
"""Smaller files are hashed every time: reading them costs about what a cache lookup does, and
leaving them out keeps the cache to the weight files it is for."""
_CACHE_VERSION = 1
_LOCK_TIMEOUT_S = 30.0
_RACY_NS = 1_000_000_000  # above any mtime granularity of ext4, xfs, NFS


def use_hash_cache(setting: str) -> None:
    """Make ``setting`` (``tracking.hash_cache``: empty for ``<project>/.alignflow/hash-cache.json``, ``off``, or a
    file) the cache every :func:`dvc_md5` of this process uses; the flows' and stages' entry points call it with
    their config's."""
    global _hash_cache_setting
    _hash_cache_setting = setting


class HashCache:
    """Per-file md5s keyed on (absolute path, size, mtime_ns, inode), persisted as JSON.

    ``md5(path)`` returns the cached digest when the file's stat key matches, else hashes the
    file and remembers it; ``save()`` merges the new entries into the file under a file lock
    (another process may have saved meanwhile), drops entries of files that no longer exist,
    caps the size, and replaces the file atomically. The cache only ever saves time: a cache
    file that is unreadable, corrupt or unwritable is warned about and hashing goes on.
    ``hashed_bytes`` counts the bytes this instance read to hash (a test's proof of a hit).
    Files under ``min_bytes`` are always hashed, never cached.
    """

    def __init__(self, path: str | Path | None, min_bytes: int = MIN_CACHED_BYTES):
        self.path = Path(path) if path is not None else None
        self.min_bytes = min_bytes
        self.hashed_bytes = 0
        self._entries: dict[str, list[Any]] = self._load() if self.path is not None else {}
        self._new: dict[str, list[Any]] = {}

    @classmethod
    def default(cls) -> "HashCache":
        """The cache ``tracking.hash_cache`` names (:func:`use_hash_cache`): the project's, another file, or a
        memory-only one (off)."""
        setting = _hash_cache_setting.strip()
        if setting.lower() in ("off", "0", "false", "no"):
            return cls(None)
        if setting:
            return cls(Path(setting).expanduser().resolve())

        return cls(project_root() / ".alignflow" / "hash-cache.json")

    def _load(self) -> dict[str, list[Any]]:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("hash cache %s is unreadable (%s); ignoring it and hashing from scratch", self.path, exc)
            return {}
        entries = data.get("entries") if isinstance(data, dict) and data.get("version") == _CACHE_VERSION else None
        if not isinstance(entries, dict):
            log.warning("hash cache %s has an unknown layout; ignoring it and hashing from scratch", self.path)
            return {}
        # a malformed entry is dropped rather than trusted: [size, mtime_ns, inode, md5]
        return {k: v for k, v in entries.items() if isinstance(v, list) and len(v) == 4 and isinstance(v[3], str)}

    def md5(self, path: str | Path) -> str:
        """md5 hex digest of the file at ``path``, from the cache when its stat key matches."""
        key = os.path.abspath(path)
        st = os.stat(key)
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self._new.get(key) or self._entries.get(key)
        if hit is not None and hit[:3] == stamp:
            return hit[3]
        started_ns = time.time_ns()
        digest = file_md5(key)
        self.hashed_bytes += st.st_size
        after = os.stat(key)
        # No entry for a file written while we read it (its digest may mix old and new bytes),
        # nor for one modified just before we started: the kernel stamps mtime from a coarse
        # clock, so a same-size rewrite in that tick would keep the key ("racy git").
        unchanged = [after.st_size, after.st_mtime_ns, after.st_ino] == stamp
        if unchanged and started_ns - st.st_mtime_ns > _RACY_NS and st.st_size >= self.min_bytes:
            self._new[key] = stamp + [digest]
        return digest

    def save(self) -> None:
        """Merge this instance's new entries into the cache file (no-op when nothing was hashed)."""
        if self.path is None or not self._new:
            return
        from filelock import FileLock, Timeout  # lazy: filelock (~50 ms; light CLI start)

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock", timeout=_LOCK_TIMEOUT_S):
                merged = self._load()  # another process may have saved since we loaded
                for key, value in self._new.items():
                    merged.pop(key, None)  # re-inserted last: eviction drops the least recently hashed
                    merged[key] = value
                merged = {k: v for k, v in merged.items() if os.path.exists(k)}
                merged = dict(list(merged.items())[-MAX_CACHE_ENTRIES:])
                self._write(merged)
        except (OSError, Timeout) as exc:
            log.warning("could not save hash cache %s (%s); md5s are unaffected", self.path, exc)
            return
        self._entries, self._new = merged, {}

    def _write(self, entries: dict[str, list[Any]]) -> None:
        assert self.path is not None
        write_text_atomic(self.path, json.dumps({"version": _CACHE_VERSION, "entries": entries}))


def dir_listing(path: str | Path, cache: HashCache | bool = True) -> dict[str, str]:
    """``{relative posix path: md5}`` of every file under the folder ``path`` (``.dvc`` and ``.git``
    left out, as DVC does), in path order; ``cache`` as in :func:`dir_md5`."""
    store = _cache_for(cache)
    root = Path(path)
    entries = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (".dvc", ".git")]
        for name in filenames:
            full = Path(dirpath) / name
            entries[full.relative_to(root).as_posix()] = store.md5(full)
    if cache is True:
        store.save()
    return dict(sorted(entries.items()))


def listing_md5(listing: dict[str, str]) -> str:
    """DVC's directory hash of a :func:`dir_listing`: md5 of the sorted ``[{"md5", "relpath"}]`` JSON, plus ``.dir``."""
    entries = [{"md5": md5, "relpath": rel} for rel, md5 in sorted(listing.items())]
    # DVC serialises with json.dumps(..., sort_keys=True) and default separators.
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def dir_md5(path: str | Path, cache: HashCache | bool = True) -> str:
    """DVC's directory hash of the folder ``path`` (:func:`listing_md5` of its :func:`dir_listing`).

    ``cache``: ``True`` for the project's :class:`HashCache`, ``False`` to read every byte, or
    a cache to use (the caller saves it).
    """
    return listing_md5(dir_listing(path, cache))


def dvc_md5(path: str | Path, cache: HashCache | bool = True) -> str:
    """The md5 DVC records for ``path`` (file or directory); ``cache`` as in :func:`dir_md5`."""
    path = Path(path)
    if path.is_dir():
        return dir_md5(path, cache)
    store = _cache_for(cache)
    digest = store.md5(path)
    if cache is True:
        store.save()
    return digest


def _cache_for(cache: HashCache | bool) -> HashCache:
    if isinstance(cache, HashCache):
        return cache
    return HashCache.default() if cache else HashCache(None)


# --------------------------------------------------------------------------------------
# Paths as a run records them, and content by md5 from a DVC cache
# --------------------------------------------------------------------------------------


def project_relative(path: str | Path, root: str | Path | None = None) -> str:
    """``path`` as a run records it: relative to the project folder ``root`` (default: the working
    directory, against which relative paths resolve) when it lies there, as a posix path without
    ``./``; else absolute and normalised.

    Why: a model folder's ``alignflow.json`` and the run's record keep input paths as given, so
    ``data/sft.jsonl`` and ``/home/me/proj/data/sft.jsonl`` would make one run look like two, and a
    rerun in another folder (a worktree of the run's commit) could not be compared with it. Inside
    is judged on the path as written first (a symlinked ``data/`` stays ``data/...``), then with
    symlinks resolved.
    """
    base = Path(os.path.abspath(root if root is not None else os.getcwd()))
    given = Path(path).expanduser()
    absolute = Path(os.path.normpath(given if given.is_absolute() else base / given))
    for folder, target in ((base, absolute), (base.resolve(), absolute.resolve())):
        if target == folder or folder in target.parents:
            return target.relative_to(folder).as_posix()
    return str(absolute)


_DVC_MD5 = re.compile(r"^[0-9a-f]{32}(\.dir)?$")


def cache_object(cache_root: str | Path, md5: str) -> Path:
    """Where a DVC 3 cache keeps the object named ``md5``: a file's bytes, or a folder's ``.dir``
    listing. ``cache_root`` is the cache's ``files/md5`` folder (``.dvc/cache/files/md5`` by default)."""
    if not _DVC_MD5.match(md5):
        raise ValueError(f"lineage: {md5!r} is not a DVC md5 (32 hex digits, optionally .dir)")
    return Path(cache_root) / md5[:2] / md5[2:]


def cached_listing(cache_root: str | Path, md5: str) -> dict[str, str] | None:
    """The :func:`dir_listing` of the folder ``md5`` (a ``.dir`` md5) as the cache records it, or None
    when the cache holds no listing for it."""
    obj = cache_object(cache_root, md5)
    try:
        entries = json.loads(obj.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(entries, list):
        return None
    return dict(sorted((str(e["relpath"]), str(e["md5"])) for e in entries if isinstance(e, dict)
                       and "relpath" in e and "md5" in e))


def restore_from_cache(cache_root: str | Path, md5: str, dest: str | Path) -> bool:
    """Write the content named ``md5`` (a file's, or a folder's with every file it lists) to ``dest``
    from the DVC cache, replacing what is there. True when the cache held all of it and the copy
    hashes to ``md5``; False, with ``dest`` left absent, otherwise. Files are copied, never linked:
    a rerun must not be able to write into the cache through them."""
    dest = Path(dest)
    listing = cached_listing(cache_root, md5) if md5.endswith(".dir") else {"": md5}
    if listing is None or not all(cache_object(cache_root, m).is_file() for m in listing.values()):
        return False
    _remove(dest)
    try:
        for rel, m in listing.items():
            target = dest / rel if rel else dest
            if rel and not _within(dest, target):
                raise ValueError(f"lineage: cached listing {md5} names {rel!r}, outside its folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cache_object(cache_root, m), target)
        if md5.endswith(".dir"):
            dest.mkdir(parents=True, exist_ok=True)  # an empty folder lists no file
        if dvc_md5(dest, cache=False) == md5:
            return True
    except (OSError, ValueError) as exc:
        log.warning("restoring %s from the DVC cache %s failed: %s", md5, cache_root, exc)
    _remove(dest)
    return False


def _within(folder: Path, path: Path) -> bool:
    folder, path = Path(os.path.normpath(folder)), Path(os.path.normpath(path))
    return folder in path.parents


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def git_commit(cwd: str | Path | None = None) -> str:
    """HEAD commit of the repository holding ``cwd`` (``"unknown"`` outside git), ``-dirty`` if modified."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def git_untracked(cwd: str | Path | None = None) -> list[str]:
    """Files in the repository holding ``cwd`` that git neither tracks nor ignores (an untracked folder
    as one entry): what a rerun from the commit would not have. Empty outside git."""
    try:
        out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--directory",
                              "--no-empty-directory"], cwd=cwd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.splitlines()


def untracked_note(paths: list[str], shown: int = 5) -> str:
    """``"3 untracked: a.py, data/new.jsonl, notes/"``: the ``git.untracked`` tag's value."""
    more = f", +{len(paths) - shown} more" if len(paths) > shown else ""
    return f"{len(paths)} untracked: {', '.join(paths[:shown])}{more}"


# --------------------------------------------------------------------------------------
# The code a run executes
# --------------------------------------------------------------------------------------

# The folder :func:`core_fingerprint` hashes (a test points it at temporary trees).
CORE_ROOT = Path(rlhf_core.__file__).resolve().parent


def source_hash(root: Path) -> str:
    """sha256 over every ``*.py`` file under ``root``: each file's relative path and bytes, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def package_version() -> str:
    """The installed alignflow version, else ``rlhf_core.__version__``, else ``unknown``."""
    try:
        return version("alignflow")
    except PackageNotFoundError:
        return str(getattr(rlhf_core, "__version__", "unknown"))


def core_fingerprint() -> str:
    """``"<package version>:<source hash of CORE_ROOT>"``: the training core this process runs.

    A task wrapper's source is only the entry into its stage: the trainer it runs lives in
    ``rlhf_core``, so an edited trainer (or an upgrade) must not reuse results or checkpoints
    of the old one. Computed once per process and root: the code a process runs does not
    change under it.
    """
    return _core_fingerprint_of(CORE_ROOT)


@functools.cache
def _core_fingerprint_of(root: Path) -> str:
    return f"{package_version()}:{source_hash(root)}"


def lineage_tags(inputs: dict[str, str | Path], stage: str) -> dict[str, str]:
    """``git.commit``, ``alignflow.stage``, ``alignflow.version``, ``dvc.md5.<name>`` for each existing input, and
    ``git.untracked`` when the project holds files git does not track.

    The version is the installed alignflow's: a project made by ``alignflow init`` has no
    alignflow source in its commit, so the commit alone does not say which trainer ran."""
    tags = {"git.commit": git_commit(), "alignflow.stage": stage, "alignflow.version": package_version()}
    untracked = git_untracked()
    if untracked:  # a dirty tree shows in git.commit's -dirty; files git does not know show here
        tags["git.untracked"] = untracked_note(untracked)
    for name, path in inputs.items():
        if Path(path).exists():
            tags[f"dvc.md5.{name}"] = dvc_md5(path)
            tags[f"input.{name}"] = str(path)
    return tags
