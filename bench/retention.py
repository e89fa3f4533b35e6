"""What a month of nightly align flows of the embedded default stores, without and with ``alignflow gc``.

Two parts, both recorded in the result file:

* **measured**: one real ``alignflow flow align`` of the embedded default (the shipped params.yaml, the default
  sqlite store and artifact folder) in a fresh copy of the repository's HEAD under the scratch folder: its wall time,
  the bytes of ``mlflow.db``, ``mlartifacts``, ``checkpoints`` and the DVC cache, and its MLflow runs.
* **simulated**: 30 nights built from that flow's own store. Each night copies the measured flow's runs (tags,
  params, every metric point, every artifact file; registered versions with their logged models) into one store,
  dated a day apart, as a nightly run on new data would log them (the align flow reruns every stage when its
  inputs change; on unchanged inputs Prefect's cache would skip most of them). One store gets no gc; the other
  gets a real ``alignflow gc --apply`` after every night with the default ``retention`` (keep_runs 10, keep_days
  7). The champion alias points at the first night's version, so its lineage is kept all month, as a champion
  that is never beaten would be. The align flow versions nothing with DVC (the cycle flows do), so its DVC
  cache does not grow night to night; the measured part records it.

    .venv/bin/python bench/retention.py                  # ~15-30 minutes on 2 cores (one align flow, 30 nights)
    .venv/bin/python bench/retention.py --nights 5 --out /tmp/retention_small.json

Writes ``bench/results/cpu/<UTC date>/retention_month_cpu.json``; the scratch folder (default /tmp/gcbench) is
deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(1, str(REPO))

import rlhf_core  # noqa: E402,F401  (offline switches first: every tool's telemetry off)
from result_paths import result_path  # noqa: E402  (bench/ is sys.path[0])

MB = 1_000_000


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def project_env(project: Path, scratch: Path) -> dict[str, str]:
    """The environment a user's shell has in ``project``: the venv first, the project's home, its own Prefect home,
    no MLFLOW_TRACKING_URI (the default store at <project>/mlflow.db)."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", ALIGNFLOW_HOME=str(project),
               PREFECT_HOME=str(scratch / "prefect"), PYTHONPATH=str(project))
    return env


def fresh_copy(scratch: Path) -> Path:
    """HEAD's files in ``<scratch>/project``, a git repository with one commit."""
    project = scratch / "project"
    project.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(project)], input=archive, check=True)
    ident = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for args in (["init", "-q"], ["add", "-A"], [*ident, "commit", "-qm", "HEAD of the repository"]):
        subprocess.run(["git", *args], cwd=project, check=True, capture_output=True)
    return project


def store_sizes(project: Path) -> dict[str, float]:
    """MB of the store's database and artifacts, the checkpoints and the DVC cache."""
    db = project / "mlflow.db"
    return {"mlflow_db_mb": round(db.stat().st_size / MB, 2) if db.exists() else 0.0,
            "mlartifacts_mb": round(folder_bytes(project / "mlartifacts") / MB, 2),
            "checkpoints_mb": round(folder_bytes(project / "checkpoints") / MB, 2),
            "dvc_cache_mb": round(folder_bytes(project / ".dvc" / "cache") / MB, 2)}


def count_runs(uri: str) -> int:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return len(client.search_runs(experiments, max_results=50_000)) if experiments else 0


def measure_flow(scratch: Path) -> tuple[Path, dict[str, Any]]:
    """One real align flow of the embedded default in a fresh copy; its wall time and what it stored."""
    project = fresh_copy(scratch)
    cache_before = folder_bytes(project / ".dvc" / "cache")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "flow", "align"], cwd=project,
                          env=project_env(project, scratch), capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode:
        raise SystemExit(f"the align flow failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    measured = {"wall_s": round(wall, 1), "runs": count_runs(f"sqlite:///{project / 'mlflow.db'}"),
                **store_sizes(project),
                "dvc_cache_added_mb": round((folder_bytes(project / ".dvc" / "cache") - cache_before) / MB, 2)}
    return project, measured


