"""DVC: the shipped pipeline parses, and ``dvc repro`` is deterministic from a fresh copy."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from helpers import cli_env, copy_project


def test_shipped_dvc_yaml_parses_and_matches_params():
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        names = {stage.addressing for stage in repo.index.stages}
    assert {"generate", "init_model", "sft", "evaluate", "validate@sft", "validate@preferences", "reward", "dpo",
            "kto", "rejection", "validate_rejection@kept", "validate_rejection@pairs", "raft", "distill",
            "rl"} <= names
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].values():
        for section in stage.get("params", []):
            assert section in params


def _repro(folder):
    env = {**cli_env(folder), "PYTHONPATH": str(folder)}  # the copy's own code, not the editable install
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro", "--no-run-cache"], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lock = yaml.safe_load((folder / "dvc.lock").read_text())
    return {stage: [(o["path"], o["md5"]) for o in body.get("outs", [])] for stage, body in lock["stages"].items()}


@pytest.mark.slow  # two full `dvc repro` runs of ~20 stage processes each: 9 minutes on 2 cores (`make test-slow`)
def test_micro_repro_is_deterministic_across_fresh_copies(tmp_path):
    a = _repro(copy_project((tmp_path / "a")))
    b = _repro(copy_project((tmp_path / "b")))
    assert a == b
    assert any(path == "models/sft" for path, _ in a["sft"])
    for stage in ("reward", "dpo", "kto", "raft", "distill", "rl"):
        assert f"models/{stage}" in [path for path, _ in a[stage]], stage
    assert a["rejection"] and (tmp_path / "a" / "reports/validation/rejection_kept.json").exists()
    assert (tmp_path / "a" / "reports/validation/sft.json").exists()
