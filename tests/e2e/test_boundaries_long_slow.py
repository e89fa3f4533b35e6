"""The input-boundary property tests' long run: every test of tests/unit/boundaries with the ``long``
hypothesis profile (2,000 examples a test, a fresh random seed each run), in a pytest process of its own.

`make test` runs the same tests with 200 examples and a fixed seed; this run searches further. It
passes when every property holds, and prints how many examples each test ran (hypothesis' statistics)
so a reviewer can read the count off the log.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

_COUNTS = re.compile(r"(\d+) passing(?: examples?)?, (\d+) failing")  # hypothesis 6: "- 2000 passing, 0 failing, ..."


@pytest.mark.slow  # about ten times the default tier's examples
def test_every_boundary_holds_over_a_long_run():
    env = {**os.environ, "ALIGNFLOW_HYPOTHESIS_PROFILE": "long"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           "--hypothesis-show-statistics", "tests/unit/boundaries"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    counts = [(int(p), int(f)) for p, f in _COUNTS.findall(proc.stdout)]
    assert counts, "no hypothesis statistics in the output"
    passing = sum(p for p, _ in counts)
    assert all(f == 0 for _, f in counts)
    print(f"long run: {passing} passing examples over {len(counts)} generate/shrink phases")
