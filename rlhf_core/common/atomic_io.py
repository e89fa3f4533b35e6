"""One way to write a small file so that a reader never sees it half-written.

The text goes to a temporary name beside the target, unique per writer (pid and a random
suffix, so two processes or a retry never share one), and is renamed over the target; the
temporary file is removed whatever happens. Folders (checkpoints, model directories) are
staged the same way by :mod:`rlhf_core.tracking.checkpoint`. :func:`fsync_path` makes a file's bytes, or a
folder's names, durable.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Iterable


def write_text_atomic(path: str | Path, chunks: Iterable[str] | str) -> Path:
    """Write ``chunks`` (one string, or strings written in order) to ``path`` atomically; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with tmp.open("w", encoding="utf-8", newline="\n") as fh:
            for chunk in [chunks] if isinstance(chunks, str) else chunks:
                fh.write(chunk)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
