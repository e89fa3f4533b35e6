"""The real recipe's wall times and figures, from a project that ran it (``make real-recipe``).

Reads the project's MLflow store (each stage's run: its name, start and end, and its eval metrics) and
``metrics/real_*.json``, and writes one JSON file beside the host, torch version and commit it ran on. The total
is the ``time`` of ``make real-recipe``, given on the command line (stages that log no MLflow run, the import and
data generation, are inside it only).

Run: ``python bench/real_recipe_walls.py --root /path/to/clone --total-s 2710 --out bench/results/cpu/DAY/x.json``
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

KEYS = ("eval/accuracy", "eval/accuracy_stderr", "eval/format_rate", "eval/accuracy_formatted",
        "eval/accuracy_formatted_stderr", "eval/n_items")


def _cpu() -> str:
    """The host's CPU model and core count (``/proc/cpuinfo``; ``platform.processor()`` where it is absent)."""
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
             if line.startswith("model name")] if info.exists() else []
    return f"{names[0]}, {len(names)} cores" if names else platform.processor()


def runs(root: Path) -> list[dict]:
    """Each MLflow run of the project, oldest first: name, wall seconds, status and its eval metrics."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow (the script's --help stays light)

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    out = []
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], max_results=1000, order_by=["attributes.start_time ASC"]):
            info, metrics = run.info, run.data.metrics
            out.append({"name": info.run_name, "status": info.status,
                        "wall_s": round((info.end_time - info.start_time) / 1000, 1) if info.end_time else None,
                        **{k: metrics[k] for k in KEYS if k in metrics}})
    return sorted(out, key=lambda r: r["name"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="the project (a clone) that ran the recipe")
    parser.add_argument("--total-s", type=float, required=True, help="wall seconds of `make real-recipe`")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--paused-s", type=float, default=0.0,
                        help="seconds the run was stopped (SIGSTOP) inside --total-s; the stage walls include them")
    parser.add_argument("--conditions", default="", help="what else ran on the machine meanwhile")
    args = parser.parse_args(argv)
    import torch  # lazy: the version only

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.root, capture_output=True, text=True).stdout.strip()
    metrics = {p.stem: json.loads(p.read_text()) for p in sorted((args.root / "metrics").glob("real_*.json"))}
    record = {"commit": commit, "host": _cpu(), "torch": torch.__version__, "command": "make real-recipe",
              "total_wall_s": args.total_s, "paused_s": args.paused_s, "conditions": args.conditions, "runs": runs(args.root), "metrics": metrics}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}: {len(record['runs'])} runs, {len(metrics)} metrics files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
