"""Reproduce a run from its commit: rerun it with the recorded params and data, then compare.

``alignflow reproduce RUN_ID`` (an MLflow run of ``align``, ``iterative_dpo`` or ``raft``):
checks out the run's recorded git commit into a temporary worktree, puts there the exact data
the run read, by its recorded md5s (from the commit, the DVC cache or the DVC remote; never the
working copy: :mod:`flows.reproduce_inputs`), reruns the same flow with the params the run
logged (its ``reproduce.json`` artifact) and every cache bypassed (``flow.use_cache: false``:
each Prefect task executes, none is ``Cached``), and compares weights, metrics, data md5s and
metadata, each on its own (:mod:`flows.reproduce_compare`).

The rerun changes nothing that others rely on: it registers no model version and moves no alias
(``tracking.log_model: false``, checked by reading the registry before and after), commits and
pushes nothing, and records its result as tags: ``alignflow.reproduced_by`` (the rerun's run id)
and ``alignflow.reproduction`` (the verdict) on the original run, ``alignflow.reproduces`` on the
rerun, whose ``reproduction.json`` artifact holds the whole comparison.

``alignflow reproduce GIT_REV`` (a commit with a ``dvc.lock``): checks the revision out into
a worktree, fetches its DVC data from the remote where present, runs ``dvc repro --force``
(no run cache), and compares every output md5 and metrics file with the ones committed.

The last line printed is the verdict, ``IDENTICAL`` or ``DIFFERENT: <first differences>``; the
exit status is 0 or 1. A run whose ``git.commit`` ends in ``-dirty`` had uncommitted code: it is
rerun from the commit, with a warning that the code may differ. A run whose ``alignflow.version``
tag is not the installed alignflow's version is rerun with the installed one (a project made by
``alignflow init`` holds no alignflow code in its commits), with a warning too.

Nothing read from the tracking store is trusted: the commit must be a hex sha of this repository
(every git command gets ``--`` or ``--end-of-options`` before a revision), and the stored params
are reviewed against the commit's own before anything runs (:mod:`flows.reproduce_trust`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from flows.reproduce_compare import (
    Comparison,
    Roots,
    Views,
    cache_view,
    compare_md5s,
    compare_metrics,
    compare_registry,
    disk_view,
    flatten,
    render,
    report_fields,
)
from flows.reproduce_inputs import RecordedInput, place_inputs, recorded_inputs
from flows.reproduce_trust import ConfigReview, enforce, local_store, review_config, strings_in
from rlhf_core.config import TrackingConfig, load_config
from rlhf_core.tracking.lineage import HashCache, dvc_md5, package_version, project_relative
from rlhf_core.common.redact import redact_secrets
from rlhf_core.tracking.mlflow_runs import resolve_tracking_uri

RUN_ID = re.compile(r"^[0-9a-f]{32}$")
HEX_SHA = re.compile(r"^[0-9a-f]{7,64}$")  # sha-1 or sha-256, possibly abbreviated
FLOWS = ("align", "iterative_dpo", "raft")
CYCLE_FLOWS = ("iterative_dpo", "raft")


def _git(*args: str, cwd: str | Path = ".") -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"reproduce: git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def resolve_commit(rev: str, what: str = "revision") -> str:
    """The full sha of ``rev``, which must name a commit of this repository. ``--end-of-options``
    keeps a revision such as ``--output=x`` a revision: git never reads it as an option."""
    proc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
                          capture_output=True, text=True)
    sha = proc.stdout.strip()
    if proc.returncode != 0 or not HEX_SHA.match(sha):
        raise SystemExit(f"reproduce: {what} {rev!r} is not a commit of this repository")
    return sha


def add_worktree(worktree: Path, commit: str) -> None:
    """``git worktree add --detach -- <path> <commit>``: ``--`` ends the options before both."""
    _git("worktree", "add", "--detach", "--", str(worktree), commit)


def remove_worktree(worktree: Path) -> None:
    _git("worktree", "remove", "--force", "--", str(worktree))


def dvc_cache_folder(project: Path) -> Path | None:
    """The project's DVC cache folder (its config's ``cache.dir``, ``.dvc/cache`` by default), or None
    when the project has no DVC."""
    if not (project / ".dvc").is_dir():
        return None
    # relative paths resolved against the project's `.dvc/`
    from dvc.config import Config  # lazy: dvc (light `reproduce --help`)

    configured = Config(dvc_dir=str(project / ".dvc"))["cache"].get("dir")
    return Path(configured).resolve() if configured else (project / ".dvc" / "cache").resolve()


def share_dvc_storage(worktree: Path, project: Path, env: dict[str, str]) -> None:
    """Point the worktree's DVC at the project's cache and, by absolute path, at its remotes.

    A git worktree holds no ``.dvc/cache`` (untracked), no ``.dvc/config.local`` (this machine's settings, where
    the team profile names its object-store remote) and a remote given relative to ``.dvc/`` (the scaffold's
    ``../.dvc-remote``) resolves inside the worktree, where nothing was pushed: without this, data a user
    ``dvc add``-ed could not be pulled into the rerun. The project's ``config.local`` is copied, then the cache and
    the relative remotes are pinned in the worktree's (which git ignores); the commit's files are untouched.
    """
    dvc = [sys.executable, "-P", "-m", "dvc"]
    local = project / ".dvc" / "config.local"
    if local.is_file() and (worktree / ".dvc").is_dir():
        shutil.copy2(local, worktree / ".dvc" / "config.local")

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([*dvc, *args], cwd=cwd, env=env, capture_output=True, text=True)

    # DVC's own reading: relative paths resolved against the project's `.dvc/`
    from dvc.config import Config  # lazy: dvc (light `reproduce --help`)

    cache = dvc_cache_folder(project)
    if cache is not None:
        run("cache", "dir", "--local", str(cache), cwd=worktree)
    for name, remote in Config(dvc_dir=str(project / ".dvc"))["remote"].items():
        url = str(remote.get("url", ""))
        if url and "://" not in url and Path(url).is_absolute():  # paths, not URLs, are the ones to pin
            run("remote", "modify", "--local", name, "url", url, cwd=worktree)


def _env_for(worktree: Path, tracking_uri: str | None) -> dict[str, str]:
    """The rerun's environment: same MLflow store; in a commit of alignflow's own checkout, that
    commit's code first on the path. A project of the user's own (``alignflow init``) holds no
    alignflow source: it reruns with the installed alignflow, and its own folders (a ``tasks/``
    or ``flows/`` of theirs) must not shadow alignflow's packages, so nothing is prepended."""
    env = dict(os.environ)
    if (worktree / "rlhf_core" / "__init__.py").is_file():
        env["PYTHONPATH"] = f"{worktree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["ALIGNFLOW_HOME"] = str(worktree)
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


