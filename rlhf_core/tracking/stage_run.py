"""A stage's MLflow run: opened with its lineage, its params, inputs and data reports logged.

:func:`maybe_run` opens a stage's run when tracking is on; :func:`open_stage_run` starts a training stage's
(nested) run, tagged with the git commit and the DVC md5 of every input
(:func:`rlhf_core.tracking.lineage.lineage_tags`), and logs its params, datasets and data reports;
:func:`log_report_files` logs a data report's page and JSON. Called by :mod:`rlhf_core.stages`.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rlhf_core.common.redact import redact_secrets
from rlhf_core.config import TrackingConfig, config_params
from rlhf_core.tracking.lineage import dvc_md5, lineage_tags
from rlhf_core.tracking.mlflow_runs import start_run

def log_report_files(run: Any, name: str, html: str, report: dict[str, Any]) -> None:
    """The data report's page (secrets redacted) and JSON, as ``data_report/<name>.html`` / ``.json``."""
    run.log_text(redact_secrets(html), f"data_report/{name}.html")
    run.log_dict(report, f"data_report/{name}.json")


@contextmanager
def maybe_run(tracking: TrackingConfig | None, name: str, parent_run_id: str | None,
               tags: dict[str, str]) -> Iterator[Any]:
    """An MLflow run when ``tracking`` is given (flows want a run per stage), else ``None``."""
    if tracking is None:
        yield None
        return

    with start_run(tracking, name, parent_run_id, tags) as run:
        yield run


def stage_inputs(cfg: Any, datasets: dict[str, tuple[str, str]], extra: dict[str, str] | None) -> dict[str, str]:
    """What a training stage's lineage records: its start model, its datasets, a reference model, ``extra``."""
    inputs = {"model": cfg.model_path, **{k: path for k, (path, _) in datasets.items()}}
    if getattr(cfg, "ref_model_path", ""):
        inputs["reference"] = cfg.ref_model_path
    inputs.update(extra or {})
    return inputs


MANIFEST = "manifest.json"
"""A generated dataset folder's record of where its files came from (``alignflow gym-generate`` writes one)."""


def source_tags(datasets: dict[str, tuple[str, str]]) -> dict[str, str]:
    """``source.<dataset>.*`` tags of each dataset whose folder holds a generator's :data:`MANIFEST`: the package
    and its version, the task and its config (a reasoning-gym task: the lineage of data no DVC stage of the run's
    own project describes); none for a folder without one."""
    tags: dict[str, str] = {}
    for name, (path, _) in datasets.items():
        manifest = Path(path).parent / MANIFEST
        try:
            record = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and {"package", "version", "task"} <= set(record):
            tags.update({f"source.{name}.package": f"{record['package']}=={record['version']}",
                         f"source.{name}.task": str(record["task"]),
                         f"source.{name}.task_config": json.dumps(record.get("task_config", {}), sort_keys=True)})
    return tags


@contextmanager
def open_stage_run(tracking: TrackingConfig, name: str, parent_run_id: str | None, cfg: Any,
                   datasets: dict[str, tuple[str, str]], extra_inputs: dict[str, str] | None,
                   reports: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """The stage's run, its lineage tags, params, input datasets and data reports logged."""
    with start_run(tracking, name, parent_run_id, lineage_tags(stage_inputs(cfg, datasets, extra_inputs), name)) as run:
        run.log_params(config_params(cfg))
        sources = source_tags(datasets)
        if sources:
            run.set_tags(sources)
        for ds_name, (path, context) in datasets.items():
            run.log_input(path, ds_name, dvc_md5(path), context)
        for ds_name, report in reports.items():
            log_report_files(run, ds_name, report["html"], report["report"])
            run.log_metrics({**report["stats"], "data/report_failed_expectations": 0.0}, 0)
        yield run

