"""Slow acceptance checks: the full-size embedded default through the real CLI.

* SFT lands in [0.20, 0.90) on 1,000 held-out items: a useful starting policy that still
  imitates the demonstrator's systematic flaw, so alignment has room above it.
* The reward model reaches >= 75% pairwise accuracy on held-out pairs.
* DPO after SFT, and one RAFT round (n = 4 samples per prompt scored by the *reward model*,
  then SFT on the kept samples), each raise greedy accuracy over SFT by more than two
  standard errors of the SFT estimate.

About 8 minutes on 2 CPU cores. Training time is a benchmark (``bench/``, BENCHMARKS.md),
not asserted here.

Run: ``make test-slow``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO
from helpers import run_cli


def _metrics(folder, name):
    return json.loads((folder / "metrics" / f"{name}.json").read_text())


@pytest.mark.slow
def test_full_size_offline_alignment_beats_sft(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    for cmd in (["generate"], ["init-model"], ["sft", "--metrics-file", "metrics/sft.json"],
                ["reward", "--metrics-file", "metrics/reward.json"], ["dpo", "--metrics-file", "metrics/dpo.json"],
                ["rejection", "--metrics-file", "metrics/rejection.json"],
                ["raft", "--metrics-file", "metrics/raft.json"]):
        proc = run_cli(cmd, tmp_path, timeout=1200)
        assert proc.returncode == 0, (cmd, proc.stderr[-3000:])
    sft, reward, dpo, raft = (_metrics(tmp_path, n) for n in ("sft", "reward", "dpo", "raft"))
    rejection = _metrics(tmp_path, "rejection")
    print("full-size:", json.dumps({"sft": sft, "reward": reward, "dpo": dpo, "rejection": rejection,
                                    "raft": raft}, indent=1))
    assert sft["eval/n_items"] == 1000 and 0.20 <= sft["eval/accuracy"] < 0.90
    assert reward["eval/reward_accuracy"] >= 0.75 and reward["eval/reward_margin"] > 0
    two_se = 2 * sft["eval/accuracy_stderr"]
    assert dpo["eval/accuracy"] > sft["eval/accuracy"] + two_se, (dpo, sft)
    assert raft["eval/accuracy"] > sft["eval/accuracy"] + two_se, (raft, sft)
