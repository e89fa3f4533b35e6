"""What the md5 hash cache saves on a 7B-shaped model directory.

Builds a model folder the shape of a 7B safetensors checkpoint (4 shards of random bytes,
~15 GB in all, plus the small JSON files), then times ``dvc_md5`` over it: cold (every byte
read and hashed, no cache) and warm (a fresh :class:`rlhf_core.tracking.lineage.HashCache` loaded from
its file, as the next stage's process would), ``--runs`` times each, dropping the page cache
before every run when permitted (root). The folder is deleted afterwards.

    .venv/bin/python bench/hash_cache.py                # ~15 GB under /tmp, ~5 minutes
    .venv/bin/python bench/hash_cache.py --gb 2 --runs 3 --out /tmp/hash_cache_small.json

Writes ``bench/results/cpu/<UTC date>/hash_cache_cpu.json`` (per-run seconds, median and range, machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_paths import result_path  # noqa: E402  (bench/ is sys.path[0])

from rlhf_core.tracking.lineage import MIN_CACHED_BYTES, HashCache, dvc_md5  # noqa: E402

CHUNK = 64 << 20
SMALL_FILES = {
    "config.json": '{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "num_hidden_layers": 28}\n',
    "generation_config.json": '{"do_sample": false}\n',
    "tokenizer_config.json": '{"model_max_length": 32768}\n',
    "special_tokens_map.json": '{"eos_token": "<|im_end|>"}\n',
}


def build_model_dir(root: Path, total_bytes: int, shards: int = 4) -> int:
    """Write ``shards`` safetensors-sized files of random bytes (``total_bytes`` in all) and the
    small files of an HF folder; returns the bytes written."""
    root.mkdir(parents=True)
    per_shard = total_bytes // shards
    index = {"metadata": {"total_size": per_shard * shards}, "weight_map": {}}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        with (root / name).open("wb") as fh:
            left = per_shard
            while left:
                n = min(CHUNK, left)
                fh.write(os.urandom(n))
                left -= n
        index["weight_map"][f"model.layers.{i}.weight"] = name
    (root / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")
    for name, text in SMALL_FILES.items():
        (root / name).write_text(text)
    return sum(p.stat().st_size for p in root.iterdir())


def drop_page_cache() -> bool:
    """Drop the page cache so a cold run reads from disk; False where not permitted."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn) -> tuple[float, str]:
    start = time.perf_counter()
    digest = fn()
    return time.perf_counter() - start, digest


def summarise(seconds: list[float]) -> dict[str, float | list[float]]:
    return {"runs_s": [round(s, 5) for s in seconds], "median_s": round(statistics.median(seconds), 5),
            "min_s": round(min(seconds), 5), "max_s": round(max(seconds), 5)}


def machine() -> dict[str, str | int]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count() or 0, "python": platform.python_version(),
            "kernel": platform.release(),
            "disk": subprocess.run(["df", "-h", "--output=source,fstype", "/tmp"], capture_output=True,
                                   text=True).stdout.split("\n")[1].strip()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=15.0, help="total size of the shards, GB (10^9 bytes)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/alignflow-hash-bench", help="scratch folder (deleted afterwards)")
    ap.add_argument("--out", default=str(result_path("hash_cache_cpu.json", "cpu")))
    args = ap.parse_args()

    scratch = Path(args.dir)
    if scratch.exists():
        shutil.rmtree(scratch)
    model, cache_file = scratch / "model", scratch / "hash-cache.json"
    try:
        t0 = time.perf_counter()
        size = build_model_dir(model, int(args.gb * 1e9))
        build_s = time.perf_counter() - t0
        # files under MIN_CACHED_BYTES (the JSON files) are re-read on every run, by design
        small = sum(p.stat().st_size for p in model.iterdir() if p.stat().st_size < MIN_CACHED_BYTES)
        time.sleep(1.1)  # past the cache's "racy mtime" window: a just-written file is never cached

        cold, cold_digests, dropped = [], set(), True
        for _ in range(args.runs):
            dropped &= drop_page_cache()
            s, d = timed(lambda: dvc_md5(model, cache=False))
            cold.append(s)
            cold_digests.add(d)
        # the first pass with the cache on: hashes everything and writes the cache file
        dropped &= drop_page_cache()
        fill = HashCache(cache_file)

        def first_pass() -> str:
            digest = dvc_md5(model, cache=fill)
            fill.save()
            return digest

        first_s, first_digest = timed(first_pass)
        warm, warm_digests = [], set()
        for _ in range(args.runs):
            dropped &= drop_page_cache()
            cache = HashCache(cache_file)  # loaded from disk, as the next stage's process does
            s, d = timed(lambda: dvc_md5(model, cache=cache))
            assert cache.hashed_bytes == small, "a warm run read a weight file"
            warm.append(s)
            warm_digests.add(d)
        digests = cold_digests | warm_digests | {first_digest}
        assert len(digests) == 1, f"cached and uncached md5s differ: {digests}"
        result = {
            "what": "dvc_md5 over a 7B-shaped model directory: cold (no cache) vs warm (hash cache)",
            "command": " ".join(["python bench/hash_cache.py", *sys.argv[1:]]),
            "bytes": size, "files": len(list(model.iterdir())), "build_s": round(build_s, 1),
            "page_cache_dropped_before_each_run": dropped,
            "cold": summarise(cold), "first_pass_with_cache_s": round(first_s, 3), "warm": summarise(warm),
            "cold_throughput_mb_s": round(size / 1e6 / statistics.median(cold), 1),
            "speedup_median": round(statistics.median(cold) / statistics.median(warm), 1),
            "cache_file_bytes": cache_file.stat().st_size, "warm_bytes_read": small,
            "md5": digests.pop(), "machine": machine(),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
