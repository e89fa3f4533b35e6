"""Checkpoints resume exactly: a run stopped mid-way and resumed ends bit-identical to one that was not.

The stop is the loop's fault hook (``ALIGNFLOW_FAULT``, raised right after a step's checkpoint),
so these run in-process in seconds; tests/e2e/test_kill_resume.py does the same with SIGKILL.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rlhf_core.tracking.checkpoint import FORMAT_VERSION, Checkpointer, clear_checkpoints, load_weights, run_fingerprint
from rlhf_core.config import DPOConfig, RewardConfig, RLConfig, build_config, SFTConfig
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.trainers.dpo import train_dpo
from rlhf_core.common.faults import InjectedFault
from rlhf_core.trainers.offline import run_training
from rlhf_core.trainers.step import NonFiniteError
from rlhf_core.trainers.reward import train_reward_model
from rlhf_core.trainers.rl import train_rl
from rlhf_core.trainers.sft import train_sft
from conftest import Recorder, stop_after


def _sft(micro_model, micro_data, root, **kw) -> SFTConfig:
    return SFTConfig(**{**dict(model_path=str(micro_model), train_file=str(micro_data["sft"]),
                               eval_file=str(micro_data["eval"]), output_dir=str(root / "out"),
                               checkpoint_dir=str(root / "ckpt"), max_steps=12, batch_size=16, lr=3e-3,
                               warmup_steps=2, eval_every=5, eval_items=20, save_every=4, num_threads=1), **kw})


def _dpo(micro_model, micro_data, root, **kw) -> DPOConfig:
    return DPOConfig(**{**dict(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                               eval_file=str(micro_data["eval"]), output_dir=str(root / "out"),
                               checkpoint_dir=str(root / "ckpt"), max_steps=12, batch_size=8, lr=3e-3,
                               warmup_steps=2, eval_items=20, save_every=4, beta=0.5, num_threads=1), **kw})


def _reward(micro_model, micro_data, root, **kw) -> RewardConfig:
    return RewardConfig(**{**dict(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                                  eval_file="", output_dir=str(root / "out"), checkpoint_dir=str(root / "ckpt"),
                                  max_steps=12, batch_size=8, lr=3e-3, warmup_steps=2, save_every=4,
                                  num_threads=1), **kw})


def _rl(micro_model, micro_data, root, **kw) -> RLConfig:
    reward = root.parent / "length_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")
    return build_config(RLConfig, "rl", {**{**{"model_path": str(micro_model),
                                               "prompts_file": str(micro_data["prompts"]),
                              "eval_file": str(micro_data["eval"]), "output_dir": str(root / "out"),
                              "checkpoint_dir": str(root / "ckpt"), "reward.function": f"{reward}:reward",
                              "max_steps": 5,
                              "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6,
                              "batch_size": 64, "algorithm.mini_batch_size": 8,
                              "lr": 3e-3, "warmup_steps": 0, "eval_items": 8, "eval_at_start": True,
                              "kl.adaptive": True,
                              "kl.coef": 0.1, "log_rollouts_every": 1, "save_every": 2, "num_threads": 1}, **kw}})


TRAINERS = {
    "sft": (_sft, train_sft, 9),       # fails after step 9; checkpoints at 4 and 8 -> resumes at 8
    "dpo": (_dpo, train_dpo, 9),
    # packed micro-batches under a token budget: a step's grouping is a function of its examples
    "dpo-budget": (lambda *a, **kw: _dpo(*a, packing=True, micro_batch_tokens=40, grad_accum=2, **kw), train_dpo, 9),
    "reward": (_reward, train_reward_model, 10),
    "rl": (_rl, train_rl, 4),           # checkpoints at 2 and 4 -> resumes at iteration 4
}
DETERMINISTIC = ("eval/", "train/loss_final", "rollout/", "train/kl", "train/policy_loss", "reward/")


@pytest.mark.parametrize("stage", list(TRAINERS))
def test_interrupted_run_resumes_to_identical_result(stage, micro_model, micro_data, tmp_path, monkeypatch, caplog):
    make_cfg, train, fail_at = TRAINERS[stage]
    stage = stage.split("-")[0]  # the loop's name for it (the fault hook matches it)
    whole = train(make_cfg(micro_model, micro_data, tmp_path / "whole"), show_progress=False)
    # kept with the finished record until the stage has tracked the model (it clears them)
    assert (tmp_path / "whole" / "ckpt" / "finished.json").is_file()

    cfg = make_cfg(micro_model, micro_data, tmp_path / "cut")
    monkeypatch.setenv("ALIGNFLOW_FAULT", f"{stage}:{fail_at}")
    with pytest.raises(InjectedFault, match=f"{stage}: fault injected after step {fail_at}"):
        train(cfg, show_progress=False)
    kept = sorted(p.name for p in (tmp_path / "cut" / "ckpt").glob("step-*"))
    assert len(kept) == 2, kept  # keep_checkpoints=2 of the ones written so far
    monkeypatch.delenv("ALIGNFLOW_FAULT")

    sink = Recorder()
    with caplog.at_level(logging.WARNING):
        resumed = train(cfg, sink, show_progress=False)
    resumed_at = sink.series("checkpoint/resumed_from_step")
    assert resumed_at and resumed_at[0] > 0 and f"step-{int(resumed_at[0]):07d}" == kept[-1]
    assert "resuming from" in caplog.text
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(resumed.output_dir / "model.safetensors")
    for key, value in whole.metrics.items():
        if key.startswith(DETERMINISTIC):
            assert resumed.metrics[key] == value, key
    clear_checkpoints(cfg.checkpoint_dir)  # what the stage does once the model is tracked and registered
    assert not list((tmp_path / "cut" / "ckpt").glob("step-*"))
    assert not (tmp_path / "cut" / "ckpt" / "finished.json").exists()


def test_changed_config_starts_over(micro_model, micro_data, tmp_path, monkeypatch, caplog):
    """A checkpoint of another config (here another lr) is not resumed."""
    monkeypatch.setenv("ALIGNFLOW_FAULT", "sft:5")
    with pytest.raises(InjectedFault):
        train_sft(_sft(micro_model, micro_data, tmp_path), show_progress=False)
    monkeypatch.delenv("ALIGNFLOW_FAULT")
    sink = Recorder()
    with caplog.at_level(logging.WARNING):
        train_sft(_sft(micro_model, micro_data, tmp_path, lr=1e-3), sink, show_progress=False)
    assert not sink.series("checkpoint/resumed_from_step")
    assert "written by a run with another config" in caplog.text


def test_torn_checkpoint_is_skipped(micro_model, micro_data, tmp_path, monkeypatch, caplog):
    """The newest checkpoint's state file cut short: the previous one is used, with a warning."""
    cfg = _sft(micro_model, micro_data, tmp_path)
    stop_after("sft:9", train_sft, cfg, monkeypatch)
    newest = tmp_path / "ckpt" / "step-0000008" / "trainer_state.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    sink = Recorder()
    with caplog.at_level(logging.WARNING):
        train_sft(cfg, sink, show_progress=False)
    assert sink.series("checkpoint/resumed_from_step") == [4.0]
    assert "skipping torn checkpoint" in caplog.text and "step-0000008" in caplog.text