# --------------------------------------------------------------------------------------
# Simulated nights: the measured flow's store, copied night after night
# --------------------------------------------------------------------------------------


def read_flow(uri: str) -> dict[str, Any]:
    """Everything the measured flow logged: its runs (tags, params, metric points, artifact folder), registered
    versions (with the logged model's artifact folder) and aliases."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = []
    for run in sorted(client.search_runs(experiments, max_results=50_000), key=lambda r: r.info.start_time):
        points = [m for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)]
        runs.append({"id": run.info.run_id, "name": run.info.run_name, "start": run.info.start_time,
                     "end": run.info.end_time or run.info.start_time, "status": run.info.status,
                     "tags": dict(run.data.tags), "params": dict(run.data.params), "metrics": points,
                     "artifacts": Path(run.info.artifact_uri.removeprefix("file://"))})
    versions = []
    for model in client.search_registered_models():
        for v in client.search_model_versions(f"name='{model.name}'"):
            logged = client.get_logged_model(v.source[len("models:/"):]) if v.source.startswith("models:/m-") else None
            versions.append({"name": v.name, "version": str(v.version), "run_id": v.run_id, "source": v.source,
                             "tags": dict(v.tags), "logged": logged and {
                                 "name": logged.name, "dir": Path(logged.artifact_location.removeprefix("file://"))}})
    aliases = {(m.name, a): str(v) for m in client.search_registered_models() for a, v in m.aliases.items()}
    return {"runs": runs, "versions": versions, "aliases": aliases, "start": runs[0]["start"] if runs else 0}


def _mapped_tags(tags: dict[str, str], ids: dict[str, str]) -> dict[str, str]:
    """Tags with every run id the flow's runs name (parent, alignflow.*_run_id) replaced by its copy's."""
    return {k: ids.get(v, v) for k, v in tags.items() if not k.startswith("mlflow.log-model")}


def copy_night(client: Any, exp: str, flow: dict[str, Any], shift_ms: int) -> dict[tuple[str, str], str]:
    """The measured flow's runs and versions again, ``shift_ms`` later; returns (name, old version) -> new."""
    from mlflow.entities import Metric, Param

    ids: dict[str, str] = {}
    for run in flow["runs"]:  # by start time: a parent before its stage runs
        new = client.create_run(exp, start_time=run["start"] + shift_ms, run_name=run["name"],
                                tags=_mapped_tags(run["tags"], ids)).info.run_id
        ids[run["id"]] = new
        params = [Param(k, v) for k, v in run["params"].items()]
        for i in range(0, len(params), 100):
            client.log_batch(new, params=params[i:i + 100])
        points = [Metric(m.key, m.value, m.timestamp + shift_ms, m.step) for m in run["metrics"]]
        for i in range(0, len(points), 1000):
            client.log_batch(new, metrics=points[i:i + 1000])
        if run["artifacts"].is_dir() and any(run["artifacts"].iterdir()):
            client.log_artifacts(new, str(run["artifacts"]))
        client.set_terminated(new, status=run["status"], end_time=run["end"] + shift_ms)
    for run in flow["runs"]:  # a run's tags naming runs created after it (the flow run names its stage runs)
        for key, value in run["tags"].items():
            if value in ids and key != "mlflow.parentRunId":
                client.set_tag(ids[run["id"]], key, ids[value])
    return _copy_versions(client, exp, flow, ids)


def _copy_versions(client: Any, exp: str, flow: dict[str, Any], ids: dict[str, str]) -> dict[tuple[str, str], str]:
    from mlflow.exceptions import MlflowException

    made = {}
    for v in flow["versions"]:
        try:
            client.create_registered_model(v["name"])
        except MlflowException:
            pass
        run_id = ids.get(v["run_id"], v["run_id"])
        if v["logged"]:
            model = client.create_logged_model(exp, name=v["logged"]["name"], source_run_id=run_id)
            client.log_model_artifacts(model.model_id, str(v["logged"]["dir"]))
            new = client.create_model_version(v["name"], f"models:/{model.model_id}", run_id=run_id,
                                              tags=v["tags"], model_id=model.model_id)
        else:
            source = v["source"].replace(v["run_id"], run_id)
            new = client.create_model_version(v["name"], source, run_id=run_id, tags=v["tags"])
        made[(v["name"], v["version"])] = str(new.version)
    return made


