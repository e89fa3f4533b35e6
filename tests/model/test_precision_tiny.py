"""Precision regimes on the micro model (CPU): mixed and bf16 train, accumulate like one batch, resume exactly.

``precision: mixed`` trains a bf16 model whose fp32 masters the optimizer holds (rlhf_core/models/precision.py);
``bf16`` trains bf16 weights with fp32 AdamW moments. bf16 on a CPU is slow per flop, but the micro
model's steps take milliseconds. The last test runs two DDP ranks on real Ray (gloo).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import Recorder, stop_after
from rlhf_core.config import DPOConfig, SFTConfig
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.trainers.dpo import train_dpo
from rlhf_core.common.faults import InjectedFault
from rlhf_core.trainers.sft import train_sft


def _sft(micro_model, micro_data, root, **kw) -> SFTConfig:
    return SFTConfig(**{**dict(model_path=str(micro_model), train_file=str(micro_data["sft"]),
                               eval_file=str(micro_data["eval"]), output_dir=str(root / "out"),
                               checkpoint_dir=str(root / "ckpt"), max_steps=12, batch_size=16, lr=3e-3,
                               warmup_steps=2, eval_items=8, save_every=4, num_threads=1, log_every=1,
                               precision="mixed"), **kw})


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_sft_trains_under_each_regime(micro_model, micro_data, tmp_path, precision):
    """The loss falls and every weight moves; checkpoints hold the bf16 working weights (and, under mixed,
    fp32 masters by name that round to them); the final model is the fp32 masters under mixed and the
    bf16 weights under bf16."""
    start = load_file(str(micro_model / "model.safetensors"))
    sink = Recorder()
    result = train_sft(_sft(micro_model, micro_data, tmp_path, precision=precision, max_steps=8), sink,
                       show_progress=False)
    losses = sink.series("train/loss")
    print(f"{precision}: train/loss {[round(x, 4) for x in losses]}")
    assert losses[-1] < losses[0] - 0.3
    final = load_file(str(result.output_dir / "model.safetensors"))
    want = torch.float32 if precision == "mixed" else torch.bfloat16
    assert {v.dtype for v in final.values()} == {want}
    assert all(not torch.equal(final[k].float(), start[k].bfloat16().float()) for k in final)

    ckpt = tmp_path / "ckpt" / "step-0000008"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    optimizer = torch.load(ckpt / "trainer_state.pt", weights_only=True)["optimizer"]
    assert {v.dtype for v in optimizer["exp_avg"].values()} == {torch.float32}
    if precision == "mixed":
        masters = optimizer["master"]
        assert {v.dtype for v in masters.values()} == {torch.float32}
        assert all(torch.equal(masters[k].bfloat16(), weights[k]) for k in weights)
        assert all(torch.equal(masters[k], final[k]) for k in final)  # the last step's masters are the output
    else:
        assert "master" not in optimizer


def test_mixed_micro_batches_accumulate_like_one_batch(micro_model, micro_data, tmp_path):
    """grad_accum 2 x batch 4 against batch 8 under mixed (the same 8 rows per step): each step's loss agrees
    within 1e-3 relative (measured 4.6e-5; fp32 gives about 1e-7). Not bit-equal: the bf16 forward of a
    4-row micro-batch rounds differently from an 8-row one; the gradients add in fp32 either way."""
    one, two = Recorder(), Recorder()
    train_sft(_sft(micro_model, micro_data, tmp_path / "one", batch_size=8, max_steps=8, save_every=0), one,
              show_progress=False)
    train_sft(_sft(micro_model, micro_data, tmp_path / "two", batch_size=4, grad_accum=2, max_steps=8,
                   save_every=0), two, show_progress=False)
    la, lb = one.series("train/loss"), two.series("train/loss")
    gap = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
    print(f"mixed: batch 8 {la}; 2 x 4 {lb}; max relative gap {gap:.2e}")
    assert len(la) == len(lb) == 8 and gap <= 1e-3 and la[-1] < la[0]


def test_mixed_run_resumes_bit_identical(micro_model, micro_data, tmp_path, monkeypatch):
    """Stopped after step 9 (checkpoints at 4 and 8) and resumed: the final fp32 masters and every eval
    metric equal an uninterrupted run's. The masters come back from the checkpoint's "master" entry:
    restored from the bf16 weights alone, the run would continue from rounded weights."""
    whole = train_sft(_sft(micro_model, micro_data, tmp_path / "whole"), show_progress=False)
    cfg = _sft(micro_model, micro_data, tmp_path / "cut")
    stop_after("sft:9", train_sft, cfg, monkeypatch)
    sink = Recorder()
    resumed = train_sft(cfg, sink, show_progress=False)
    assert sink.series("checkpoint/resumed_from_step") == [8.0]
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(resumed.output_dir / "model.safetensors")
    for key, value in whole.metrics.items():
        if key.startswith(("eval/", "train/loss_final")):
            assert resumed.metrics[key] == value, key


def test_dpo_mixed_with_a_bf16_reference(micro_model, micro_data, tmp_path):
    """DPO under mixed: the reference loads in bf16 (the policy's compute dtype), so before any step the
    policy's log-ratios to it are exactly 0 (reward margin 0 at step 1's forward), and training
    separates chosen from rejected."""
    sink = Recorder()
    cfg = DPOConfig(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                    eval_file=str(micro_data["eval"]), output_dir=str(tmp_path / "out"),
                    checkpoint_dir=str(tmp_path / "ckpt"), max_steps=6, batch_size=8, lr=3e-3, warmup_steps=1,
                    eval_items=4, save_every=0, beta=0.5, num_threads=1, log_every=1, precision="mixed",
                    precompute_reference=False)
    train_dpo(cfg, sink, show_progress=False)
    margins = sink.series("train/reward_margin")
    assert margins[0] == 0.0 and margins[-1] > 0.0


def _ddp(micro_model, micro_data, folder, **kw) -> SFTConfig:
    base = dict(model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
                output_dir=str(folder / "out"), checkpoint_dir=str(folder / "ckpt"), max_steps=6, batch_size=8,
                grad_accum=2, lr=3e-3, warmup_steps=1, eval_items=4, num_threads=1, precision="mixed", log_every=1,
                save_every=2, keep_checkpoints=10, num_workers=2, parallel="ddp")
    return SFTConfig(**{**base, **kw})


# ZeRO-2 on DeepSpeed's CPU accelerator takes about 40 s here: in the default tier, the only one to run
# DeepSpeed's bf16 mode (the fp32 ZeRO cases of test_parallel*.py are in the slow tier). DDP (30 s) in the slow
# tier: two DDP ranks resume exactly in the default tier's test_rank_failure (a killed rank's retry).
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.slow), "zero2"])
def test_two_ranks_under_mixed_resume_exactly(ray_local, micro_model, micro_data, tmp_path, monkeypatch, parallel):
    """Two ranks under mixed: DDP (bf16 gradients accumulated under no_sync and all-reduced by DDP, cast into
    the fp32 masters at the step) or ZeRO-2 (DeepSpeed's bf16 mode, fp32 gradient accumulation). The
    loss falls and tracks one process's (fp32 accumulation by hooks) within 1e-3 relative (measured
    7e-5 for DDP); a run stopped after step 2 and resumed writes a step-4 checkpoint equal bit for bit
    (bf16 weights, fp32 masters and moments) to an uninterrupted run's. The final model is the fp32 masters."""
    from rlhf_core.trainers.ray_launcher import train_data_parallel

    def run(cfg, sink=None):
        return train_data_parallel(train_sft, cfg, sink, show_progress=False)

    def run_until(cfg, step):
        monkeypatch.setenv("ALIGNFLOW_FAULT", f"sft:{step}")
        with pytest.raises(Exception, match="fault injected after step"):
            run(cfg)
        monkeypatch.delenv("ALIGNFLOW_FAULT")

    a, b = (_ddp(micro_model, micro_data, tmp_path / name, parallel=parallel) for name in ("a", "b"))
    two, one = Recorder(), Recorder()
    finished = run(a, two)
    assert {v.dtype for v in load_file(str(finished.output_dir / "model.safetensors")).values()} == {torch.float32}
    train_sft(_ddp(micro_model, micro_data, tmp_path / "one", num_workers=1), one, show_progress=False)
    run_until(b, 2)
    run_until(b, 4)  # resumes at 2, writes its own step 4, stops
    lt, lo = two.series("train/loss"), one.series("train/loss")
    print(f"{parallel} mixed: 2 ranks {lt}; 1 process {lo}")
    assert lt[-1] < lt[0] and max(abs(x - y) / abs(y) for x, y in zip(lt, lo)) <= 1e-3

    def state(folder):
        ckpt = folder / "ckpt" / "step-0000004"
        return load_file(str(ckpt / "model.safetensors")), torch.load(ckpt / "trainer_state.pt", weights_only=True)

    (wa, sa), (wb, sb) = state(tmp_path / "a"), state(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = sa["optimizer"], sb["optimizer"]
    for key in ("master", "exp_avg", "exp_avg_sq", "step"):
        assert oa[key] and oa[key].keys() == ob[key].keys(), key
        assert all(torch.equal(oa[key][n], ob[key][n]) for n in oa[key]), key


def test_rl_gae_mixed_resumes_bit_identical(micro_model, micro_data, tmp_path, monkeypatch):
    """PPO with a critic under mixed (policy masters in the by-name optimizer state, the critic's in its
    torch state_dict; the bf16 policy samples itself and the reference scores in bf16): stopped after
    iteration 4 and resumed from the iteration-4 checkpoint, the saved fp32 policy equals an uninterrupted
    run's bit for bit, as do the rollout metrics."""
    from rlhf_core.config import RLConfig, build_config
    from rlhf_core.trainers.rl import train_rl

    reward = tmp_path / "length_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")

    def cfg(root):
        return build_config(RLConfig, "rl", {"model_path": str(micro_model),
                                             "prompts_file": str(micro_data["prompts"]),
                                             "eval_file": str(micro_data["eval"]), "output_dir": str(root / "out"),
                                             "checkpoint_dir": str(root / "ckpt"),
                                             "reward.function": f"{reward}:reward", "max_steps": 5,
                                             "rollout.prompts_per_step": 4, "rollout.group_size": 4,
                                             "rollout.max_new_tokens": 6, "batch_size": 64,
                                             "algorithm.mini_batch_size": 8, "micro_batch_size": 4, "lr": 3e-3,
                                             "warmup_steps": 0, "eval_items": 8, "algorithm.estimator": "gae",
                                             "kl.in_reward": True, "kl.estimator": "k1", "save_every": 2,
                                             "num_threads": 1, "precision": "mixed"})

    whole_sink, sink = Recorder(), Recorder()
    whole = train_rl(cfg(tmp_path / "whole"), whole_sink, show_progress=False)
    monkeypatch.setenv("ALIGNFLOW_FAULT", "rl:4")
    with pytest.raises(InjectedFault):
        train_rl(cfg(tmp_path / "cut"), show_progress=False)
    monkeypatch.delenv("ALIGNFLOW_FAULT")
    resumed = train_rl(cfg(tmp_path / "cut"), sink, show_progress=False)
    assert sink.series("checkpoint/resumed_from_step") == [4.0]
    final = load_file(str(resumed.output_dir / "model.safetensors"))
    assert {v.dtype for v in final.values()} == {torch.float32}
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(resumed.output_dir / "model.safetensors")
    assert whole_sink.series("rollout/reward_mean")[-1] == sink.series("rollout/reward_mean")[-1]
