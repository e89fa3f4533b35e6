"""The dataset gate on a large file and on a huge record: peak memory, rows counted, throughput.

1. Writes a JSON Lines preference file of ``--gb`` GB under /tmp (rows of about ``--row-bytes``
   bytes, every one distinct), whose second-to-last line repeats line 1 (a duplicate two million
   rows apart) and whose last line has chosen equal to rejected. Validates it in a fresh process
   (``validate_dataset``, the gate's default chunking) and reads that process's peak RSS
   (``getrusage`` ``ru_maxrss`` at its end: the interpreter, pandas and GX included), its peak
   RSS after imports (the baseline), rows counted, the failures found and the throughput (file MB / seconds).
2. Writes a file whose second record holds a 2 MB prompt of one repeated letter and runs
   ``alignflow validate`` on it (``--timeout`` seconds at most): the exit status, the error's first
   line and the time (process start and imports included). The same file is also validated in
   a process of its own (``validate_dataset`` alone), once as the gate runs and once with the
   failure excerpts' secret redaction skipped (``--child-noredact``: this measurement only), to
   time redaction apart from the rest of the gate. Then ``alignflow validate`` runs on a 30-row file
   and on the 2 MB record alternately (``--pairs`` times): both medians and ranges.

The files are deleted afterwards.

    .venv/bin/python bench/validate_big.py                       # 2 GB under /tmp
    .venv/bin/python bench/validate_big.py --gb 0.1 --out /tmp/validate_small.json

Writes ``bench/results/cpu/<UTC date>/validate_big_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from result_paths import result_path  # noqa: E402  (bench/ is sys.path[0])

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "and sphinx of black quartz hears my vow ").split()


def _text(i: int, salt: int, chars: int) -> str:
    """A distinct text of about ``chars`` characters for row ``i``."""
    words, n, k = [f"row{i}-{salt}"], 0, i * 31 + salt
    while n < chars:
        word = WORDS[k % len(WORDS)]
        words.append(word)
        n, k = n + len(word) + 1, k * 1103515245 + 12345 & 0x7FFFFFFF
    return " ".join(words)


def write_big(path: Path, total_bytes: int, row_bytes: int) -> dict[str, int]:
    """Rows of about ``row_bytes`` until ``total_bytes``; then a duplicate of line 1 and a chosen == rejected row."""
    part = max(16, (row_bytes - 60) // 3)
    first, n, size = None, 0, 0
    with path.open("w", encoding="utf-8") as fh:
        while size < total_bytes:
            n += 1
            row = {"prompt": _text(n, 0, part), "chosen": _text(n, 1, part), "rejected": _text(n, 2, part)}
            line = json.dumps(row) + "\n"
            first = first or line
            fh.write(line)
            size += len(line)
        fh.write(first)  # line n + 1: a duplicate of line 1
        fh.write(json.dumps({"prompt": "last?", "chosen": "same", "rejected": "same"}) + "\n")
    return {"rows": n + 2, "bytes": path.stat().st_size, "duplicate_line": n + 1, "bad_last_line": n + 2}


def write_huge_record(path: Path, chars: int = 2 * 1024 * 1024) -> None:
    with path.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
        fh.write(json.dumps({"prompt": "a" * chars, "chosen": "2", "rejected": "3"}) + "\n")


def child(path: str, redact: bool) -> None:
    """Validate ``path`` in this process; print the report's figures as JSON on stdout."""
    import great_expectations  # noqa: F401  (imported before the baseline is read)
    import pandas  # noqa: F401

    from rlhf_core.data import validate

    if not redact:
        validate.redact_secrets = lambda obj, key="": obj
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    report = validate.validate_dataset(path, "preference")
    seconds = time.perf_counter() - t0
    failures = [{"field": f.field, "message": f.message, "expectation": f.expectation, "count": f.unexpected_count,
                 "lines": f.lines[:5], "example": (f.examples or [""])[0][:120]} for f in report.failures]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the kernel's high-water mark
    print(json.dumps({"n_rows": report.n_rows, "success": report.success, "failures": failures,
                      "seconds": round(seconds, 2), "baseline_rss_mb": round(baseline, 1),
                      "peak_rss_mb": round(peak, 1)}))


