"""``alignflow gc``: delete old MLflow runs with their artifacts, registered versions and logged models, stale
checkpoints, and DVC cache (and remote) objects no kept commit or kept run refers to. A dry run unless ``--apply``.

What it keeps is the ``retention`` section of ``params.yaml`` (``--set retention.keep_runs=20``); the rules and their
precedence are in :mod:`flows.retention` (MLflow, checkpoints) and :mod:`flows.retention_dvc` (DVC), and in
``alignflow gc --help``. ``--apply`` holds the project's flow lock, so it never runs beside a flow of the project.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from flows import errors
from flows.cli import setup_logging
from flows.retention import (MlflowPlan, apply_mlflow, checkpoint_roots, kept_commits, plan_mlflow,
                             remove_checkpoints, stale_checkpoints)
from flows.retention_dvc import apply_dvc, plan_dvc
from rlhf_core.config import (OVERRIDE_SOURCE, ConfigError, RetentionConfig, TrackingConfig, load_config,
                              parse_overrides, read_params)
from rlhf_core.common.project import flow_lock_path, project_root
from rlhf_core.tracking.mlflow_runs import resolve_tracking_uri
from rlhf_core.tracking.schema import check_schema

DESCRIPTION = """\
Delete what a project no longer needs: MLflow runs with their artifacts, the registered versions and logged models
made by those runs, stale checkpoints, and DVC cache objects (with retention.dvc_cloud, remote objects too) that no
kept commit or kept run refers to. Prints what it would delete; --apply deletes it.

