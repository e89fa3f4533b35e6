"""Training tasks: one per alignment stage (SFT now)."""

from __future__ import annotations

from typing import Any

from prefect import task

from rlhf_core import stages
from rlhf_core.config import SFTConfig, TrackingConfig, build_config
from tasks.common import TASK_DEFAULTS


@task(name="train-sft", **TASK_DEFAULTS)
def train_sft(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
              parent_run_id: str | None = None) -> dict[str, Any]:
    """Supervised fine-tuning as a nested MLflow run; returns the model path, md5 and metrics."""
    del input_md5  # cache key only: model and data content
    cfg = build_config(SFTConfig, "sft", params)
    return stages.sft(cfg, build_config(TrackingConfig, "tracking", tracking), parent_run_id).to_dict()
