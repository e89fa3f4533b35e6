"""Parity mode (rl.rollout.parity) with the static engine (rlhf_core/rollout/static.py): every sampled token's log-prob
is the same bits whether its sequence is decoded alone, in a batch of 64 or beside rows that finish early, and those
bits are the trainer's batch-invariant recomputation and the HF engine's; three GRPO steps read a mismatch of exactly
0. Without parity the same comparisons differ in the last bits (so the checks do see a difference when there is one).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.parity import make_batch_invariant
from rlhf_core.rollout import static
from rlhf_core.rollout.decode.decoder import Decoder
from rlhf_core.rollout.decode.settings import SETTINGS
from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
from rlhf_core.trainers.rl import train_rl
from rlhf_core.trainers.rl_forward import token_logprobs
from conftest import Recorder
from test_parity import _cfg
from test_rollout_static import _eos_biased

# 64 prompts of 3 to 13 characters: left padding of every width in one batch
PROMPTS = [f"sort {str(7 ** (i + 3))[:1 + i % 9]}=" if i % 2 else f"{i}+{i * 37 % 101}=" for i in range(64)]


def _trainer(model, batch, temperature: float, rows: int) -> torch.Tensor:
    """``(B, R)`` the trainer's log-probs of the batch's response tokens, scored in micro-batches of ``rows``."""
    exp = batch.learner_inputs()
    P = batch.prompt_ids.shape[1]
    with torch.no_grad():
        return torch.cat([token_logprobs(model, {k: v[s:s + rows] for k, v in exp.items()}, P, temperature,
                                         parity=True)[0] for s in range(0, len(batch), rows)])


def _responses(batch) -> list[tuple[list[int], list[float]]]:
    """Each row's response tokens and their log-probs, padding dropped."""
    return [(row[m.bool()].tolist(), logp[m.bool()].tolist())
            for row, logp, m in zip(batch.response_ids, batch.sampling_logprobs, batch.response_mask)]


@pytest.mark.parametrize("parity", [True, False])
def test_static_engine_logprobs_are_the_same_bits_alone_in_a_batch_and_in_the_trainer(micro_model, parity,
                                                                                      monkeypatch):
    """Greedy (the tokens then do not depend on each row's uniforms), 12 new tokens, the micro model nudged towards
    eos so rows end at different steps: the 64-row decode drops finished rows from its batch as it goes
    (``SETTINGS.compact_below``). A row decoded alone (no left padding, a batch of one; one of each prompt length and
    rows that end early or run to the budget) gives the same tokens and log-prob bits as in the batch; the trainer's recomputation (micro-batches of 64 and of 8) and the HF engine give
    those bits too, and the trainer those of rows sampled at temperature 0.7 with top-p 0.9."""
    monkeypatch.setattr(SETTINGS, "compact_below", 0.9)
    model, tok = _eos_biased(micro_model)
    with torch.no_grad():
        model.lm_head.bias[tok.eos_token_id] = 0.6  # rows end after 1 to 12 tokens
    if parity:
        make_batch_invariant(model, key_length=32)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=12)
    engine = static.StaticCacheEngine(model, tok, batch_size=64)
    batch = engine.generate(PROMPTS, params)
    lengths = batch.response_lengths()
    assert (lengths < 12).sum() >= 8 and (lengths == 12).sum() >= 8, "rows end at different steps"
    real = batch.response_mask.bool()
    if not parity:
        scored = _trainer(model, batch, 1.0, 64)
        assert not torch.equal(scored[real], batch.sampling_logprobs[real])
        torch.testing.assert_close(scored[real], batch.sampling_logprobs[real], rtol=0, atol=1e-4)
        return
    # alone (a batch of one each): the first prompt of every length, four rows that end early, four that run on
    first_of_length: dict[int, int] = {}
    for i, prompt in enumerate(PROMPTS):
        first_of_length.setdefault(len(prompt), i)
    picked = sorted(set(first_of_length.values()) | set((lengths < 12).nonzero()[:4, 0].tolist())
                    | set((lengths == 12).nonzero()[:4, 0].tolist()))
    alone = [r for i in picked for r in _responses(engine.generate([PROMPTS[i]], params))]
    assert alone == [_responses(batch)[i] for i in picked]
    for rows in (64, 8):
        assert torch.equal(_trainer(model, batch, 1.0, rows)[real], batch.sampling_logprobs[real])
    hf = HFGenerateEngine(model, tok, batch_size=64).generate(PROMPTS, params)
    assert torch.equal(hf.response_ids, batch.response_ids)
    assert torch.equal(hf.sampling_logprobs, batch.sampling_logprobs)
    sampled = engine.generate(PROMPTS[:16], SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=12,
                                                           seed=3))
    real = sampled.response_mask.bool()
    assert torch.equal(_trainer(model, sampled, 0.7, 8)[real], sampled.sampling_logprobs[real])


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_grpo_with_the_static_engine_and_parity_reads_a_mismatch_of_exactly_zero(micro_model, micro_data, tmp_path,
                                                                                 length_reward, lora_rank, monkeypatch):
    """Three GRPO steps with the static engine (eager decode on a CPU, rows compacted as they finish): every step's
    mean |engine - trainer| log-prob is 0.0 with parity, and above 0 without it (the same run otherwise); a LoRA
    policy too, whose adapters are linear layers run by peft's own modules in the decode."""
    built: list[bool] = []

    class Recorded(Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.parity)

    monkeypatch.setattr(static, "Decoder", Recorded)
    seen = {}
    for parity in (True, False):
        sink = Recorder()
        train_rl(_cfg(micro_model, micro_data, tmp_path / str(parity), length_reward,
                      **{"rollout.engine": "static", "rollout.parity": parity, "lora_rank": lora_rank,
                         "lora_alpha": 8.0}),
                 sink, show_progress=False)
        seen[parity] = sink.series("rollout/logprob_mismatch")
        assert built and set(built) == {parity}, "the static engine's decoder sampled"
        built.clear()
    assert seen[True] == [0.0, 0.0, 0.0]
    assert len(seen[False]) == 3 and all(v > 0 for v in seen[False])
