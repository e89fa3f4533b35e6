"""HF generate rollout engine on the micro model: layout, masks, sampling log-probs, seeding."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.engine import (HFGenerateEngine, RolloutBatch, RolloutEngine, SamplingParams,
                               response_mask_from_ids)

PROMPTS = ["12+30=", "sort 321=", "7*8=", "sort 90817="]


@pytest.fixture(scope="module")
def engine(micro_model) -> HFGenerateEngine:
    """The untrained micro model, nudged to say eos (+4 on its logit, ~20% a step) so rows end early."""
    model = load_causal_lm(micro_model, torch.device("cpu"))
    tokenizer = load_tokenizer(micro_model)
    bias = torch.zeros(model.config.vocab_size)
    bias[tokenizer.eos_token_id] = 4.0
    model.lm_head.register_forward_hook(lambda _mod, _inp, out: out + bias)
    # batch_size 3 over 4 prompts: two generate calls whose widths differ, stitched together
    return HFGenerateEngine(model, tokenizer, batch_size=3)


def forward_logprobs(model, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """``(B*n, R)`` log_softmax(logits / T) of the response tokens from one full forward pass."""
    ids, mask = batch.sequences()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=batch.position_ids()).logits.float()
    p = batch.prompt_ids.shape[1]
    # the logits at position t predict token t + 1
    logps = torch.log_softmax(logits[:, p - 1:-1] / temperature, dim=-1)
    return logps.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) * batch.response_mask


def test_shapes_groups_and_masks(engine):
    n = 3
    batch = engine.generate(PROMPTS, SamplingParams(n=n, temperature=1.0, max_new_tokens=12, seed=1))
    assert isinstance(engine, RolloutEngine) and engine.name == "hf"
    rows = len(PROMPTS) * n
    assert len(batch) == rows and batch.group_size == n
    assert batch.prompts == [p for p in PROMPTS for _ in range(n)]
    assert batch.prompt_ids.shape == batch.prompt_mask.shape and batch.prompt_ids.shape[0] == rows
    assert batch.response_ids.shape == batch.response_mask.shape == batch.sampling_logprobs.shape
    assert batch.response_ids.shape[0] == rows and batch.response_ids.shape[1] <= 12
    assert batch.sampling_logprobs.dtype == torch.float32 and batch.response_ids.dtype == torch.long

    tok = engine.tokenizer
    for i, prompt in enumerate(PROMPTS):
        want = tok(prompt, add_special_tokens=False)["input_ids"]
        for r in range(i * n, (i + 1) * n):  # the group of prompt i, left-padded
            real = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
            assert real == want
            assert batch.prompt_mask[r, -1] == 1

    eos, pad = tok.eos_token_id, tok.pad_token_id
    lengths = batch.response_lengths()
    assert (lengths < batch.response_ids.shape[1]).any()  # some rows stopped at eos
    for r in range(rows):
        ids, m, n_tok = batch.response_ids[r], batch.response_mask[r], int(lengths[r])
        assert m[:n_tok].all() and not m[n_tok:].any()  # one contiguous run from the start
        assert (ids[n_tok:] == pad).all() and (batch.sampling_logprobs[r, n_tok:] == 0).all()
        assert (batch.sampling_logprobs[r, :n_tok] <= 0).all()
        body = ids[:n_tok].tolist()
        assert eos not in body[:-1]  # the mask ends at the first eos
        if body[-1] != eos:
            assert n_tok == 12  # no eos: it ran to max_new_tokens
        assert batch.completions[r] == tok.decode(body, skip_special_tokens=True)

    ids, mask = batch.sequences()
    assert ids.shape == (rows, batch.prompt_ids.shape[1] + batch.response_ids.shape[1])
    assert torch.equal(mask.sum(-1), batch.prompt_mask.sum(-1) + lengths)


def test_mask_ends_at_first_eos():
    """eos = 9: the first row stops at column 1 (eos kept), the second never stops."""
    ids = torch.tensor([[5, 9, 9, 3], [1, 2, 3, 4]])
    assert response_mask_from_ids(ids, 9).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_logprobs_match_a_forward_pass(engine, temperature, top_p):
    """Recorded during generate == log_softmax(logits / T) of a separate fp32 forward pass.

    With top-p the nucleus is not renormalised: the log-prob is still the temperature-scaled
    full softmax, the quantity a trainer recomputes.
    """
    params = SamplingParams(n=2, temperature=temperature, top_p=top_p, max_new_tokens=10, seed=3)
    batch = engine.generate(PROMPTS, params)
    want = forward_logprobs(engine.model, batch, temperature)
    assert batch.response_mask.sum() > len(batch)  # more than one token per row was checked
    torch.testing.assert_close(batch.sampling_logprobs, want, atol=1e-4, rtol=0)


def test_model_generation_defaults_do_not_leak(engine):
    """A checkpoint's own sampling defaults (here a repetition penalty) must not change the distribution."""
    saved = engine.model.generation_config
    original = saved.repetition_penalty
    saved.repetition_penalty = 3.0
    try:
        batch = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=5))
        assert engine.model.generation_config is saved  # restored
        torch.testing.assert_close(batch.sampling_logprobs, forward_logprobs(engine.model, batch, 1.0),
                                   atol=1e-4, rtol=0)
    finally:
        saved.repetition_penalty = original


