"""Wall time of the commands a new user types first, each a fresh process as typed: ``alignflow --help``,
``--version``, a mistyped override to a stage and to ``flow align`` (the one-line error), ``validate`` of a
30-row file, and ``diff`` of two tracked runs. Median and range over ``--runs`` runs each.

    python bench/cli_startup.py [--runs 10] [--out FILE.json]

Runs the ``alignflow`` console script beside this Python (else ``python -m flows.cli``) in a temporary
project folder: a 30-row SFT file of the embedded task, and two runs logged to an sqlite MLflow store there
(params, metrics and lineage tags, no model) for ``diff``. The figures depend on the machine and its load:
report them with the machine (BENCHMARKS.md), never in a docstring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def alignflow() -> list[str]:
    script = Path(sys.executable).parent / "alignflow"
    return [str(script)] if script.exists() else [sys.executable, "-m", "flows.cli"]


def seed_project(root: Path) -> tuple[str, str]:
    """A 30-row SFT file (``sft30.jsonl``) and two runs to diff in ``root``; returns the runs' ids."""
    from rlhf_core.config import TrackingConfig
    from rlhf_core.embedded.tasks import generate_datasets
    from rlhf_core.tracking.mlflow_runs import start_run

    files = generate_datasets(root / "data", seed=1, n_sft=30, n_preference=4, n_prompts=4, n_eval=4,
                              sft_noise=0.0)
    (root / "sft30.jsonl").write_text(Path(files["sft"]).read_text())
    ids = []
    for lr, loss in ((1e-3, 1.25), (3e-4, 1.5)):
        with start_run(TrackingConfig(experiment="bench-cli"), "sft",
                       tags={"dvc.md5.train": "0" * 32, "alignflow.stage": "sft"}) as run:
            run.log_params({"lr": lr, "max_steps": 10})
            run.log_metrics({"train/loss": loss, "eval/accuracy": 0.5, "eval/accuracy_stderr": 0.05}, 0)
            ids.append(run.run_id)
    return ids[0], ids[1]


def time_command(argv: list[str], root: Path, env: dict[str, str], runs: int, expect: int) -> dict[str, float]:
    """Median, min and max wall seconds of ``argv`` over ``runs`` fresh processes (one untimed run first)."""
    seconds = []
    for i in range(runs + 1):
        started = time.perf_counter()
        proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        elapsed = time.perf_counter() - started
        if proc.returncode != expect:
            raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}, expected {expect}:\n{proc.stderr[-2000:]}")
        if i:  # the first run warms the page cache
            seconds.append(elapsed)
    return {"median_s": round(statistics.median(seconds), 3), "min_s": round(min(seconds), 3),
            "max_s": round(max(seconds), 3), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="alignflow-cli-bench-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "ALIGNFLOW_HOME": str(root), "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
               "PREFECT_HOME": str(root / ".prefect")}
        os.environ.update({k: env[k] for k in ("ALIGNFLOW_HOME", "MLFLOW_TRACKING_URI")})
        run_a, run_b = seed_project(root)
        cli = alignflow()
        commands = {
            "alignflow --help": (["--help"], 0),
            "alignflow --version": (["--version"], 0),
            "alignflow sft --set max_step=5 (error)": (["sft", "--set", "max_step=5"], 2),
            "alignflow flow align --set sft.max_step=5 (error)": (["flow", "align", "--set", "sft.max_step=5"], 2),
            "alignflow validate --kind sft (30 rows)": (["validate", "--kind", "sft", "sft30.jsonl"], 0),
            "alignflow diff A B (two runs)": (["diff", run_a, run_b], 0),
        }
        results = {name: time_command(cli + extra, root, env, args.runs, code)
                   for name, (extra, code) in commands.items()}
    results = {"command": " ".join(cli), "cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2),
               "results": results}
    width = max(len(k) for k in results["results"])
    for name, r in results["results"].items():
        print(f"{name:<{width}}  median {r['median_s']:.2f} s  (range {r['min_s']:.2f}-{r['max_s']:.2f} s, "
              f"{r['runs']} runs)")
    print(f"({results['cpus']} CPUs, 1-min load {results['load_1min']})")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