def test_checkpoint_state_loads_weights_only(micro_model, micro_data, tmp_path, monkeypatch):
    """trainer_state.pt holds tensors and plain values only (no pickled objects), weights in safetensors;
    a PPO checkpoint carries the critic, whose weights moved away from the backbone it started from."""
    from safetensors.torch import load_file

    cfg = _rl(micro_model, micro_data, tmp_path, **{"algorithm.estimator": "gae", "kl.in_reward": True,
                                                    "kl.estimator": "k1"})
    monkeypatch.setenv("ALIGNFLOW_FAULT", "rl:2")
    with pytest.raises(InjectedFault):
        train_rl(cfg, show_progress=False)
    ckpt = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg)).latest()
    assert ckpt is not None and ckpt.step == 2
    state = torch.load(ckpt.path / "trainer_state.pt", weights_only=True)
    assert {"optimizer", "scheduler", "rng", "objects", "loop", "fingerprint", "critic", "critic_optimizer",
            "critic_scheduler"} <= state.keys()
    assert {"sampler", "kl_controller", "update_generator"} <= state["objects"].keys()
    backbone = {k: v for k, v in load_file(str(micro_model / "model.safetensors")).items() if k.startswith("model.")}
    assert any(not torch.equal(v, state["critic"][k]) for k, v in backbone.items())
    assert state["objects"]["kl_controller"]["value"] != 0.1  # the adaptive beta moved and was saved
    assert not list(ckpt.path.glob("*.bin")) and (ckpt.path / "model.safetensors").exists()