def run_gc(project: Path, scratch: Path) -> tuple[dict[str, int], float]:
    """``alignflow gc --apply`` in ``project`` as a nightly job would run it; its counts and wall time."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "gc", "--apply", "--json"], cwd=project,
                          env={**project_env(project, scratch), "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"alignflow gc failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)["counts"], round(time.monotonic() - start, 1)


def simulate(flow: dict[str, Any], scratch: Path, nights: int, with_gc: bool) -> list[dict[str, Any]]:
    """``nights`` copies of the measured flow a day apart in a store of their own, gc after each with ``with_gc``;
    what the store holds after each night."""
    import mlflow
    from mlflow import MlflowClient

    from rlhf_core.config import TrackingConfig

    project = scratch / ("with_gc" if with_gc else "no_gc")
    project.mkdir()
    uri = f"sqlite:///{project / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)  # the registry looks a logged model up in the process's tracking store
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.create_experiment(TrackingConfig().experiment, artifact_location=(project / "mlartifacts").as_uri())
    now = datetime.now(timezone.utc)
    rows = []
    for night in range(1, nights + 1):
        day_ms = int((now - timedelta(days=nights - night)).timestamp() * 1000)
        made = copy_night(client, exp, flow, day_ms - flow["start"])
        if night == 1:  # the first night's champion is never beaten: its lineage stays all month
            for (name, alias), old in flow["aliases"].items():
                client.set_registered_model_alias(name, alias, made[(name, old)])
        row: dict[str, Any] = {"night": night}
        if with_gc:
            row["deleted"], row["gc_wall_s"] = run_gc(project, scratch)
        rows.append({**row, "runs": count_runs(uri), **store_sizes(project)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nights", type=int, default=30)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/gcbench"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--measured", type=Path, default=None,
                        help="a project folder this script's measured part already ran the align flow in (its "
                             "figures in <folder>/../measured.json): skip running it again")
    args = parser.parse_args(argv)
    if args.measured:
        project, measured = args.measured, json.loads((args.measured.parent / "measured.json").read_text())
    else:
        if args.scratch.exists():
            raise SystemExit(f"{args.scratch} exists: remove it or pass --scratch")
        project, measured = measure_flow(args.scratch)
    flow = read_flow(f"sqlite:///{project / 'mlflow.db'}")
    sim_scratch = args.scratch / "nights"
    shutil.rmtree(sim_scratch, ignore_errors=True)
    sim_scratch.mkdir()
    try:  # the two stores are independent: one process each
        with ProcessPoolExecutor(max_workers=2) as pool:
            no_gc_job, with_gc_job = (pool.submit(simulate, flow, sim_scratch, args.nights, with_gc)
                                      for with_gc in (False, True))
            no_gc, with_gc = no_gc_job.result(), with_gc_job.result()
    finally:
        shutil.rmtree(args.scratch, ignore_errors=True)
    result = {
        "what": "a month of nightly align flows of the embedded default: one measured flow, then simulated nights "
                "built from its own store (module docstring of bench/retention.py)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "nights": args.nights,
        "host": {"cpus": os.cpu_count(), "load_avg_1_5_15_min_at_end": [round(x, 1) for x in os.getloadavg()],
                 "note": "wall times are on a machine shared with other jobs; the sizes do not depend on it"},
        "retention": {"keep_runs": 10, "keep_days": 7.0}, "measured_one_flow": measured,
        "simulated": {"no_gc": {"final": no_gc[-1], "per_night": no_gc},
                      "with_gc": {"final": with_gc[-1], "max_runs": max(r["runs"] for r in with_gc),
                                  "max_mlartifacts_mb": max(r["mlartifacts_mb"] for r in with_gc),
                                  "per_night": with_gc}},
    }
    out = args.out or result_path("retention_month_cpu.json", device="cpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
