"""A separate OS process that registers one model version per round, in step with a rival.

Used by tests/e2e/test_registry.py: two of these race :func:`tasks.registry.register_model`
against one MLflow store; a barrier shared with the test starts every round in both at once.
"""

from __future__ import annotations

import importlib
import os
import time
import traceback
from typing import Any


def race(env: dict[str, str], model_dir: str, name: str, plan: list[tuple[str, float]], tracking: dict[str, Any],
         barrier: Any, results: Any, module: str = "tasks.registry") -> None:
    """For each ``(run_id, accuracy)`` of ``plan``: wait for the round's start, register, report
    ``(run_id, result, start, end)`` on ``results``, wait for the round's end (the test checks then).
    ``module`` names the register function's module (a replaced one shows the race without its guards)."""
    os.environ.update(env)
    register = getattr(importlib.import_module(module), "register_model").fn
    for run_id, accuracy in plan:
        try:
            barrier.wait(timeout=300)
            start = time.time()
            out = register(model_dir=model_dir, run_id=run_id, accuracy=accuracy, registered_name=name,
                           tracking=tracking)
            results.put((run_id, out, start, time.time()))
        except Exception:  # noqa: BLE001 - the test reports it; the barrier is broken so nobody waits
            results.put((run_id, traceback.format_exc(), 0.0, 0.0))
            barrier.abort()
            return
        barrier.wait(timeout=300)
