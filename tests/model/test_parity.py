"""Parity mode (rl.rollout.parity, rlhf_core/models/parity.py): the engine's log-probs of sampled tokens equal the
trainer's recomputation bit for bit, and a sequence scores the same bits alone, in a batch of 64 and beside rows
that ended early. Without it they differ in the last bits (so the checks below do see a difference when there is
one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_core.config import ConfigError, RLConfig, build_config
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.models.parity import make_batch_invariant
from rlhf_core.trainers.rl import train_rl
from conftest import Recorder

REPO = Path(__file__).resolve().parents[2]


def _scored(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(rows, T-1)`` log-probs of each next token, positions counted from each row's first real token."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def _batch(vocab: int, rows: int = 64, width: int = 10, length: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (rows, width + length), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        pad = int(torch.randint(0, width - 2, (1,), generator=g))
        ids[r, :pad], mask[r, :pad] = 0, 0
    return ids, mask


@pytest.mark.parametrize("parity", [True, False])
def test_a_sequence_scores_the_same_bits_alone_in_a_batch_and_beside_rows_that_ended(micro_model, parity):
    model = load_causal_lm(micro_model, torch.device("cpu")).eval()
    if parity:
        make_batch_invariant(model, key_length=24)
    ids, mask = _batch(model.config.vocab_size)
    real = (mask[:, 1:] * mask[:, :-1]).bool()  # a real token predicted from a real token
    full = _scored(model, ids, mask)
    starts = [int(mask[r].argmax()) for r in range(len(ids))]
    alone = torch.cat([torch.nn.functional.pad(_scored(model, ids[r:r + 1, s:], mask[r:r + 1, s:]), (s, 0))
                       for r, s in enumerate(starts)])
    ended = mask.clone()
    ended[::2, 17:] = 0  # every other row finished after 7 response tokens
    early = _scored(model, ids, ended)
    kept = real & (ended[:, 1:] * ended[:, :-1]).bool()
    assert torch.equal(full[kept], early[kept])  # right padding leaves earlier positions alone either way
    if parity:
        assert torch.equal(full[real], alone[real])
    else:
        assert not torch.equal(full[real], alone[real])
        torch.testing.assert_close(full[real], alone[real], rtol=0, atol=1e-4)


def _cfg(micro_model, micro_data, tmp_path, reward, **overrides) -> RLConfig:
    values = {"model_path": str(micro_model), "prompts_file": str(micro_data["prompts"]),
              "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / "rl"),
              "checkpoint_dir": str(tmp_path / "ckpt"), "reward.function": reward, "max_steps": 3,
              "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6,
              "rollout.engine": "hf", "batch_size": 64, "algorithm.mini_batch_size": 8, "lr": 3e-3,
              "warmup_steps": 0, "eval_items": 8, "eval_at_start": False, "num_threads": 1, "save_every": 0}
    values.update(overrides)
    return build_config(RLConfig, "rl", values)


@pytest.mark.parametrize("mini_batch, lora_rank", [(8, 0), (16, 0), (8, 4)])
def test_grpo_with_parity_reads_a_mismatch_of_exactly_zero(micro_model, micro_data, tmp_path, length_reward,
                                                           mini_batch, lora_rank):
    """Three GRPO steps with the HF engine: every step's mean |engine - trainer| log-prob is 0.0 with parity, and
    above 0 without it (the same run otherwise). The trainer's side: the no-grad recomputation of the old log-probs
    (two mini-batches of 8 rows), or the update's own forward, with gradients (one mini-batch of all 16 rows: the
    trainer then skips the no-grad pass); and a LoRA policy, whose adapters are linear layers too."""
    seen = {}
    for parity in (True, False):
        sink = Recorder()
        train_rl(_cfg(micro_model, micro_data, tmp_path / str(parity), length_reward,
                      **{"rollout.parity": parity, "algorithm.mini_batch_size": mini_batch,
                         "lora_rank": lora_rank, "lora_alpha": 8.0}),
                 sink, show_progress=False)
        seen[parity] = sink.series("rollout/logprob_mismatch")
    assert seen[True] == [0.0, 0.0, 0.0]
    assert len(seen[False]) == 3 and all(v > 0 for v in seen[False])


@pytest.mark.parametrize("setting, message", [
    ({"rollout.engine": "vllm"}, "needs rollout.engine static or hf"),
    ({"packing": True}, "needs packing auto or false"),
    ({"distribution.placement": "colocated"}, "needs placement none"),
    ({"fused_kernels": "on"}, "fused_kernels: on and rollout.parity exclude each other"),
    ({"compile_layers": True}, "compile_layers: on and rollout.parity exclude each other"),
])
def test_parity_refuses_what_it_cannot_make_invariant(micro_model, micro_data, tmp_path, length_reward, setting,
                                                      message):
    with pytest.raises(ConfigError, match=message):
        _cfg(micro_model, micro_data, tmp_path, length_reward, **{"rollout.parity": True, **setting})


def test_parity_turns_the_kernels_the_engine_does_not_run_off(micro_model, micro_data, tmp_path, length_reward):
    """auto would compile the trainer's decoder layers and use liger's kernels on a GPU (on an H100 the mismatch then
    read 0.0092 with parity as without it): under parity both resolve to off; without it they stay auto."""
    on = _cfg(micro_model, micro_data, tmp_path, length_reward, **{"rollout.parity": True})
    assert (on.fused_kernels, on.compile_layers) == ("off", "off")
    off = _cfg(micro_model, micro_data, tmp_path, length_reward)
    assert (off.fused_kernels, off.compile_layers) == ("auto", "auto")


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_the_tool_task_with_parity_reads_a_mismatch_of_exactly_zero(tool_model, micro_data, tmp_path, engine):
    """Three GRPO steps of the tool task (the calculator environment, up to 3 turns, observations appended between
    the engine's turns, each turn a fresh prefill + decode of the static engine): every step's mean
    |engine - trainer| log-prob is 0.0 with parity, above 0 without."""
    env = str(REPO / "rlhf_core/rollout/tool_task.py")
    seen = {}
    for parity in (True, False):
        sink = Recorder()
        cfg = build_config(RLConfig, "rl", {
            "model_path": str(tool_model), "prompts_file": str(micro_data["prompts"]),
            "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / str(parity) / "rl"),
            "checkpoint_dir": str(tmp_path / str(parity) / "ckpt"), "reward.function": f"{env}:reward",
            "environment.spec": f"{env}:make_env", "environment.max_turns": 3,
            "environment.max_trajectory_tokens": 20, "rollout.max_new_tokens": 6, "max_steps": 3,
            "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.engine": engine, "batch_size": 64,
            "algorithm.mini_batch_size": 8, "lr": 3e-3, "warmup_steps": 0, "eval_items": 8,
            "eval_at_start": False, "num_threads": 1, "save_every": 0, "rollout.parity": parity})
        train_rl(cfg, sink, show_progress=False)
        seen[parity] = sink.series("rollout/logprob_mismatch")
        assert sink.series("rollout/observation_tokens")[0] > 0, "the environment answered between turns"
    assert seen[True] == [0.0, 0.0, 0.0]
    assert len(seen[False]) == 3 and all(v > 0 for v in seen[False])
