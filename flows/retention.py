"""What ``alignflow gc`` keeps and deletes in the MLflow store and the project's checkpoint folders.

Runs are kept or deleted a flow run at a time: a run with no parent run (a flow's, or a stage command's own) is a
*root*, and every run under it goes with it. Precedence, first match wins:

1. **Protected**, whatever the age and count rules say: a root holding a run tagged ``alignflow.keep`` (any value
   but ``false``/``0``); the lineage of every registered version an alias points at (the version's run, the flow run
   it ran in with every stage run of that flow, and, recursively, the runs its ``alignflow.*_run_id`` tags name);
   and a version whose registration is still ``pending``.
2. **Kept by count**: the ``retention.keep_runs`` newest roots.
3. **Kept by age**: every root younger than ``retention.keep_days``.
4. Everything else is deleted: the runs and their artifacts, the registered versions registered from them (no
   alias points at those, by rule 1) and the logged models they logged.

The kept runs name what the DVC side keeps (:mod:`flows.retention_dvc`): the git commits they ran at and the DVC
md5s of their inputs and outputs (``dvc.md5.*`` tags). A checkpoint folder (``step-*`` folders under a stage's
``checkpoint_dir``, left by a stage that did not finish) is deleted once its newest checkpoint is older than
``keep_days`` and no stage holds its lock.

Deletion goes through MLflow's own API: ``MlflowClient.delete_model_version``, ``delete_logged_model`` and
``delete_run`` mark them deleted, then the function behind ``mlflow gc`` removes those runs and logged models with
their artifacts (:func:`purge_deleted`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from rlhf_core.config import RetentionConfig
from rlhf_core.tracking.mlflow_runs import REGISTRATION_TAG

log = logging.getLogger(__name__)

KEEP_TAG = "alignflow.keep"
"""On a run: keep its flow run (the root it belongs to) whatever the age and count rules say."""
PARENT_TAG = "mlflow.parentRunId"
LINEAGE_RUN_TAG = re.compile(r"^alignflow\.\w*run_id$")
"""Tags that name another run a run was made from (``alignflow.sft_run_id``, ``alignflow.parent_cycle_run_id``)."""
DAY_MS = 86_400_000


@dataclass
class RunInfo:
    """What retention reads of one run."""

    run_id: str
    name: str
    start_ms: int
    parent: str
    tags: dict[str, str]
    experiment_id: str


@dataclass
class MlflowPlan:
    """What gc keeps and deletes in the MLflow store; the reasons a root is kept name the rule that kept it."""

    kept: dict[str, str] = field(default_factory=dict)
    runs: list[RunInfo] = field(default_factory=list)
    versions: list[tuple[str, str]] = field(default_factory=list)
    logged_models: list[str] = field(default_factory=list)
    kept_runs: list[RunInfo] = field(default_factory=list)
    protected_md5s: set[str] = field(default_factory=set)


def is_kept_tag(value: str | None) -> bool:
    """True for an ``alignflow.keep`` tag that asks to keep (any value but empty, ``false``, ``0``, ``no``)."""
    return value is not None and value.strip().lower() not in ("", "false", "0", "no")


# --------------------------------------------------------------------------------------
# Reading the store
# --------------------------------------------------------------------------------------


def list_runs(client: Any, experiment_ids: list[str]) -> dict[str, RunInfo]:
    """Every active run of the experiments, by id (all pages)."""
    from mlflow.entities import ViewType  # lazy: mlflow (light `gc --help`)

    runs: dict[str, RunInfo] = {}
    token = None
    while True:
        page = client.search_runs(experiment_ids, run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                  page_token=token)
        for run in page:
            tags = dict(run.data.tags)
            runs[run.info.run_id] = RunInfo(run.info.run_id, run.info.run_name or "", int(run.info.start_time or 0),
                                            tags.get(PARENT_TAG, ""), tags, run.info.experiment_id)
        token = page.token
        if not token:
            return runs


def list_versions(client: Any) -> list[Any]:
    """Every version of every registered model in the store's registry."""
    names = [m.name for m in client.search_registered_models(max_results=1000)]
    return [v for name in names for v in client.search_model_versions(f"name='{name}'", max_results=10_000)]


def aliased_versions(client: Any) -> set[tuple[str, str]]:
    """(name, version) of every version an alias points at."""
    return {(m.name, str(v)) for m in client.search_registered_models(max_results=1000) for v in m.aliases.values()}


