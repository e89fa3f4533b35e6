"""What registering a 7B-shaped model costs: by copy (MLflow's transformers flavor) vs by reference.

Builds a model folder the shape of a 7B safetensors checkpoint (4 shards of random bytes, ~15 GB,
plus a real tokenizer and config, so MLflow's transformers flavor accepts it; see
bench/hash_cache.py), then registers it through the flows' own task (tasks.registry.register_model)
against a fresh sqlite store, timing each and measuring the bytes it adds under ``mlartifacts``:

* copy: ``tracking.model_storage: copy`` (the default): the weights are copied into the store;
* reference, cold: a pointer (path + DVC md5), the md5 computed from scratch (no hash cache);
* reference, warm: the same, with the hash cache the training stage already filled (the flows' case);
* retention: ``prune_model_versions`` deleting the copied version once it is neither champion
  nor candidate (``tracking.keep_model_versions``).

The page cache is dropped before each registration when permitted (root). Everything under the
scratch folder is deleted afterwards.

    .venv/bin/python bench/registry_cost.py              # ~15 GB (needs ~50 GB free on /tmp), ~10 minutes
    .venv/bin/python bench/registry_cost.py --gb 2 --out /tmp/registry_cost_small.json

Writes ``bench/results/cpu/<UTC date>/registry_cost_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hash_cache import build_model_dir, drop_page_cache, machine  # noqa: E402  (bench/ is sys.path[0])
from result_paths import result_path  # noqa: E402


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def add_tokenizer(model: Path, scratch: Path) -> None:
    """A real (tiny) tokenizer in the folder: the transformers flavor saves it as a component."""
    from rlhf_core.embedded.tiny_model import train_tokenizer

    tok = train_tokenizer([f"prompt {i} answer {i * 7}" for i in range(300)], scratch / "tokenizer", vocab_size=280)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, model / name)


def register(client, exp: str, model: Path, name: str, accuracy: float, storage: str, artifacts: Path,
             drop: bool) -> dict[str, float | int | bool | str]:
    """One registration through the flows' task: seconds and bytes added under ``mlartifacts``."""
    from tasks.registry import register_model

    run_id = client.create_run(exp).info.run_id
    dropped = drop_page_cache() if drop else False
    before = folder_bytes(artifacts)
    start = time.perf_counter()
    out = register_model.fn(model_dir=str(model), run_id=run_id, accuracy=accuracy, registered_name=name,
                            tracking={"experiment": "bench", "model_storage": storage})
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "mlartifacts_bytes_added": folder_bytes(artifacts) - before,
            "page_cache_dropped": dropped, "version": out["version"], "model_uri": out["model_uri"]}


def run(scratch: Path, size: int) -> dict:
    project, model = scratch / "project", scratch / "project" / "models" / "policy"
    os.environ["ALIGNFLOW_HOME"] = str(project)  # the hash cache lives in <project>/.alignflow
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{project / 'mlflow.db'}"
    os.chdir(scratch)
    t0 = time.perf_counter()
    build_model_dir(model, size)
    add_tokenizer(model, scratch)
    build_s = time.perf_counter() - t0
    time.sleep(1.1)  # past the hash cache's racy-mtime window

    import mlflow.transformers  # noqa: F401  (imported before timing: a flow's process already has them)
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from mlflow import MlflowClient

    from rlhf_core.tracking.mlflow_runs import prune_model_versions

    artifacts = project / "mlartifacts"
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    exp = client.create_experiment("bench", artifact_location=artifacts.as_uri())
    copy = register(client, exp, model, "bench-copy", 0.5, "copy", artifacts, drop=True)
    cold = register(client, exp, model, "bench-ref", 0.5, "reference", artifacts, drop=True)
    warm = [register(client, exp, model, "bench-ref", 0.5, "reference", artifacts, drop=True) for _ in range(3)]
    # retention: a better reference version takes both aliases, then keep 1 deletes the copy
    register(client, exp, model, "bench-copy", 0.6, "reference", artifacts, drop=False)
    before = folder_bytes(artifacts)
    start = time.perf_counter()
    pruned = prune_model_versions(client, "bench-copy", 1)
    prune_s = time.perf_counter() - start
    return {
        "what": "register a 7B-shaped model folder: by copy (transformers flavor) vs by reference (path + DVC md5)",
        "command": " ".join(["python bench/registry_cost.py", *sys.argv[1:]]),
        "bytes": folder_bytes(model), "files": len(list(model.iterdir())),
        "build_s": round(build_s, 1), "copy": copy, "reference_cold_hash": cold,
        "reference_warm_hash": warm,
        "retention": {"pruned_versions": pruned, "seconds": round(prune_s, 2),
                      "mlartifacts_bytes_freed": before - folder_bytes(artifacts)},
        "machine": machine(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=15.0, help="total size of the shards, GB (10^9 bytes)")
    ap.add_argument("--dir", default="/tmp/alignflow-registry-bench", help="scratch folder (deleted afterwards)")
    ap.add_argument("--out", default=str(result_path("registry_cost_cpu.json", "cpu")))
    args = ap.parse_args()

    scratch = Path(args.dir)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    size = int(args.gb * 1e9)
    # The copy briefly holds three: the folder, MLflow's temporary save, and the artifact store's copy.
    free = shutil.disk_usage(scratch).free
    if free < 3 * size + 5e9:
        shutil.rmtree(scratch)
        print(f"{free / 1e9:.0f} GB free under {scratch}; --gb {args.gb:g} needs {(3 * size + 5e9) / 1e9:.0f} GB. "
              "Pass a smaller --gb.", file=sys.stderr)
        return 2
    try:
        result = run(scratch, size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
