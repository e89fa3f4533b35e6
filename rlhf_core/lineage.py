"""Lineage facts recorded with every run: the git commit and DVC-compatible md5s of inputs.

The md5s are computed the way DVC 3 computes them (a file: md5 of its bytes; a directory:
md5 of the JSON list of its files' md5s and relative paths, with a ``.dir`` suffix), so
the digest on an MLflow run equals the one in ``dvc.lock`` and a user can go from a run to
the DVC commit that reproduces it. Pure Python on purpose: ``rlhf_core`` must run on GPU
machines where DVC is not installed; a test checks these against ``dvc`` itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

_CHUNK = 1 << 20


def file_md5(path: str | Path) -> str:
    """md5 hex digest of a file's bytes."""
    h = hashlib.md5()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_md5(path: str | Path) -> str:
    """DVC's directory hash: md5 of the sorted ``[{"md5", "relpath"}]`` JSON, plus ``.dir``."""
    root = Path(path)
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (".dvc", ".git")]
        for name in filenames:
            full = Path(dirpath) / name
            entries.append({"md5": file_md5(full), "relpath": full.relative_to(root).as_posix()})
    entries.sort(key=lambda e: e["relpath"])
    # DVC serialises with json.dumps(..., sort_keys=True) and default separators.
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def dvc_md5(path: str | Path) -> str:
    """The md5 DVC records for ``path`` (file or directory)."""
    path = Path(path)
    return dir_md5(path) if path.is_dir() else file_md5(path)


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