def run_child(path: Path, redact: bool = True, timeout: float | None = None) -> dict:
    """The child's figures (its peak RSS included) and the wall time around it."""
    flag = "--child" if redact else "--child-noredact"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, flag, str(path)], capture_output=True, text=True,
                              env=env, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return {"timed_out": True, "timeout_s": timeout}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = round(time.perf_counter() - t0, 2)
    return result


def run_cli(path: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "validate", "--kind", "preference", str(path)],
                              capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"timed_out": True, "timeout_s": timeout}
    return {"timed_out": False, "rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 2),
            "error_head": "\n".join(proc.stderr.strip().splitlines()[:2])[:400]}


def write_small(path: Path, rows: int = 30) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for i in range(rows):
            fh.write(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)}) + "\n")


def cli_pairs(huge: Path, small: Path, pairs: int, timeout: float) -> dict:
    """``alignflow validate`` on a 30-row file and on the 2 MB record, alternately ``pairs`` times: the
    median and range of each (seconds, process start included) and the median difference."""
    import statistics

    times: dict[str, list[float]] = {"small": [], "huge": []}
    for _ in range(pairs):
        for name, path in (("small", small), ("huge", huge)):
            run = run_cli(path, timeout)
            times[name].append(run.get("seconds", float("inf")))
    out = {name: {"median_s": statistics.median(t), "range_s": [min(t), max(t)], "runs_s": t}
           for name, t in times.items()}
    out["median_difference_s"] = round(out["huge"]["median_s"] - out["small"]["median_s"], 2)
    return out


def large_file_figures(big: Path, gb: float, row_bytes: int) -> dict:
    """Part 1: the generated file's shape and its validation's figures."""
    t0 = time.perf_counter()
    file = write_big(big, int(gb * 1e9), row_bytes)
    file["generate_s"] = round(time.perf_counter() - t0, 1)
    file["mean_row_bytes"] = round(file["bytes"] / file["rows"], 1)
    print("generated", file, flush=True)
    run = run_child(big)
    run["throughput_mb_s"] = round(file["bytes"] / 1e6 / run["seconds"], 2)
    run["rows_all_counted"] = run["n_rows"] == file["rows"]
    print("large file", run, flush=True)
    big.unlink()
    return {"file": file, "large_file": run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the large file")
    parser.add_argument("--row-bytes", type=int, default=1000, help="approximate bytes per row")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed to the 2 MB record's command")
    parser.add_argument("--huge-record-only", action="store_true",
                        help="rerun only the 2 MB record's part, keeping the large file's figures in --out")
    parser.add_argument("--pairs", type=int, default=5,
                        help="alternate alignflow validate on a 30-row file and on the 2 MB record this many times")
    parser.add_argument("--out", default=str(result_path("validate_big_cpu.json", "cpu")))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-noredact", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.child_noredact:
        return child(args.child or args.child_noredact, redact=args.child is not None)
    big, huge = Path("/tmp/alignflow_validate_big.jsonl"), Path("/tmp/alignflow_validate_huge_record.jsonl")
    result: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "python": platform.python_version()}}
    if args.huge_record_only:
        result = json.loads(Path(args.out).read_text())
    try:
        if not args.huge_record_only:
            result.update(large_file_figures(big, args.gb, args.row_bytes))
        write_huge_record(huge)
        result["huge_record_cli"] = run_cli(huge, args.timeout)
        print("2 MB record, alignflow validate", result["huge_record_cli"], flush=True)
        small = huge.with_name("alignflow_validate_30_rows.jsonl")
        write_small(small)
        result["cli_30_rows_vs_2mb_record"] = cli_pairs(huge, small, args.pairs, args.timeout)
        small.unlink()
        print("alternating 30 rows / 2 MB record", result["cli_30_rows_vs_2mb_record"], flush=True)
        for redact, name in ((True, "huge_record_gate"), (False, "huge_record_without_redaction")):
            result[name] = run_child(huge, redact=redact, timeout=args.timeout)
            print(name, result[name], flush=True)
    finally:
        for path in (big, huge):
            path.unlink(missing_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
