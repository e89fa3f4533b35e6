"""Model tasks: build the embedded tiny model and its tokenizer."""

from __future__ import annotations

from typing import Any

from prefect import task

from rlhf_core.stages import wrappers as stages
from rlhf_core.config import ModelConfig, TrackingConfig, build_config
from tasks.common import TASK_DEFAULTS


@task(name="build-base-model", **TASK_DEFAULTS)
def build_base_model(params: dict[str, Any], corpus_md5: str, tracking: dict[str, Any],
                     parent_run_id: str | None = None) -> dict[str, Any]:
    """Train the tokenizer on the corpus and build the tiny HF model; returns its path and md5."""
    del corpus_md5  # cache key only
    return stages.init_model(build_config(ModelConfig, "model", params),
                             build_config(TrackingConfig, "tracking", tracking), parent_run_id).to_dict()
