"""Evaluation tasks: greedy exact-match accuracy of a model directory."""

from __future__ import annotations

from typing import Any

from prefect import task

from rlhf_core.stages import wrappers as stages
from rlhf_core.config import EvalConfig, TrackingConfig, build_config
from tasks.common import TASK_DEFAULTS


@task(name="evaluate-model", task_run_name="evaluate-{label}", **TASK_DEFAULTS)
def evaluate_model(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str], label: str,
                   parent_run_id: str | None = None) -> dict[str, Any]:
    """Evaluate one model on held-out prompts as a nested MLflow run named ``evaluate-<label>``."""
    del input_md5  # cache key only
    cfg = build_config(EvalConfig, "evaluate", params)
    return stages.evaluate(cfg, build_config(TrackingConfig, "tracking", tracking), parent_run_id,
                           run_name=f"evaluate-{label}").to_dict()