# --------------------------------------------------------------------------------------
# Deciding
# --------------------------------------------------------------------------------------


def root_of(run_id: str, runs: dict[str, RunInfo]) -> str:
    """The run with no (known) parent above ``run_id``."""
    seen = set()
    while run_id in runs and runs[run_id].parent in runs and run_id not in seen:
        seen.add(run_id)
        run_id = runs[run_id].parent
    return run_id


def lineage_roots(start: Iterable[str], runs: dict[str, RunInfo]) -> set[str]:
    """The roots of ``start``'s runs and of every run their ``alignflow.*_run_id`` tags name, followed through
    every run under each such root (a flow's registration run names the stage runs it promoted)."""
    children: dict[str, list[str]] = {}
    for run in runs.values():
        children.setdefault(root_of(run.run_id, runs), []).append(run.run_id)
    roots: set[str] = set()
    todo = [r for r in start if r in runs]
    while todo:
        root = root_of(todo.pop(), runs)
        if root in roots:
            continue
        roots.add(root)
        for member in children.get(root, []):
            todo += [v for k, v in runs[member].tags.items() if LINEAGE_RUN_TAG.match(k) and v in runs]
    return roots


def protected_roots(runs: dict[str, RunInfo], versions: list[Any], aliased: set[tuple[str, str]]) -> dict[str, str]:
    """Roots kept whatever the age and count rules say, with the reason."""
    reasons: dict[str, str] = {}
    held = [v for v in versions if (v.name, str(v.version)) in aliased]
    for version in held:
        for root in lineage_roots([version.run_id], runs):
            reasons.setdefault(root, f"lineage of {version.name} version {version.version} (aliased)")
    for version in versions:
        if version.tags.get(REGISTRATION_TAG) == "pending" and version.run_id in runs:
            reasons.setdefault(root_of(version.run_id, runs), f"{version.name} version {version.version} pending")
    for run in runs.values():
        if is_kept_tag(run.tags.get(KEEP_TAG)):
            reasons.setdefault(root_of(run.run_id, runs), f"tagged {KEEP_TAG}")
    return reasons


def kept_roots(runs: dict[str, RunInfo], cfg: RetentionConfig, now_ms: int,
               protected: dict[str, str]) -> dict[str, str]:
    """Every kept root with the first rule that keeps it: protected, then count, then age."""
    roots = sorted({root_of(r, runs) for r in runs}, key=lambda r: runs[r].start_ms, reverse=True)
    kept = dict(protected)
    for root in roots[:cfg.keep_runs]:
        kept.setdefault(root, f"among the {cfg.keep_runs} newest flow runs (retention.keep_runs)")
    cutoff = now_ms - cfg.keep_days * DAY_MS
    for root in roots:
        if runs[root].start_ms >= cutoff:
            kept.setdefault(root, f"younger than {cfg.keep_days:g} days (retention.keep_days)")
    return kept


