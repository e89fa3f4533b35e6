"""Test hooks: ``ALIGNFLOW_FAULT=<stage>:<point>[:<marker file>]`` makes a run fail (or stop) at a named point.

Used by the trainers (:func:`inject_fault`, after a training step or at ``tracking``: the model saved, not yet
logged) and by the registration (``tasks.registry.fault_point``, ``register:<point>``). Kept here, with no ML
import, so the registration does not depend on the trainers' loop.

- With a marker file the fault fires once (the file is made when it fires): a Prefect task fails on its first
  attempt and succeeds on its retry.
- ``ALIGNFLOW_FAULT_RANK=r``: only data-parallel rank ``r`` fires.
- ``ALIGNFLOW_FAULT_SIGNAL``: ``KILL`` the process instead of raising (a worker dying with no handler run), ``STOP``
  it (a worker that hangs), or ``PAUSE`` it: it stops and, once continued, goes on without raising (a test changes
  the world at that point, as cutting the object store before the model's push).

Unset in normal use: the cost is one environment lookup per call.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable


class InjectedFault(RuntimeError):
    """Raised by :func:`inject_fault`; Prefect treats it as transient and retries."""


def fires(stage: str, point: int | str, rank: Callable[[], int] | None = None) -> str | None:
    """The ``ALIGNFLOW_FAULT`` spec when it names ``stage`` and ``point`` (on the rank ``ALIGNFLOW_FAULT_RANK``
    names, ``rank()`` giving this process's; a caller with no rank, the stage's driver, fires whatever it names),
    not yet fired where it has a marker file; else None."""
    spec = os.environ.get("ALIGNFLOW_FAULT")
    if not spec:
        return None
    parts = spec.split(":", 2)
    if parts[:2] != [stage, str(point)]:
        return None
    only_rank = os.environ.get("ALIGNFLOW_FAULT_RANK")
    if only_rank is not None and rank is not None and rank() != int(only_rank):
        return None
    if len(parts) == 3:
        marker = Path(parts[2])
        if marker.exists():
            return None
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{stage}:{point}\n")
    return spec


def inject_fault(stage: str, step: int | str, rank: Callable[[], int] | None = None) -> None:
    """Fail (raise :class:`InjectedFault`), kill, stop or pause this process where ``ALIGNFLOW_FAULT`` names
    ``stage`` and ``step``; nothing otherwise."""
    spec = fires(stage, step, rank)
    if spec is None:
        return
    how = os.environ.get("ALIGNFLOW_FAULT_SIGNAL")
    if how in ("KILL", "STOP", "PAUSE"):
        os.kill(os.getpid(), signal.SIGKILL if how == "KILL" else signal.SIGSTOP)
        if how == "PAUSE":
            return
    raise InjectedFault(f"{stage}: fault injected after step {step} (ALIGNFLOW_FAULT={spec})")