def test_nan_loss_stops_at_that_step_with_last_checkpoint_intact(micro_model, micro_data, tmp_path):
    """The loss turns NaN at step 7: the stage stops there naming the step and the quantity; the
    step-4 checkpoint is intact and the weights were not touched by the bad step."""
    from rlhf_core.data.io import read_records
    from rlhf_core.data.sequences import tokenize_sft_records
    from rlhf_core.data.tokenize import collate_padded
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.models.lm_head import LMHead
    from rlhf_core.trainers.batches import EpochSampler, MicroBatches
    from rlhf_core.trainers.sft import nll_loss_fn

    cfg = _sft(micro_model, micro_data, tmp_path, max_steps=10)
    tokenizer = load_tokenizer(cfg.model_path)
    model = load_causal_lm(cfg.model_path, torch.device("cpu"))
    train = tokenize_sft_records(tokenizer, read_records(cfg.train_file), path=cfg.train_file,
                                 prompt_field="prompt", completion_field="completion", messages_field="messages",
                                 max_length=cfg.max_length)
    sampler = EpochSampler(len(train), cfg.batch_size, cfg.seed)
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        loss, n = nll_loss_fn(LMHead())(m, batch)
        return (loss * float("nan"), n) if calls["n"] == 7 else (loss, n)

    with pytest.raises(NonFiniteError, match=r"step 7: loss is nan \(micro-batch 0 on this rank, or another rank's\); "
                                             r"stopped before the optimizer step, the last checkpoint is intact"):
        run_training(cfg, "sft", model, tokenizer, sink=Recorder(), show_progress=False, state={"sampler": sampler},
                     batches=MicroBatches(draw=sampler.next, tokens=lambda i: len(train[i]),
                                          collate=lambda idx: collate_padded([train[i] for i in idx],
                                                                             tokenizer.pad_token_id)),
                     loss_fn=loss_fn, evaluate=lambda: ({}, []))
    ckpt = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg)).latest()
    assert ckpt is not None and ckpt.step == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    fresh = load_causal_lm(cfg.model_path, torch.device("cpu"))
    load_weights(fresh, ckpt.path)  # loadable, finite
    assert all(torch.isfinite(p).all() for p in fresh.parameters())
    assert not (tmp_path / "out").exists(), "no output model is written for a failed stage"


# --------------------------------------------------------------------------------------
# Durable checkpoints: a manifest verified at resume, stale temp folders swept
# --------------------------------------------------------------------------------------


def _dead_pid() -> int:
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_truncated_weights_are_skipped_and_the_resume_ends_like_an_uninterrupted_run(micro_model, micro_data, tmp_path,
                                                                                       monkeypatch, caplog):
    """The newest checkpoint's model.safetensors cut short (a copy or disk cut off): resume from the one
    before, with a warning naming the file and the sizes, to the uninterrupted run's final weights.
    Temp folders a killed run left (checkpoint and output, old and new naming) are swept by the resume."""
    whole = train_sft(_sft(micro_model, micro_data, tmp_path / "whole"), show_progress=False)
    cfg = _sft(micro_model, micro_data, tmp_path / "cut")
    stop_after("sft:9", train_sft, cfg, monkeypatch)
    weights = tmp_path / "cut" / "ckpt" / "step-0000008" / "model.safetensors"
    full = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:full // 2])
    dead = _dead_pid()
    stale = [tmp_path / "cut" / "ckpt" / f".step-0000012.tmp-{dead}-0badc0de", tmp_path / "cut" / "ckpt" / ".step-0000008.tmp-1",
             tmp_path / "cut" / f".out.tmp-{dead}-0badc0de", tmp_path / "cut" / f".out.old-{dead}"]
    for folder in stale:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half a model")

    sink = Recorder()
    with caplog.at_level(logging.WARNING):
        resumed = train_sft(cfg, sink, show_progress=False)
    assert sink.series("checkpoint/resumed_from_step") == [4.0]
    assert (f"skipping torn checkpoint {weights.parent}: model.safetensors is {full // 2} bytes, "
            f"the manifest says {full}") in caplog.text
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(resumed.output_dir / "model.safetensors")
    assert not [p for p in stale if p.exists()]
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == ["ckpt", "out"]


def test_a_checkpoint_that_differs_from_its_manifest_or_has_none_is_skipped(micro_model, micro_data, tmp_path,
                                                                          monkeypatch, caplog):
    """step 8: one byte of its weights flipped (same size); step 6: no manifest.json (torn before its
    last write, or written by an older version); step 4 is used. Each skip names the path and the cause."""
    cfg = _sft(micro_model, micro_data, tmp_path, save_every=2, keep_checkpoints=5)
    monkeypatch.setenv("ALIGNFLOW_FAULT", "sft:9")
    with pytest.raises(InjectedFault):
        train_sft(cfg, show_progress=False)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step-*")) == [f"step-{s:07d}" for s in (2, 4, 6, 8)]
    manifest = json.loads((ckpt / "step-0000008" / "manifest.json").read_text())
    assert {e["path"] for e in manifest["files"]} >= {"model.safetensors", "trainer_state.pt", "tokenizer.json"}
    assert manifest["fingerprint"] == run_fingerprint(cfg) and manifest["format"] == FORMAT_VERSION
    weights = ckpt / "step-0000008" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    (ckpt / "step-0000006" / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        found = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg), cfg.keep_checkpoints).latest()
    assert found is not None and found.step == 4
    assert f"skipping torn checkpoint {ckpt / 'step-0000008'}: model.safetensors sha256 differs" in caplog.text
    assert f"skipping torn checkpoint {ckpt / 'step-0000006'}: no manifest.json" in caplog.text
