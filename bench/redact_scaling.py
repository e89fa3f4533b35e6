"""Time redaction (and the data report's offline filter) on long adversarial strings.

Each family of tests/unit/test_redact_linear.py at 200k and 400k characters, measured alternately,
seven times each; prints one JSON line per family with the median and range (seconds) and the
ratio of the medians. Run: ``.venv/bin/python bench/redact_scaling.py [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from test_redact_linear import FAMILIES, N, _every_path  # noqa: E402


def _times(text: str) -> float:
    start = time.perf_counter()
    _every_path(text)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the rows to this JSON file")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for family, make in FAMILIES.items():
        small, large = make(N), make(2 * N)
        runs: tuple[list[float], list[float]] = ([], [])
        for _ in range(args.repeats):
            runs[0].append(_times(small))
            runs[1].append(_times(large))
        row = {"family": family, "chars": [len(small), len(large)],
               "median_s": [statistics.median(r) for r in runs], "range_s": [[min(r), max(r)] for r in runs]}
        row["ratio"] = row["median_s"][1] / row["median_s"][0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        doc = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(), "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
