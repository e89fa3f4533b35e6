"""A checkpoint folder's ``manifest.json``: every file's relative path, size and sha256, written last.

:func:`write_manifest` lists and fsyncs a folder's files; :func:`read_manifest` reads the list back and refuses
anything else (bytes that are not JSON, another JSON value, an entry whose path leaves the folder) with a
ValueError naming the file and the entry; :func:`verify_manifest` says what in the folder differs from it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rlhf_core.common.atomic_io import fsync_path
from rlhf_core.tracking.lineage import file_sha256

MANIFEST_FILE = "manifest.json"


def write_manifest(folder: Path, header: dict[str, Any]) -> None:
    """fsync every file under ``folder`` and list it (relative path, size, sha256) in ``manifest.json``,
    written last and fsynced, with ``header`` (format, step, fingerprint) beside the list."""
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
            os.fsync(fh.fileno())
        files.append({"path": path.relative_to(folder).as_posix(), "size": path.stat().st_size,
                      "sha256": digest.hexdigest()})
    with open(folder / MANIFEST_FILE, "w", encoding="utf-8") as fh:
        json.dump({**header, "files": files}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    for dirpath, _dirs, _files in os.walk(folder, topdown=False):
        fsync_path(dirpath)


def _entry_problem(entry: Any) -> str | None:
    """What makes ``entry`` no manifest entry (``path``: a relative path inside the folder, ``size``: an int >= 0,
    ``sha256``: a string), or None. Checked by hand: three fields, where a schema library would be a dependency
    more for the same lines."""
    if not isinstance(entry, dict):
        return f"expected an object, got {type(entry).__name__}"
    path = entry.get("path")
    if not isinstance(path, str) or not path or "\0" in path or path.startswith("/") or ".." in path.split("/"):
        return f"path {str(path)[:80]!r} is not a relative path inside the checkpoint"
    if isinstance(entry.get("size"), bool) or not isinstance(entry.get("size"), int) or entry["size"] < 0:
        return f"size {str(entry.get('size'))[:40]!r} is not a byte count"
    return None if isinstance(entry.get("sha256"), str) else "sha256 is not a string"


def read_manifest(folder: Path) -> dict[str, Any]:
    """``manifest.json`` of a checkpoint; ValueError naming the file and what is wrong (absent, unreadable, not
    JSON, or not an object whose ``files`` lists entries of :func:`_entry_problem`'s shape)."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise ValueError(f"no {MANIFEST_FILE} (torn, or written before checkpoints carried one)")
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{MANIFEST_FILE} unreadable: {type(exc).__name__}: {str(exc)[:200]}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list):
        raise ValueError(f"{MANIFEST_FILE} unreadable: expected an object with a list 'files'")
    for i, entry in enumerate(files):
        if (problem := _entry_problem(entry)) is not None:
            raise ValueError(f"{MANIFEST_FILE} files[{i}]: {problem}")
    return manifest


def verify_manifest(folder: Path, manifest: dict[str, Any]) -> str | None:
    """What in ``folder`` differs from its manifest (a malformed entry, a missing file, a size, a sha256), or
    None if nothing."""
    for entry in manifest["files"]:
        if (problem := _entry_problem(entry)) is not None:
            return f"{MANIFEST_FILE}: {problem}"
        path = folder / entry["path"]
        try:
            if not path.is_file():
                return f"{entry['path']} is missing"
            size = path.stat().st_size
            if size != entry["size"]:
                return f"{entry['path']} is {size} bytes, the manifest says {entry['size']}"
            if file_sha256(path) != entry["sha256"]:
                return f"{entry['path']} sha256 differs from the manifest"
        except OSError as exc:
            return f"{entry['path']} unreadable: {exc}"
    return None
