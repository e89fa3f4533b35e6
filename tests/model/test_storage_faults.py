"""Storage faults on real filesystems: a full tmpfs mid-run, a read-only mount, too little free space.

Each test mounts a small tmpfs of its own (``mount -t tmpfs``; needs root, as CI runs). Where
mounting is not permitted they skip, saying so, except under ``CI=true``, where they fail: a CI
that cannot run them must not report them as passed.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from rlhf_core.tracking.checkpoint import Checkpointer, StorageError, run_fingerprint
from rlhf_core.config import SFTConfig
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.trainers.loop import estimate_state_bytes, save_hf_dir
from rlhf_core.trainers.sft import train_sft
from conftest import Recorder

PAGE = 4096


@pytest.fixture()
def tmpfs(tmp_path):
    """``mount(name, size_bytes, read_only=False) -> Path``: a tmpfs of that size under ``tmp_path``."""
    mounted = []

    def mount(name: str, size: int, read_only: bool = False) -> os.PathLike:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            reason = f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); needs root"
            if os.environ.get("CI") == "true":
                pytest.fail(f"{reason} - CI=true: the storage-fault tests must run in CI")
            pytest.skip(reason)
        mounted.append(point)
        if read_only:
            (point / "ckpt").mkdir()
            subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False)


def _sft(micro_model, micro_data, out, ckpt, **kw) -> SFTConfig:
    return SFTConfig(**{**dict(model_path=str(micro_model), train_file=str(micro_data["sft"]),
                               eval_file=str(micro_data["eval"]), output_dir=str(out), checkpoint_dir=str(ckpt),
                               max_steps=12, batch_size=16, lr=3e-3, warmup_steps=2, eval_items=20, save_every=4,
                               log_every=1, keep_checkpoints=1, num_threads=1), **kw})


def _on_disk(folder) -> int:
    """Bytes a folder takes on a tmpfs: each file rounded up to whole pages."""
    return sum(-(-f.stat().st_size // PAGE) * PAGE for f in folder.rglob("*") if f.is_file())


def test_a_disk_that_fills_mid_run_is_a_permanent_error_with_the_last_checkpoint_intact(micro_model, micro_data,
                                                                                        tmp_path, tmpfs):
    """keep_checkpoints=1 on a tmpfs sized between one and two real checkpoints, and above the preflight's
    two estimated ones (weights + fp32 Adam moments; the estimate leaves out tokenizer and RNG state):
    training starts, step 4's checkpoint fits, step 8's does not while step 4's is still there (it is
    pruned only after the new one is durable). The run stops with StorageError (ENOSPC, naming the
    checkpoint), step 4 still verifies, no temp folder is left, and Prefect would not retry it."""
    from tasks.common import PERMANENT_ERRORS

    checkpoint_est, _ = estimate_state_bytes(load_causal_lm(micro_model, torch.device("cpu")))
    size = -(-(2 * checkpoint_est + 16 * PAGE) // PAGE) * PAGE
    disk = tmpfs("disk", size)
    cfg = _sft(micro_model, micro_data, tmp_path / "out", disk / "ckpt")
    sink = Recorder()
    with pytest.raises(StorageError) as err:
        train_sft(cfg, sink, show_progress=False)
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, PERMANENT_ERRORS)
    assert f"cannot write checkpoint {disk / 'ckpt' / 'step-0000008'}: No space left on device" in str(err.value)
    assert sink.steps("train/loss")[-1] == 8  # it trained until the failed save
    kept = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg), cfg.keep_checkpoints).latest()
    assert kept is not None and kept.step == 4
    assert sorted(p.name for p in (disk / "ckpt").iterdir()) == [".lock", "step-0000004"]  # temp removed
    assert _on_disk(kept.path) < size < 2 * _on_disk(kept.path)  # the premise: one checkpoint fits, two do not
    assert not (tmp_path / "out").exists()


def test_a_read_only_checkpoint_or_output_folder_is_refused_before_training(micro_model, micro_data, tmp_path, tmpfs):
    """A read-only mount (not chmod: root ignores permissions) for checkpoint_dir, then for output_dir:
    StorageError (EROFS) naming the folder, before any step ran."""
    ro = tmpfs("ro", 1 << 20, read_only=True)
    for out, ckpt, named in ((tmp_path / "out", ro / "ckpt", ro / "ckpt"),
                             (ro / "models" / "sft", tmp_path / "ckpt", ro / "models")):
        sink = Recorder()
        with pytest.raises(StorageError) as err:
            train_sft(_sft(micro_model, micro_data, out, ckpt), sink, show_progress=False)
        assert err.value.errno == errno.EROFS and str(named) in str(err.value)
        assert "read-only" in str(err.value) and not sink.series("train/loss")


def test_too_little_free_space_is_refused_before_training(micro_model, micro_data, tmp_path, tmpfs):
    """keep_checkpoints=2 needs three estimated checkpoints; a 256 KiB tmpfs holds under one: refused
    before training with the folder, the bytes needed and the bytes free."""
    checkpoint_est, _ = estimate_state_bytes(load_causal_lm(micro_model, torch.device("cpu")))
    small = tmpfs("small", 64 * PAGE)
    sink = Recorder()
    with pytest.raises(StorageError) as err:
        train_sft(_sft(micro_model, micro_data, tmp_path / "out", small / "ckpt", keep_checkpoints=2), sink,
                  show_progress=False)
    assert err.value.errno == errno.ENOSPC
    assert f"{small / 'ckpt'} has {64 * PAGE:,} bytes free; this run needs about {3 * checkpoint_est:,}" in str(err.value)
    assert not sink.series("train/loss")


def test_a_full_disk_during_the_final_save_keeps_the_previous_output(micro_model, tmp_path, tmpfs):
    """save_hf_dir onto a tmpfs with room for the previous output but not a second copy: safetensors'
    own ENOSPC becomes StorageError naming the output, the previous output is untouched, no temp is left."""
    model, tokenizer = load_causal_lm(micro_model, torch.device("cpu")), load_tokenizer(micro_model)
    disk = tmpfs("models", 48 * PAGE)
    save_hf_dir(model, tokenizer, disk / "sft", extra={"run": 1})
    before = sorted((p.name, p.read_bytes()) for p in (disk / "sft").iterdir())
    with pytest.raises(StorageError) as err:
        save_hf_dir(model, tokenizer, disk / "sft", extra={"run": 2})
    assert err.value.errno == errno.ENOSPC and f"cannot write the trained model to {disk / 'sft'}" in str(err.value)
    assert "(os error 28)" in str(err.value.__cause__)  # met by safetensors' Rust writer, not Python's
    assert sorted((p.name, p.read_bytes()) for p in (disk / "sft").iterdir()) == before
    assert [p.name for p in disk.iterdir()] == ["sft"]
