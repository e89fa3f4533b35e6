"""Reproduce a run from a commit: rerun every stage with the recorded params, then compare.

``alignflow reproduce RUN_ID`` (an MLflow run of ``align``, ``iterative_dpo`` or ``raft``):
checks out the run's recorded git commit into a temporary worktree, reruns the same flow
there with the exact params and inputs the run logged (its ``reproduce.json`` artifact) and
every cache bypassed (``flow.use_cache: false``: each Prefect task executes, none is
``Cached``), records the rerun in the same MLflow store (tag ``alignflow.reproduces``), and
compares the final metrics and every ``dvc.md5.*`` tag of the two parent runs.

``alignflow reproduce GIT_REV`` (a commit with a ``dvc.lock``): checks the revision out into
a worktree, fetches its DVC data from the remote where present, runs ``dvc repro --force``
(no run cache), and compares every output md5 and metrics file with the ones committed.

Prints each difference; exits 0 when everything is identical, 1 otherwise. A run whose
``git.commit`` ends in ``-dirty`` had uncommitted code: it is rerun from the commit, with a
warning that the code may differ.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import yaml

RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def _git(*args: str, cwd: str | Path = ".") -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"reproduce: git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _env_for(worktree: Path, tracking_uri: str | None) -> dict[str, str]:
    """The worktree's own code first on the path (not the installed checkout), same MLflow store."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{worktree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["ALIGNFLOW_HOME"] = str(worktree)
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


def compare(before: dict[str, Any], after: dict[str, Any], what: str) -> list[str]:
    """Lines naming every key whose value differs (or exists on one side only)."""
    out = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key, "<absent>"), after.get(key, "<absent>")
        if a != b:
            out.append(f"{what} {key}: {a} (original) != {b} (rerun)")
    return out


# --------------------------------------------------------------------------------------
# From an MLflow run
# --------------------------------------------------------------------------------------


