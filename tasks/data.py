"""Data tasks: generate the embedded datasets, validate any dataset with Great Expectations."""

from __future__ import annotations

from typing import Any

from prefect import task

from rlhf_core.stages import wrappers as stages
from rlhf_core.config import DataFields, DataReportConfig, GenerateConfig, RejectionConfig, TrackingConfig, build_config
from tasks.common import TASK_DEFAULTS, VALIDATION_CACHE_POLICY


@task(name="generate-data", **TASK_DEFAULTS)
def generate_data(params: dict[str, Any], tracking: dict[str, Any], parent_run_id: str | None = None) -> dict[str, Any]:
    """Write the embedded task's datasets; returns their paths and md5s."""
    return stages.generate(build_config(GenerateConfig, "generate", params),
                           build_config(TrackingConfig, "tracking", tracking), parent_run_id).to_dict()


@task(name="validate-data", task_run_name="validate-{name}",
      **{**TASK_DEFAULTS, "retries": 0, "cache_policy": VALIDATION_CACHE_POLICY})
def validate_data(path: str, md5: str, kind: str, name: str, fields: dict[str, Any], tracking: dict[str, Any],
                  parent_run_id: str | None = None, desirable_field: str | None = None,
                  data_report: dict[str, Any] | None = None, eval_file: str | None = None,
                  previous: dict[str, float] | None = None, report_to_parent: bool = False) -> dict[str, Any]:
    """Great Expectations gate on one dataset; raises on failure (``md5`` is recorded in the task inputs).
    ``desirable_field``: the unpaired kind's boolean field. ``data_report`` (the ``data_report``
    section): also the data report, contamination checked against ``eval_file``, drift against
    ``previous`` (an earlier result's metrics); its page is logged to ``parent_run_id`` too with
    ``report_to_parent``."""
    del md5
    return stages.validate(path, kind, DataFields(**fields), tracking=build_config(TrackingConfig, "tracking", tracking),
                           parent_run_id=parent_run_id, name=name, desirable_field=desirable_field,
                           data_report=build_config(DataReportConfig, "data_report", data_report)
                           if data_report is not None else None,
                           eval_file=eval_file, previous=previous, report_to_parent=report_to_parent).to_dict()


@task(name="sample-best-of-n", **TASK_DEFAULTS)
def sample_best_of_n(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
                     parent_run_id: str | None = None) -> dict[str, Any]:
    """Rejection sampling: n candidates per prompt, scored; returns the kept-samples and pairs files."""
    del input_md5  # cache key only: policy, reward model and prompts content
    return stages.rejection(build_config(RejectionConfig, "rejection", params),
                            build_config(TrackingConfig, "tracking", tracking), parent_run_id).to_dict()
