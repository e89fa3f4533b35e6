"""The project folder every path of a run is relative to: ``ALIGNFLOW_HOME``, else the current directory."""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """``ALIGNFLOW_HOME`` if set, else the current directory, always absolute."""
    return Path(os.environ.get("ALIGNFLOW_HOME", os.getcwd())).resolve()


def flow_lock_path() -> Path:
    """``<project>/.alignflow/flow.lock``: held by a flow run from start to end, and by ``alignflow gc --apply``."""
    return project_root() / ".alignflow" / "flow.lock"
