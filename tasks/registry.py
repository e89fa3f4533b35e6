"""Model registry: every cycle's model becomes ``candidate``; ``champion`` only if it wins.

The model is logged (MLflow transformers flavor) into the MLflow run of the stage that
trained it, so the registered version's source run is that stage run, whose inputs and
lineage tags say which data and parent model produced it. The champion comparison (the
stage's ``eval/accuracy`` against the current champion's) is recorded on the version as
tags and returned, so the flow logs it on its cycle run.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from rlhf_core.config import TrackingConfig, build_config
from rlhf_core.tracking import MlflowTracker, resolve_tracking_uri

CANDIDATE, CHAMPION = "candidate", "champion"
METRIC_TAG = "eval_accuracy"


@task(name="register-model", retries=1, retry_delay_seconds=5)
def register_model(model_dir: str, run_id: str, accuracy: float, registered_name: str,
                   tracking: dict[str, Any], higher_is_better: bool = True) -> dict[str, Any]:
    """Register ``model_dir`` from stage run ``run_id``; alias it ``candidate``, and ``champion`` if it beats it."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = resolve_tracking_uri(build_config(TrackingConfig, "tracking", tracking))
    client = MlflowClient(tracking_uri=uri)
    mlflow.set_tracking_uri(uri)  # log_hf_model goes through the fluent API
    # Idempotent: a stage run already registered (a cached stage in a re-run flow) keeps its version.
    existing = [v for v in client.search_model_versions(f"name='{registered_name}'") if v.run_id == run_id]
    if existing:
        version = existing[0]
        model_uri = version.source
    else:
        model_uri = MlflowTracker(client, run_id).log_hf_model(model_dir, registered_name)
        version = next(v for v in client.search_model_versions(f"name='{registered_name}'") if v.run_id == run_id)
    client.set_model_version_tag(registered_name, version.version, METRIC_TAG, f"{accuracy:.6f}")
    client.set_registered_model_alias(registered_name, CANDIDATE, version.version)

    try:
        champion = client.get_model_version_by_alias(registered_name, CHAMPION)
        champion_accuracy: float | None = float(champion.tags.get(METRIC_TAG, "nan"))
        champion_version: str | None = champion.version
    except MlflowException:  # no champion yet: the first candidate takes the title
        champion_accuracy, champion_version = None, None
    better = champion_accuracy is None or (accuracy > champion_accuracy if higher_is_better
                                           else accuracy < champion_accuracy)
    if better:
        client.set_registered_model_alias(registered_name, CHAMPION, version.version)
    verdict = (f"candidate v{version.version} ({accuracy:.4f}) "
               + (f"vs champion v{champion_version} ({champion_accuracy:.4f}): " if champion_version else "no champion: ")
               + ("promoted to champion" if better else "champion kept"))
    client.set_model_version_tag(registered_name, version.version, "promotion", verdict)
    return {"model_uri": model_uri, "version": str(version.version), "promoted": better,
            "champion_version": str(version.version) if better else champion_version,
            "previous_champion_accuracy": champion_accuracy, "verdict": verdict}
