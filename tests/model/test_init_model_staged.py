"""``init_model`` stages the new base model beside the old one and renames it into place: a
failure while writing the new model (here a real full disk, a tmpfs) leaves the previous model
whole, where rmtree-then-copy left none, and no temp folder behind.

Mounting needs root (as CI runs): without it the test skips, saying so, except under ``CI=true``.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from rlhf_core.tracking.checkpoint import StorageError
from rlhf_core.config import ModelConfig
from rlhf_core.tracking import lineage
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.stages.wrappers import init_model


@pytest.fixture()
def small_tmpfs(tmp_path):
    point = tmp_path / "disk"
    point.mkdir()
    size = 1_200_000  # bytes: holds two small models (~0.12 MB each), not the big one (~1.3 MB)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); needs root"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    yield point
    subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_failed_rebuild_keeps_the_previous_base_model(micro_data, small_tmpfs, monkeypatch):
    monkeypatch.setattr(lineage, "_hash_cache_setting", "off")  # tracking.hash_cache: off
    out = small_tmpfs / "base"
    common = dict(corpus_file=str(micro_data["sft"]), out_dir=str(out), vocab_size=280, num_layers=2,
                  max_positions=64, seed=0)
    small = init_model(ModelConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, **common))
    assert small.md5["model"] == dvc_md5(out)

    # rebuilt with the same config: the same md5 (DVC's init_model stage stays reproducible)
    assert init_model(ModelConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                  **common)).md5 == small.md5

    big = ModelConfig(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256, **common)
    with pytest.raises(StorageError, match="No space left on device"):
        init_model(big)
    assert dvc_md5(out) == small.md5["model"]
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["base"]