def reproduce_run(run_id: str, tracking_uri: str, workdir: Path) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    commit = run.data.tags.get("git.commit", "unknown")
    if commit == "unknown":
        raise SystemExit(f"reproduce: run {run_id} has no git.commit tag (it ran outside a git repository)")
    warnings = []
    if commit.endswith("-dirty"):
        commit = commit.removesuffix("-dirty")
        warnings.append(f"run {run_id} ran with uncommitted changes; rerunning from {commit}, code may differ")
    recorded = json.loads(Path(client.download_artifacts(run_id, "reproduce.json", str(workdir))).read_text())
    flow = recorded["flow"]

    worktree = workdir / "worktree"
    _git("worktree", "add", "--detach", str(worktree), commit)
    try:
        params = recorded["params"]
        params["flow"]["use_cache"] = False  # every task executes: no Prefect cache hits
        if flow != "align":
            params["cycles"]["version"] = False  # a rerun must not commit or push data again
        (worktree / "reproduce_params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        cmd = [sys.executable, "-m", "flows.cli", "flow", flow, "--params", "reproduce_params.yaml",
               "--summary", str(workdir / "summary.json")]
        inputs = recorded.get("inputs", {})
        for name, flag in (("sft_file", "--sft-file"), ("preference_file", "--preference-file"),
                           ("prompts_file", "--prompts-file"), ("eval_file", "--eval-file"),
                           ("base_model", "--base-model")):
            if inputs.get(name):
                cmd += [flag, str(Path(inputs[name]).resolve())]
        if flow != "align" and inputs.get("cycles"):
            cmd += ["--cycles", str(inputs["cycles"])]
        env = {**_env_for(worktree, tracking_uri), "ALIGNFLOW_REPRODUCES": run_id}
        proc = subprocess.run(cmd, cwd=worktree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"reproduce: the rerun failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        summary = json.loads((workdir / "summary.json").read_text())
    finally:
        _git("worktree", "remove", "--force", str(worktree))

    rerun = client.get_run(summary["parent_run_id"])
    client.set_tag(rerun.info.run_id, "alignflow.reproduces", run_id)
    md5 = lambda r: {k: v for k, v in r.data.tags.items() if k.startswith("dvc.md5.")}  # noqa: E731
    differences = compare(run.data.metrics, rerun.data.metrics, "metric") + compare(md5(run), md5(rerun), "tag")
    states = task_states(rerun.data.tags.get("prefect.flow_run_id", ""))
    return {"target": run_id, "commit": commit, "flow": flow, "rerun_id": rerun.info.run_id,
            "metrics": {"original": run.data.metrics, "rerun": rerun.data.metrics},
            "md5": {"original": md5(run), "rerun": md5(rerun)}, "task_states": states,
            "differences": differences, "warnings": warnings, "identical": not differences}


def task_states(flow_run_id: str) -> dict[str, int]:
    """How many of the flow run's task runs ended in each state (``Cached`` would be a cache hit)."""
    if not flow_run_id:
        return {}
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

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


def reproduce_rev(rev: str, workdir: Path) -> dict[str, Any]:
    commit = _git("rev-parse", rev)
    committed_lock = _git("show", f"{commit}:dvc.lock")
    worktree = workdir / "worktree"
    _git("worktree", "add", "--detach", str(worktree), commit)
    try:
        env = _env_for(worktree, None)
        dvc = [sys.executable, "-m", "dvc"]
        subprocess.run([*dvc, "pull", "--quiet"], cwd=worktree, env=env, capture_output=True)  # best effort
        proc = subprocess.run([*dvc, "repro", "--force", "--no-run-cache"], cwd=worktree, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"reproduce: dvc repro failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rerun_lock = (worktree / "dvc.lock").read_text()
        metrics = {}
        for path in sorted((worktree / "metrics").glob("*.json")):
            rel = f"metrics/{path.name}"
            try:
                original = json.loads(_git("show", f"{commit}:{rel}"))
            except SystemExit:
                continue
            metrics[rel] = (original, json.loads(path.read_text()))
    finally:
        _git("worktree", "remove", "--force", str(worktree))
    differences = compare(_lock_outs(committed_lock), _lock_outs(rerun_lock), "output md5")
    for rel, (a, b) in metrics.items():
        differences += compare(a, b, f"metric {rel}")
    return {"target": rev, "commit": commit, "flow": "dvc repro", "md5": {"original": _lock_outs(committed_lock),
            "rerun": _lock_outs(rerun_lock)}, "metrics": {k: {"original": a, "rerun": b} for k, (a, b) in metrics.items()},
            "differences": differences, "warnings": [], "identical": not differences}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alignflow reproduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="an MLflow run id (32 hex digits) or a git revision")
    parser.add_argument("--params", default="params.yaml", help="params file naming the tracking store")
    parser.add_argument("--report", default=None, help="write the comparison as JSON here")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="alignflow-reproduce-"))
    try:
        if RUN_ID.match(args.target):
            from rlhf_core.config import TrackingConfig, load_config
            from rlhf_core.tracking import resolve_tracking_uri

            tracking = load_config(TrackingConfig, "tracking", args.params if Path(args.params).exists() else None)
            result = reproduce_run(args.target, resolve_tracking_uri(tracking), workdir)
        else:
            result = reproduce_rev(args.target, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for w in result["warnings"]:
        print(f"warning: {w}")
    print(f"reproduce {result['target']} ({result['flow']} at {result['commit'][:12]}):")
    if result.get("task_states"):
        print("  rerun task states: " + ", ".join(f"{k} {v}" for k, v in sorted(result["task_states"].items())))
    for side in ("original", "rerun"):
        shown = {k: v for k, v in sorted(result["md5"][side].items())}
        print(f"  {side:<8} md5: " + "; ".join(f"{k}={v}" for k, v in shown.items()))
    if result["identical"]:
        n_metrics = len(result["metrics"]["original"]) if "original" in result["metrics"] else len(result["metrics"])
        print(f"  identical: {len(result['md5']['original'])} md5s and {n_metrics} metric sets/values match")
    for line in result["differences"]:
        print(f"  DIFFERENT {line}")
    if args.report:
        Path(args.report).write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
