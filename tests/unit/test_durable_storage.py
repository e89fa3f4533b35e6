"""Durable writes without a model: storage-fault classification on real failing writes, the run
fingerprint's code parts (reward file bytes, the core's source hash), manifests and temp sweeps.

``/dev/full`` gives a real ENOSPC on every write, so each writer's own way of reporting it
(Python's OSError, torch.save's RuntimeError) is classified as it really arrives. (safetensors
does not write /dev/full through ``write``: its ENOSPC, a Rust ``(os error 28)``, is met on a
real full tmpfs in tests/model/test_storage_faults.py; never point it at /dev/full: it replaces
the path with a regular file.)
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys

import pytest
import torch

from rlhf_core.tracking import lineage
from rlhf_core.tracking.checkpoint import StorageError, run_fingerprint, storage_errno, storage_guard, sweep_temps, temp_sibling
from rlhf_core.tracking.manifest import read_manifest, verify_manifest, write_manifest
from rlhf_core.config import RLConfig, build_config

needs_dev_full = pytest.mark.skipif(not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)),
                                    reason="the /dev/full device (Linux) gives a real ENOSPC")


def _write_dev_full_python() -> None:
    with open("/dev/full", "wb") as fh:
        fh.write(b"x")


def _write_dev_full_torch() -> None:
    with open("/dev/full", "wb") as fh:
        torch.save({"w": torch.zeros(4)}, fh)


@needs_dev_full
@pytest.mark.parametrize("write", [_write_dev_full_python, _write_dev_full_torch])
def test_a_full_disk_is_a_storage_error_whichever_writer_hit_it(write):
    """Each writer's real ENOSPC (an OSError; torch's RuntimeError over the file's OSError) becomes a
    StorageError with errno ENOSPC naming the path and the remedy."""
    with pytest.raises(Exception) as raw:
        write()
    assert storage_errno(raw.value) == errno.ENOSPC
    with pytest.raises(StorageError) as err:
        with storage_guard("/data/ckpt/step-0000008", "cannot write checkpoint"):
            write()
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError)
    assert "cannot write checkpoint /data/ckpt/step-0000008: No space left on device (ENOSPC)" in str(err.value)
    assert "free space" in str(err.value)


def test_read_only_and_permission_errors_are_storage_errors_others_pass_through(tmp_path):
    for code, remedy in ((errno.EROFS, "read-only"), (errno.EACCES, "writable"), (errno.EDQUOT, "quota")):
        with pytest.raises(StorageError, match=remedy) as err:
            with storage_guard(tmp_path, "cannot write"):
                raise OSError(code, os.strerror(code), str(tmp_path))
        assert err.value.errno == code and str(tmp_path) in str(err.value)
    # a missing file or a bug is not a storage fault: it propagates unchanged
    with pytest.raises(FileNotFoundError):
        with storage_guard(tmp_path, "cannot write"):
            open(tmp_path / "no" / "such" / "file", "rb")
    with pytest.raises(ValueError, match="a bug"):
        with storage_guard(tmp_path, "cannot write"):
            raise ValueError("a bug")
    # the Rust writer's wording (safetensors) names the errno in the message only
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert storage_errno(rust) == errno.ENOSPC


def test_storage_error_is_permanent_for_prefect_and_survives_pickling():
    """Not retried (a full disk stays full); Prefect persists a failed task's exception, so it must pickle."""
    import pickle

    from tasks.common import PERMANENT_ERRORS

    err = StorageError(errno.ENOSPC, "cannot write checkpoint /x: No space left on device (ENOSPC)")
    assert isinstance(err, PERMANENT_ERRORS)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is StorageError and back.errno == errno.ENOSPC and str(back) == str(err)


# --------------------------------------------------------------------------------------
# Fingerprint: the reward file's bytes and the core's sources
# --------------------------------------------------------------------------------------


def _rl_cfg(tmp_path, reward_file):
    return build_config(RLConfig, "rl", {"model_path": str(tmp_path / "model"),
                                         "prompts_file": str(tmp_path / "prompts.jsonl"),
                                         "reward.function": f"{reward_file}:reward",
                                         "output_dir": str(tmp_path / "out"), "checkpoint_dir": str(tmp_path / "ckpt")})