def test_same_seed_same_rollout_and_rng_untouched(engine):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=11)
    torch.manual_seed(123)
    a = engine.generate(PROMPTS, params)
    after_a = torch.rand(1)  # the trainer's RNG stream is not consumed by a seeded rollout
    torch.manual_seed(123)
    b = engine.generate(PROMPTS, params)
    assert torch.equal(torch.rand(1), after_a)
    assert a.completions == b.completions
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.sampling_logprobs, b.sampling_logprobs)
    c = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=12))
    assert not torch.equal(a.response_ids, c.response_ids) or a.response_ids.shape != c.response_ids.shape


def test_greedy_groups_are_identical(engine):
    batch = engine.generate(PROMPTS[:2], SamplingParams(n=3, temperature=0.0, max_new_tokens=8))
    assert batch.completions[0] == batch.completions[1] == batch.completions[2]
    torch.testing.assert_close(batch.sampling_logprobs, forward_logprobs(engine.model, batch, 1.0),
                               atol=1e-4, rtol=0)


def test_update_weights(engine, micro_model):
    engine.update_weights(engine.model)  # its own model: nothing to do
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    zeroed = {k: torch.zeros_like(v) for k, v in before.items()}
    try:
        engine.update_weights(zeroed)
        assert all((v == 0).all() for v in engine.model.state_dict().values())
        engine.update_weights(micro_model)  # back from the HF directory
        for k, v in engine.model.state_dict().items():
            assert torch.equal(v, before[k]), k
    finally:
        engine.model.load_state_dict(before)


def test_mixed_precision_samples_from_a_refreshed_low_precision_copy(micro_model):
    """With the trainer's autocast dtype (bf16 on a GPU) the engine samples from a bf16 copy of the
    policy; update_weights(policy) refreshes the copy after each optimizer step."""
    model = load_causal_lm(micro_model, torch.device("cpu"))
    eng = HFGenerateEngine(model, load_tokenizer(micro_model), batch_size=8, autocast_dtype=torch.bfloat16)
    assert eng.sampler is not None and next(eng.sampler.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the trainer's master weights stay fp32
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    batch = eng.generate(["12+30="], params)
    assert batch.sampling_logprobs.dtype == torch.float32 and torch.isfinite(batch.sampling_logprobs).all()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    assert not torch.equal(next(eng.sampler.parameters()).float(), next(model.parameters()).bfloat16().float())
    eng.update_weights(model)
    for mine, theirs in zip(eng.sampler.parameters(), model.parameters()):
        assert torch.equal(mine, theirs.to(torch.bfloat16))


@pytest.mark.parametrize("kwargs,field", [({"n": 0}, "n"), ({"temperature": -1.0}, "temperature"),
                                          ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
                                          ({"max_new_tokens": 0}, "max_new_tokens"), ({"seed": "x"}, "seed")])
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_rows_decode_in_one_batch_as_row_by_row(micro_tokenizer):
    """``decode_rows`` (one Rust ``decode_batch`` call for a fast tokenizer) gives ``decode(row,
    skip_special_tokens=True)``'s strings, special tokens and empty rows included; a tokenizer with the clean-up
    pass decodes row by row."""
    from rlhf_core.rollout.engine import decode_rows

    tok = load_tokenizer(micro_tokenizer)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, len(tok), (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(64)] + [[], [tok.eos_token_id, tok.pad_token_id, 5]]
    expected = [tok.decode(row, skip_special_tokens=True) for row in rows]
    assert decode_rows(rows, tok) == expected
    tok.clean_up_tokenization_spaces = True
    assert decode_rows(rows, tok) == [tok.decode(row, skip_special_tokens=True) for row in rows]