def plan_mlflow(client: Any, experiment_ids: list[str], cfg: RetentionConfig, now_ms: int | None = None) -> MlflowPlan:
    """What gc would keep and delete in the MLflow store now."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    runs = list_runs(client, experiment_ids)
    versions = [v for v in list_versions(client) if v.run_id in runs or not v.run_id]
    aliased = aliased_versions(client)
    protected = protected_roots(runs, versions, aliased)
    kept = kept_roots(runs, cfg, now_ms, protected)
    plan = MlflowPlan(kept=kept)
    for run in sorted(runs.values(), key=lambda r: r.start_ms):
        (plan.kept_runs if root_of(run.run_id, runs) in kept else plan.runs).append(run)
    doomed = {r.run_id for r in plan.runs}
    plan.versions = [(v.name, str(v.version)) for v in versions
                     if v.run_id in doomed and (v.name, str(v.version)) not in aliased]
    doomed_versions = set(plan.versions)
    kept_models = {model_of(v) for v in versions if (v.name, str(v.version)) not in doomed_versions}
    plan.logged_models = sorted(m.model_id for m in _logged_models(client, experiment_ids)
                                if m.source_run_id in doomed and m.model_id not in kept_models)
    plan.protected_md5s = {v for r in plan.kept_runs for k, v in r.tags.items() if k.startswith("dvc.md5")}
    plan.protected_md5s |= {v.tags["dvc.md5"] for v in versions if v.run_id not in doomed and "dvc.md5" in v.tags}
    return plan


def model_of(version: Any) -> str:
    """The logged model a version was registered from (its ``model_id``, else its ``models:/<id>`` source)."""
    source = str(version.source)
    return getattr(version, "model_id", None) or (source[len("models:/"):] if source.startswith("models:/m-") else "")


def _logged_models(client: Any, experiment_ids: list[str]) -> list[Any]:
    """Every active logged model of the experiments (all pages)."""
    models, token = [], None
    while True:
        page = client.search_logged_models(experiment_ids=experiment_ids, max_results=100, page_token=token)
        models += list(page)
        token = page.token
        if not token:
            return models


def kept_commits(plan: MlflowPlan) -> set[str]:
    """The git commits the kept runs ran at (a ``-dirty`` suffix dropped: the commit is what DVC can read)."""
    return {r.tags["git.commit"].removesuffix("-dirty") for r in plan.kept_runs
            if re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", r.tags.get("git.commit", ""))}


# --------------------------------------------------------------------------------------
# Deleting
# --------------------------------------------------------------------------------------


def apply_mlflow(client: Any, uri: str, plan: MlflowPlan) -> None:
    """Delete what ``plan`` names: the registry entries first (a failure after leaves files no entry points at,
    never an entry without its model), then the logged models and runs, then their data and artifacts."""
    for name, number in plan.versions:
        client.delete_model_version(name, number)
    for model_id in plan.logged_models:
        client.delete_logged_model(model_id)
    for run in plan.runs:
        client.delete_run(run.run_id)
    purge_deleted(uri, [r.run_id for r in plan.runs], plan.logged_models)


def purge_deleted(uri: str, run_ids: list[str], logged_model_ids: list[str]) -> None:
    """Remove the named deleted runs and logged models for good, with their artifacts: ``mlflow gc``'s own code.

    Why not the ``mlflow gc`` command: given ``--run-ids`` alone it also removes every experiment and every logged
    model anyone marked deleted (it has no flag to leave them), so gc calls the function behind it with this
    plan's ids only and experiments left alone.
    """
    if not run_ids and not logged_model_ids:
        return
    from mlflow.cli import _gc_tracking_resources  # lazy: mlflow (light `gc --help`)
    from mlflow.tracking import _get_store  # lazy: mlflow (light `gc --help`)

    store = _get_store(uri, None)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # its line per run would mix into gc's own report (--json)
        _gc_tracking_resources(backend_store=store, run_ids=run_ids, experiment_ids=None,
                               logged_model_ids=logged_model_ids, older_than=None, time_delta=0,
                               skip_experiments=True, skip_logged_models=not logged_model_ids)
    for line in said.getvalue().splitlines():
        log.info("mlflow gc: %s", line)


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


def checkpoint_roots(project: Path, extra: Iterable[str | Path] = ()) -> list[Path]:
    """Folders holding ``step-*`` checkpoints: under ``<project>/checkpoints`` and the ``extra`` folders named by
    params sections' ``checkpoint_dir``."""
    found = {p.parent for p in (project / "checkpoints").rglob("step-*") if p.is_dir()} \
        if (project / "checkpoints").is_dir() else set()
    for folder in extra:
        folder = Path(folder) if Path(folder).is_absolute() else project / folder
        if any(p.is_dir() for p in folder.glob("step-*")):
            found.add(folder)
    return sorted(found)


def stale_checkpoints(roots: list[Path], cfg: RetentionConfig, now_s: float | None = None) -> list[Path]:
    """The step folders of every checkpoint folder whose newest checkpoint is older than ``keep_days``."""
    cutoff = (time.time() if now_s is None else now_s) - cfg.keep_days * 86_400
    stale = []
    for root in roots:
        steps = sorted(p for p in root.glob("step-*") if p.is_dir())
        if steps and max(p.stat().st_mtime for p in steps) < cutoff:
            stale += steps
    return stale


def remove_checkpoints(stale: list[Path]) -> list[Path]:
    """Clear each stale checkpoint folder under its lock (``clear_checkpoints``: a stage training there now keeps
    its checkpoints); returns the step folders actually removed."""
    from rlhf_core.tracking.checkpoint import clear_checkpoints  # lazy: torch (only when something is stale)

    for root in sorted({p.parent for p in stale}):
        clear_checkpoints(root)
    return [p for p in stale if not p.exists()]