def commit_config(worktree: Path) -> dict[str, dict[str, Any]]:
    """Every section of the commit's own ``params.yaml`` with the commit's defaults filled in, read
    by the commit's own config code (a field added since then is not a difference)."""
    script = ("import json; from rlhf_core.config import SECTIONS, config_to_dict, load_config; "
              "print(json.dumps({s: config_to_dict(load_config(c, s, 'params.yaml')) for s, c in SECTIONS.items()}))")
    proc = subprocess.run([sys.executable, "-P", "-c", script], cwd=worktree, env=_env_for(worktree, None),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"reproduce: cannot read the commit's params.yaml:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------
# From an MLflow run
# --------------------------------------------------------------------------------------


def stored_commit(run_id: str, tags: dict[str, str]) -> tuple[str, list[str]]:
    """The full sha of the run's ``git.commit`` tag (a hex sha of this repository, nothing else),
    and a warning when the run's code was dirty."""
    tag = tags.get("git.commit", "unknown")
    if tag == "unknown":
        raise SystemExit(f"reproduce: run {run_id} has no git.commit tag (it ran outside a git repository)")
    sha = tag.removesuffix("-dirty")
    if not HEX_SHA.match(sha):
        raise SystemExit(f"reproduce: run {run_id}: git.commit tag {tag!r} is not a commit sha (hex digits); "
                         "refusing to pass it to git")
    warnings = [f"run {run_id} ran with uncommitted changes; rerunning from {sha}, code may differ"] \
        if sha != tag else []
    if tags.get("git.untracked"):
        warnings.append(f"run {run_id} ran beside files its commit does not hold ({tags['git.untracked']}); "
                        "the rerun from its commit does not have them")
    return resolve_commit(sha, f"run {run_id}'s git.commit"), warnings


def version_warning(run_id: str, tags: dict[str, str]) -> list[str]:
    """A warning when the run's ``alignflow.version`` tag is not the installed alignflow's version:
    the rerun trains with the installed one (a project's commit holds no alignflow code)."""
    recorded, installed = tags.get("alignflow.version"), package_version()
    if recorded is None or recorded == installed:
        return []
    return [(f"run {run_id} ran with alignflow {recorded}; the installed alignflow is {installed}: "
             "the rerun uses the installed one, so results may differ")]


def load_recorded(path: Path) -> tuple[str, dict[str, dict[str, Any]], dict[str, Any]]:
    """``(flow, params, inputs)`` of a ``reproduce.json``, its shape checked."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"reproduce: {path.name}: cannot read it as JSON: {exc}") from None
    if not isinstance(recorded, dict):
        raise SystemExit(f"reproduce: {path.name}: expected a JSON object, got {type(recorded).__name__}")
    flow, params, inputs = recorded.get("flow"), recorded.get("params"), recorded.get("inputs") or {}
    if flow not in FLOWS:
        raise SystemExit(f"reproduce: {path.name}: flow: {flow!r} is not one of {', '.join(FLOWS)}")
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise SystemExit(f"reproduce: {path.name}: params: expected a mapping of sections to mappings")
    if not isinstance(inputs, dict):
        raise SystemExit(f"reproduce: {path.name}: inputs: expected a mapping, got {type(inputs).__name__}")
    return flow, params, inputs


def flow_command(flow: str, inputs: list[RecordedInput], cycles: Any, workdir: Path) -> list[str]:
    """The ``alignflow flow`` command line of the rerun. Each input goes as ``--flag=path`` (a path can never
    read as an option) with the path the run recorded: project-relative ones are read in the worktree."""
    # -P: the worktree (the working directory) is not put on sys.path; alignflow's code comes from
    # PYTHONPATH (its own checkout, _env_for) or the installed package.
    cmd = [sys.executable, "-P", "-m", "flows.cli", "flow", flow, "--params", "reproduce_params.yaml",
           f"--summary={workdir / 'summary.json'}"]
    cmd += [f"{inp.flag}={inp.path}" for inp in inputs if inp.flag]
    if flow != "align" and cycles:
        if not isinstance(cycles, int) or isinstance(cycles, bool) or cycles < 1:
            raise SystemExit(f"reproduce: reproduce.json: inputs.cycles: expected an integer >= 1, got {cycles!r}")
        cmd += ["--cycles", str(cycles)]
    return cmd


def check_params(params: dict[str, Any], worktree: Path, commit: str, trust: bool,
                 store_is_local: bool) -> ConfigReview:
    """Print how the stored params differ from the commit's (always), then refuse what ``enforce`` refuses."""
    review = review_config(params, commit_config(worktree), worktree, store_is_local)
    if review.differences:
        print(f"config: reproduce.json (stored) vs params.yaml at {commit[:12]} (commit), "
              f"{len(review.differences)} difference(s):")
        for line in review.differences:
            print(f"  {line}")
    else:
        print(f"config: reproduce.json equals params.yaml at {commit[:12]} (with its defaults)")
    sys.stdout.flush()  # the difference is on screen before any refusal on stderr
    enforce(review, trust, worktree)
    return review


def rerun_params(flow: str, params: dict[str, Any]) -> dict[str, Any]:
    """The stored params plus what makes a rerun one: every task executes (no Prefect cache hit), no model
    is logged or registered (no registry version, no alias moved) and, in an iterative flow, no data is
    committed or pushed. None of these settings reaches a model folder or a metric."""
    params = json.loads(json.dumps(params))
    params.setdefault("flow", {})["use_cache"] = False
    params.setdefault("tracking", {})["log_model"] = False
    if flow in CYCLE_FLOWS:
        params.setdefault("cycles", {})["version"] = False
    return params


def rerun_flow(flow: str, params: dict[str, Any], inputs: list[RecordedInput], cycles: Any, worktree: Path,
               workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run the flow in the worktree; returns its summary."""
    (worktree / "reproduce_params.yaml").write_text(yaml.safe_dump(rerun_params(flow, params), sort_keys=False))
    proc = subprocess.run(flow_command(flow, inputs, cycles, workdir), cwd=worktree, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"reproduce: the rerun failed (exit {proc.returncode}):\n"
                         f"{redact_secrets(proc.stderr[-4000:])}")
    return json.loads((workdir / "summary.json").read_text())


def dvc_fetcher(worktree: Path, project: Path, env: dict[str, str]) -> Callable[[str], None]:
    """``dvc fetch PATH`` at the commit, into the project's cache from its remotes; the worktree's DVC is
    pointed at them on first use. Best effort: a path that no ``.dvc`` file or ``dvc.lock`` names is not fetched."""

    @functools.cache
    def shared() -> None:
        share_dvc_storage(worktree, project, env)

    def fetch(path: str) -> None:
        shared()
        subprocess.run([sys.executable, "-P", "-m", "dvc", "fetch", "--quiet", "--", path], cwd=worktree, env=env,
                       capture_output=True, text=True)

    return fetch


# --------------------------------------------------------------------------------------
# What is compared: gathered from both runs, the worktree, the project and its DVC cache
# --------------------------------------------------------------------------------------

VERSIONED = "dvc.md5.versioned."
"""An iterative flow's cycle run tags the data it versions; a rerun versions nothing (``cycles.version: false``),
so those tags are compared only where the rerun has them too."""


def md5_tags(client: Any, run: Any) -> dict[str, str]:
    """The run's ``dvc.md5.*`` tags and, for an iterative flow, each cycle run's as ``cycle_<k>/dvc.md5.*``."""
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("dvc.md5.")}
    if run.data.tags.get("alignflow.flow") in CYCLE_FLOWS:
        children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
        for child in children:
            cycle = child.data.tags.get("alignflow.cycle")
            if cycle:
                tags.update({f"cycle_{cycle}/{k}": v for k, v in child.data.tags.items() if k.startswith("dvc.md5.")})
    return tags


def metric_histories(client: Any, run: Any) -> dict[str, list[list[float]]]:
    """Every metric of the run as its logged ``[step, value]`` pairs."""
    return {key: sorted([m.step, m.value] for m in client.get_metric_history(run.info.run_id, key))
            for key in sorted(run.data.metrics)}


def rerun_paths(summary: dict[str, Any], params: dict[str, Any], worktree: Path) -> list[str]:
    """Every path the rerun's summary names (its models among them), and the built base model's folder,
    as worktree-relative paths: where a rerun's model folder is found by its md5."""
    strings = strings_in(summary) + [str((params.get("model") or {}).get("out_dir") or "")]
    return sorted({project_relative(s, worktree) for s in strings
                   if s and len(s) < 4096 and "\0" not in s and "://" not in s})


def folder_views(project: Path, worktree: Path, cache_folder: Path | None, candidates: list[str]) -> Views:
    """Where a differing model folder's files are read: the rerun's in the worktree (found by md5 among
    ``candidates``), the original's in the project when it still holds that md5, else in the DVC cache."""
    rerun_hashes = HashCache(worktree / ".alignflow" / "hash-cache.json")  # the rerun's own: big files hashed once
    cache_root = cache_folder / "files" / "md5" if cache_folder is not None else None

    @functools.cache
    def located() -> dict[str, str]:
        return {dvc_md5(worktree / rel, rerun_hashes): rel for rel in reversed(candidates)
                if rel != "." and not os.path.isabs(rel) and (worktree / rel).is_dir()}

    def views(tag: str, original_md5: str, rerun_md5: str) -> tuple[Any, Any]:
        rel = located().get(rerun_md5)
        if rel is None:
            return None, None
        here = project / rel
        if here.is_dir() and dvc_md5(here) == original_md5:
            original = disk_view(here)
        else:
            original = cache_view(cache_root, original_md5) if cache_root is not None else None
        return original, disk_view(worktree / rel, rerun_hashes)

    return views


def compare_runs(client: Any, run: Any, rerun: Any, views: Views, roots: Roots) -> tuple[Comparison, dict[str, Any]]:
    """Weights, data and metadata (the ``dvc.md5.*`` tags), and metrics of the two runs; also returns what was read."""
    md5 = {"original": md5_tags(client, run), "rerun": md5_tags(client, rerun)}
    original = {k: v for k, v in md5["original"].items() if VERSIONED not in k or k in md5["rerun"]}
    comparison = compare_md5s(original, md5["rerun"], views, roots)
    comparison.add(compare_metrics(metric_histories(client, run), metric_histories(client, rerun)))
    return comparison, md5


def registry_state(client: Any, params: dict[str, Any]) -> dict[str, Any]:
    """Versions and aliases of every registered model the stored params name: all a rerun could touch."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow (light `reproduce --help`)

    names = {str((params.get(section) or {}).get("registered_model") or "") for section in ("tracking", "cycles")}
    state: dict[str, Any] = {}
    for name in sorted(names - {""}):
        try:
            aliases = {k: str(v) for k, v in sorted(client.get_registered_model(name).aliases.items())}
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            state[name] = "<not registered>"
            continue
        quoted = name.replace("'", "\\'")
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{quoted}'"))
        state[name] = {"versions": versions, "aliases": aliases}
    return state


def record_result(client: Any, run_id: str, rerun_id: str, result: dict[str, Any]) -> None:
    """The verdict as tags on both runs, each naming the other; the whole comparison as the rerun's
    ``reproduction.json`` artifact."""
    verdict = result["verdict"][:5000]
    client.set_tag(run_id, "alignflow.reproduced_by", rerun_id)
    client.set_tag(run_id, "alignflow.reproduction", verdict)
    client.set_tag(rerun_id, "alignflow.reproduces", run_id)
    client.set_tag(rerun_id, "alignflow.reproduction", verdict)
    client.log_dict(rerun_id, json.loads(json.dumps(result, default=str)), "reproduction.json")


def reproduce_run(run_id: str, tracking_uri: str, workdir: Path, trust: bool = False) -> dict[str, Any]:
    """Rerun the flow run ``run_id`` from its commit and data, compare, record the result; returns the report."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow (light `reproduce --help`)

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    commit, warnings = stored_commit(run_id, run.data.tags)
    warnings += version_warning(run_id, run.data.tags)
    flow, params, stored = load_recorded(Path(client.download_artifacts(run_id, "reproduce.json", str(workdir))))
    project, worktree = Path.cwd(), workdir / "worktree"
    inputs = recorded_inputs(flow, stored, run.data.tags, project)
    registry_before = registry_state(client, params)
    cache_folder = dvc_cache_folder(project)
    add_worktree(worktree, commit)
    try:
        review = check_params(params, worktree, commit, trust, local_store(tracking_uri, project))
        env = _env_for(worktree, tracking_uri)
        sources = place_inputs(inputs, worktree, commit, cache_folder / "files" / "md5" if cache_folder else None,
                               dvc_fetcher(worktree, project, env))
        for inp in inputs:
            print(f"  input {inp.name}: {inp.path}  md5 {inp.md5 or '-'}  from {sources[inp.name]}")
        sys.stdout.flush()
        summary = rerun_flow(flow, params, inputs, stored.get("cycles"), worktree, workdir, env)
        rerun = client.get_run(summary["parent_run_id"])
        views = folder_views(project, worktree, cache_folder, rerun_paths(summary, params, worktree))
        comparison, md5 = compare_runs(client, run, rerun, views, Roots(project, worktree))
    finally:
        remove_worktree(worktree)
    registry = {"before": registry_before, "after": registry_state(client, params)}
    comparison.add(compare_registry(registry["before"], registry["after"]))
    result = {"target": run_id, "commit": commit, "flow": flow, "rerun_id": rerun.info.run_id,
              "inputs": {i.name: {"path": i.path, "md5": i.md5, "from": sources[i.name]} for i in inputs},
              "metrics": {"original": run.data.metrics, "rerun": rerun.data.metrics}, "md5": md5,
              "task_states": task_states(rerun.data.tags.get("prefect.flow_run_id", "")),
              "config_differences": review.differences, "registry": registry, "warnings": warnings,
              **report_fields(comparison)}
    record_result(client, run_id, rerun.info.run_id, result)
    return result


def task_states(flow_run_id: str) -> dict[str, int]:
    """How many of the flow run's task runs ended in each state (``Cached`` would be a cache hit)."""
    if not flow_run_id:
        return {}

    from prefect.client.orchestration import get_client  # lazy: prefect (light `reproduce --help`)
    from prefect.client.schemas.filters import (  # lazy: prefect (light `reproduce --help`)
        FlowRunFilter, FlowRunFilterId)

    async def fetch() -> dict[str, int]:
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        counts: dict[str, int] = {}
        for tr in runs:
            name = tr.state.name if tr.state else "unknown"
            counts[name] = counts.get(name, 0) + 1
        return counts

    try:
        return asyncio.run(fetch())
    except Exception as exc:  # noqa: BLE001 - the ephemeral server of the rerun may be gone
        return {f"unavailable ({type(exc).__name__})": 0}


# --------------------------------------------------------------------------------------
# From a git revision (the DVC pipeline)
# --------------------------------------------------------------------------------------


def _lock_outs(lock_text: str) -> dict[str, str]:
    lock = yaml.safe_load(lock_text) or {}
    return {f"{stage}:{o['path']}": o["md5"] for stage, body in lock.get("stages", {}).items()
            for o in body.get("outs", [])}


def lock_views(project: Path, worktree: Path, cache_folder: Path | None) -> Views:
    """A ``dvc.lock`` output folder's files (key ``stage:path``): the rerun's in the worktree; the committed
    one in the project when it still holds that md5, else in the DVC cache."""
    cache_root = cache_folder / "files" / "md5" if cache_folder is not None else None

    def views(key: str, original_md5: str, rerun_md5: str) -> tuple[Any, Any]:
        rel = key.split(":", 1)[1]
        if not (worktree / rel).is_dir():
            return None, None
        here = project / rel
        if here.is_dir() and dvc_md5(here) == original_md5:
            original = disk_view(here)
        else:
            original = cache_view(cache_root, original_md5) if cache_root is not None else None
        return original, disk_view(worktree / rel, False)

    return views


def repro_in(worktree: Path, project: Path) -> str:
    """``dvc repro --force --no-run-cache`` in the worktree, its data pulled first (best effort); its new lock."""
    env = _env_for(worktree, None)
    dvc = [sys.executable, "-P", "-m", "dvc"]
    share_dvc_storage(worktree, project, env)
    subprocess.run([*dvc, "pull", "--quiet"], cwd=worktree, env=env, capture_output=True)  # best effort
    proc = subprocess.run([*dvc, "repro", "--force", "--no-run-cache"], cwd=worktree, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"reproduce: dvc repro failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return (worktree / "dvc.lock").read_text()


def metric_files(worktree: Path, commit: str) -> dict[str, list[Any]]:
    """``{"metrics/x.json:key": [committed value, rerun value]}`` for each metrics file both sides have."""
    out: dict[str, list[Any]] = {}
    for path in sorted((worktree / "metrics").glob("*.json")):
        rel = f"metrics/{path.name}"
        try:
            original = json.loads(_git("show", "--end-of-options", f"{commit}:{rel}"))
        except SystemExit:
            continue
        a, b = flatten(original), flatten(json.loads(path.read_text()))
        out.update({f"{rel}:{k}": [a.get(k, "<absent>"), b.get(k, "<absent>")] for k in sorted(set(a) | set(b))})
    return out


def reproduce_rev(rev: str, workdir: Path) -> dict[str, Any]:
    """Rerun the DVC pipeline at ``rev`` with no cache; compare its outputs and metrics files with the commit's."""
    commit = resolve_commit(rev)
    committed_lock = _git("show", "--end-of-options", f"{commit}:dvc.lock")
    project, worktree = Path.cwd(), workdir / "worktree"
    add_worktree(worktree, commit)
    try:
        rerun_lock = repro_in(worktree, project)
        md5 = {"original": _lock_outs(committed_lock), "rerun": _lock_outs(rerun_lock)}
        views = lock_views(project, worktree, dvc_cache_folder(project))
        comparison = compare_md5s(md5["original"], md5["rerun"], views, Roots(project, worktree))
        metrics = metric_files(worktree, commit)
    finally:
        remove_worktree(worktree)
    comparison.add(compare_metrics({k: v[0] for k, v in metrics.items()}, {k: v[1] for k, v in metrics.items()}))
    return {"target": rev, "commit": commit, "flow": "dvc repro", "md5": md5,
            "metrics": {k: {"original": a, "rerun": b} for k, (a, b) in metrics.items()}, "warnings": [],
            **report_fields(comparison)}


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alignflow reproduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="an MLflow run id (32 hex digits) or a git revision "
                                        "(one starting with '-' goes after '--')")
    parser.add_argument("--params", default="params.yaml", help="params file naming the tracking store")
    parser.add_argument("--report", default=None, help="write the comparison as JSON here")
    parser.add_argument("--trust", action="store_true",
                        help="run id: accept stored params that differ from the commit's params.yaml in code "
                             "(file.py:fn), output paths, URLs, secret names or tracking settings (the difference "
                             "is printed either way); output paths outside the worktree stay refused. Plain "
                             "experiment and registered-model names need no --trust when the store is a SQLite "
                             "file inside the project")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a report, not download bars

    workdir = Path(tempfile.mkdtemp(prefix="alignflow-reproduce-"))
    try:
        if RUN_ID.match(args.target):
            tracking = load_config(TrackingConfig, "tracking", args.params if Path(args.params).exists() else None)
            result = reproduce_run(args.target, resolve_tracking_uri(tracking), workdir, trust=args.trust)
        else:
            result = reproduce_rev(args.target, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.report:
        Path(args.report).write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    print(render(result))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
