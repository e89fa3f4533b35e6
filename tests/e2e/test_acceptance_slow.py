"""Slow acceptance check: full-size SFT on the embedded default through the real CLI.

Accuracy must land in [0.40, 0.90) on >= 500 held-out items: good enough to be a useful
starting policy, with room above it for alignment. Training time is a benchmark
(``bench/sft_embedded.py``, BENCHMARKS.md), not asserted here.

Run: ``make test-slow``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO
from helpers import run_cli


@pytest.mark.slow
def test_full_size_sft_lands_between_40_and_90_percent(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    for cmd in (["generate"], ["init-model"], ["sft", "--set", "eval_items=100"], ["evaluate"]):
        proc = run_cli(cmd, tmp_path, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics/eval_sft.json").read_text())
    print("full-size SFT:", metrics)
    assert metrics["eval/n_items"] >= 500
    assert 0.40 <= metrics["eval/accuracy"] < 0.90