Precedence (first match wins):
  1. never deleted, whatever the age and count rules say: a registered version an alias points at (champion,
     candidate), that version's lineage (its run, the flow run it ran in with all its stage runs, the runs its
     alignflow.*_run_id tags name, and the DVC objects their dvc.md5.* tags name, even from old commits), a
     version whose registration is pending, and every flow run holding a run tagged alignflow.keep;
  2. kept by count: the retention.keep_runs newest flow runs (a run with no parent, with all its stage runs), and
     the keep_runs newest commits of HEAD;
  3. kept by age: flow runs, commits and checkpoints younger than retention.keep_days;
  4. everything else is deleted: MLflow through its API (delete_model_version, delete_logged_model, delete_run,
     then mlflow gc's removal of those runs and models with their artifacts), DVC objects through DVC's own
     collector (what dvc gc runs), checkpoint folders under their lock.
"""


@dataclass
class Report:
    """What one gc pass found (and, applied, deleted)."""

    applied: bool
    kept_runs: int
    runs: list[dict[str, Any]]
    versions: list[str]
    logged_models: list[str]
    checkpoints: list[str]
    dvc_cache: list[str]
    dvc_remote: list[str]
    kept_reasons: dict[str, str]
    kept_commits: int
    missing_commits: list[str]
    dvc_skipped: str

    def counts(self) -> dict[str, int]:
        return {"runs": len(self.runs), "versions": len(self.versions), "logged_models": len(self.logged_models),
                "checkpoints": len(self.checkpoints), "dvc_cache": len(self.dvc_cache),
                "dvc_remote": len(self.dvc_remote)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignflow gc", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--apply", action="store_true", help="delete (default: only report what would go)")
    parser.add_argument("--list", action="store_true", help="list every run, version, model, checkpoint and object")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override retention.* or tracking.* (repeatable), e.g. retention.keep_runs=20")
    return parser


def load_sections(params: str, pairs: Sequence[str]) -> tuple[RetentionConfig, TrackingConfig]:
    """The ``retention`` and ``tracking`` sections, with ``--set`` overrides (any other section is an error)."""
    overrides: dict[str, dict[str, Any]] = {"retention": {}, "tracking": {}}
    for key, value in parse_overrides(list(pairs)).items():
        section, dot, name = key.partition(".")
        if not dot or section not in overrides:
            raise ConfigError(f"{OVERRIDE_SOURCE}: {key}: `alignflow gc` takes retention.FIELD=VALUE or "
                              "tracking.FIELD=VALUE")
        overrides[section][name] = value
    path = params if Path(params).exists() else None
    return (load_config(RetentionConfig, "retention", path, overrides["retention"]),
            load_config(TrackingConfig, "tracking", path, overrides["tracking"]))


def _checkpoint_dirs(params: str) -> list[str]:
    """The ``checkpoint_dir`` every params section sets (their defaults lie under ``checkpoints/``)."""
    if not Path(params).exists():
        return []
    return [str(values["checkpoint_dir"]) for values in read_params(params).values()
            if isinstance(values, dict) and isinstance(values.get("checkpoint_dir"), str)]


def open_store(tracking: TrackingConfig) -> tuple[Any, str, list[str]]:
    """The MLflow client, its URI and the project's experiment ids (none when the experiment does not exist);
    the database's schema is checked first."""
    import mlflow  # lazy: mlflow (light `gc --help`)
    from mlflow.tracking import MlflowClient  # lazy: mlflow (light `gc --help`)

    uri = resolve_tracking_uri(tracking)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        return None, uri, []  # no store yet: nothing to collect, and no empty database made by looking
    check_schema(uri)
    mlflow.set_tracking_uri(uri)  # the registry's own lookups (a version's logged model) use the process's store
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.get_experiment_by_name(tracking.experiment)
    return client, uri, [experiment.experiment_id] if experiment else []


def collect(args: argparse.Namespace) -> Report:
    """Plan the pass and, with ``--apply``, carry it out; the report says what went (or would go)."""
    retention, tracking = load_sections(args.params, args.set)
    project = project_root()
    client, uri, experiments = open_store(tracking)
    plan = plan_mlflow(client, experiments, retention) if experiments else MlflowPlan()
    stale = stale_checkpoints(checkpoint_roots(project, _checkpoint_dirs(args.params)), retention)
    dvc = plan_dvc(project, retention, kept_commits(plan), plan.protected_md5s)
    if args.apply:
        if plan.runs or plan.versions or plan.logged_models:
            apply_mlflow(client, uri, plan)
        stale = remove_checkpoints(stale) if stale else []
        cache, remote = apply_dvc(project, retention, dvc, plan.protected_md5s)
        dvc.cache, dvc.remote = dvc.cache[:cache], dvc.remote[:remote]
    return Report(applied=args.apply, kept_runs=len(plan.kept_runs),
                  runs=[{"run_id": r.run_id, "name": r.name, "start_ms": r.start_ms} for r in plan.runs],
                  versions=[f"{name}/{number}" for name, number in plan.versions], logged_models=plan.logged_models,
                  checkpoints=[str(p.relative_to(project)) if p.is_relative_to(project) else str(p) for p in stale],
                  dvc_cache=dvc.cache, dvc_remote=dvc.remote, kept_reasons=plan.kept,
                  kept_commits=len(dvc.commits), missing_commits=dvc.missing_commits,
                  dvc_skipped=dvc.skipped)


def render(report: Report, listing: bool) -> str:
    """The report as text: one line of counts, the kept flow runs' reasons, and with ``listing`` every item."""
    verb = "deleted" if report.applied else "would delete"
    counts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in report.counts().items())
    lines = [f"alignflow gc: {verb} {counts}",
             f"kept: {report.kept_runs} runs in {len(report.kept_reasons)} flow runs, objects of "
             f"{report.kept_commits} commits"]
    if report.missing_commits:
        lines.append(f"kept runs name commits this repository lacks (their DVC objects are kept by md5 only): "
                     f"{', '.join(c[:12] for c in report.missing_commits)}")
    if report.dvc_skipped:
        lines.append(f"DVC objects left alone: {report.dvc_skipped}")
    if listing:
        lines += [f"  keep flow run {root}: {why}" for root, why in report.kept_reasons.items()]
        lines += [f"  run {r['run_id']} {r['name']}" for r in report.runs]
        lines += [f"  version {v}" for v in report.versions] + [f"  logged model {m}" for m in report.logged_models]
        lines += [f"  checkpoint {c}" for c in report.checkpoints]
        lines += [f"  dvc cache {h}" for h in report.dvc_cache] + [f"  dvc remote {h}" for h in report.dvc_remote]
    if not report.applied and any(report.counts().values()):
        lines.append("dry run: nothing deleted; rerun with --apply to delete")
    return "\n".join(lines)


def collect_locked(args: argparse.Namespace) -> Report | None:
    """:func:`collect` under the project's flow lock when it deletes; None when a flow holds the lock."""
    if not args.apply:
        return collect(args)
    from filelock import FileLock, Timeout  # lazy: filelock (only --apply takes the lock)

    flow_lock_path().parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(flow_lock_path()))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    try:
        return collect(args)
    finally:
        lock.release()


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in raw
    args = build_parser().parse_args([a for a in raw if a != "--debug"])
    setup_logging(debug)
    try:
        report = collect_locked(args)
    except Exception as exc:  # noqa: BLE001 - the project's own errors become one message; others propagate
        code = errors.report(exc, debug)
        if code is None:
            raise
        return code
    if report is None:
        print(f"alignflow gc: a flow of this project is running (it holds {flow_lock_path()}); run gc --apply "
              "after it ends", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"applied": report.applied, "counts": report.counts(), **report.__dict__}, indent=2))
    else:
        print(render(report, args.list))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