def test_fingerprint_follows_the_reward_files_bytes_not_its_timestamp(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [1.0 for _ in completions]\n")
    cfg = _rl_cfg(tmp_path, reward)
    before = run_fingerprint(cfg)
    os.utime(reward, (1, 1))  # touched, same bytes
    assert run_fingerprint(cfg) == before
    reward.write_text("def reward(prompts, completions, labels):\n    return [0.0 for _ in completions]\n")
    edited = run_fingerprint(cfg)
    assert edited != before
    reward.unlink()
    assert run_fingerprint(cfg) not in (before, edited)  # a missing file is a state of its own


def test_fingerprint_follows_the_training_core_sources(tmp_path, monkeypatch):
    """Real hashing of two source trees that differ in one byte; pointing back at the first gives its value."""
    reward = tmp_path / "r.py"
    reward.write_text("def reward(p, c, l):\n    return [0.0] * len(c)\n")
    cfg = _rl_cfg(tmp_path, reward)
    trees = []
    for i, body in enumerate(("return 1\n", "return 2\n")):
        root = tmp_path / f"core{i}"
        (root / "trainers").mkdir(parents=True)
        (root / "trainers" / "sft.py").write_text(f"def train():\n    {body}")
        trees.append(root)
    fingerprints = []
    for root in trees + trees[:1]:
        monkeypatch.setattr(lineage, "CORE_ROOT", root)
        assert lineage.core_fingerprint().endswith(lineage.source_hash(root))
        fingerprints.append(run_fingerprint(cfg))
    assert fingerprints[0] != fingerprints[1] and fingerprints[2] == fingerprints[0]


# --------------------------------------------------------------------------------------
# Manifests and temp folders
# --------------------------------------------------------------------------------------


def test_manifest_lists_every_file_and_catches_size_and_byte_changes(tmp_path):
    import hashlib

    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"abc")
    (folder / "sub" / "b.txt").write_bytes(b"")
    write_manifest(folder, {"format": 2, "step": 3, "fingerprint": "f"})
    manifest = read_manifest(folder)
    assert manifest["step"] == 3 and manifest["files"] == [
        {"path": "a.bin", "size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()},
        {"path": "sub/b.txt", "size": 0, "sha256": hashlib.sha256(b"").hexdigest()}]
    assert verify_manifest(folder, manifest) is None
    (folder / "a.bin").write_bytes(b"abd")
    assert verify_manifest(folder, manifest) == "a.bin sha256 differs from the manifest"
    (folder / "a.bin").write_bytes(b"ab")
    assert verify_manifest(folder, manifest) == "a.bin is 2 bytes, the manifest says 3"
    (folder / "a.bin").unlink()
    assert verify_manifest(folder, manifest) == "a.bin is missing"
    (folder / "manifest.json").unlink()
    with pytest.raises(ValueError, match="no manifest.json"):
        read_manifest(folder)


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_temp_names_are_unique_and_only_dead_writers_temps_are_swept(tmp_path, caplog):
    out = tmp_path / "models" / "sft"
    out.parent.mkdir(parents=True)
    a, b = temp_sibling(out), temp_sibling(out)
    assert a != b and a.name.startswith(f".sft.tmp-{os.getpid()}-")
    dead, live = _dead_pid(), os.getppid()
    for name in (f".sft.tmp-{dead}-0badc0de", f".sft.tmp-{dead}", f".sft.tmp-{live}-12345678",
                 f".other.tmp-{dead}-0badc0de"):
        (out.parent / name).mkdir()
        (out.parent / name / "model.safetensors").write_bytes(b"half")
    moved_aside = out.parent / f".sft.old-{dead}-0badc0de"  # killed between moving the old output aside and renaming
    moved_aside.mkdir()
    (moved_aside / "alignflow.json").write_text(json.dumps({"stage": "sft"}))
    with caplog.at_level(logging.WARNING):
        swept = sweep_temps(out.parent, lambda name: name == "sft")
    assert sorted(p.name for p in swept) == sorted([f".sft.tmp-{dead}-0badc0de", f".sft.tmp-{dead}",
                                                    moved_aside.name])
    left = sorted(p.name for p in out.parent.iterdir())
    assert left == sorted(["sft", f".sft.tmp-{live}-12345678", f".other.tmp-{dead}-0badc0de"]), left
    assert json.loads((out / "alignflow.json").read_text()) == {"stage": "sft"}  # the previous output, restored
    assert "restored" in caplog.text and "swept 3 stale temp" in caplog.text
