"""Tiny model: the chunked LM head gives today's log-probs, losses and gradients (``rlhf_core.models.lm_head``).

Today's path is the whole logits through ``rlhf_core.algorithms.losses.sequence_logprobs`` / ``token_nll_sum``
(or the ``full`` kernel in RL's ``token_logprobs``); the chunked path bypasses the model's head and
scores only the labelled positions, a few rows at a time. Upstream gradients are non-uniform
(per-row weights of both signs, as advantages are). Tolerance: 1e-5 absolute on log-probs, 1e-4
relative on gradients (fp32; only summation order differs).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.data.io import read_records
from rlhf_core.data.sequences import tokenize_sft_records
from rlhf_core.data.tokenize import collate_packed, collate_padded
from rlhf_core.models.lm_head import LMHead, labelled_token_logprobs
from rlhf_core.algorithms.logprobs import response_logprobs
from rlhf_core.algorithms.losses import sequence_logprobs, token_nll_sum
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, prepare_for_training
from rlhf_core.trainers.sft import nll_loss_fn

CHUNK = LMHead("chunked", 7)  # a chunk size that splits rows across chunks


def _examples(micro_model, micro_data, n=6):
    tok = load_tokenizer(micro_model)
    records = read_records(micro_data["sft"])[:n]
    return tok, tokenize_sft_records(tok, records, path=micro_data["sft"], prompt_field="prompt",
                                     completion_field="completion", messages_field="messages", max_length=48)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def _assert_grads_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-4, msg=name)


def test_sequence_logprobs_and_gradients_match_whole_logits(micro_model, micro_data):
    torch.manual_seed(0)
    tok, examples = _examples(micro_model, micro_data)
    model = load_causal_lm(micro_model, torch.device("cpu"))
    batch = collate_padded(examples, tok.pad_token_id)
    weights = torch.randn(len(examples)) * 2  # non-uniform upstream gradient, both signs

    reference = sequence_logprobs(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                  batch["labels"])
    (reference * weights).sum().backward()
    expected = _grads(model)
    # auto: whole logits of the scored positions, and past its size limit (0 bytes) the chunked fallback
    for head in (CHUNK, LMHead("chunked", 4096), LMHead("full"), LMHead("auto"), LMHead("auto", 7, whole_bytes=0)):
        got = response_logprobs(model, batch, head=head)
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
        (got * weights).sum().backward()
        _assert_grads_close(_grads(model), expected)


def test_sft_nll_chunked_equals_token_nll_sum_padded_and_packed(micro_model, micro_data):
    tok, examples = _examples(micro_model, micro_data)
    model = load_causal_lm(micro_model, torch.device("cpu"))
    padded = collate_padded(examples, tok.pad_token_id)
    nll, n = token_nll_sum(model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits,
                           padded["labels"])
    nll.backward()
    expected = _grads(model)
    for batch in (padded, collate_packed(examples)):
        got, count = nll_loss_fn(CHUNK)(model, batch)
        assert int(count) == int(n)
        torch.testing.assert_close(got, nll, atol=1e-4, rtol=1e-6)
        got.backward()
        _assert_grads_close(_grads(model), expected)


def test_per_token_logprobs_sit_on_the_labelled_columns(micro_model, micro_data):
    tok, examples = _examples(micro_model, micro_data, n=3)
    model = load_causal_lm(micro_model, torch.device("cpu"))
    batch = collate_padded(examples, tok.pad_token_id)
    with torch.no_grad():
        per_token = labelled_token_logprobs(model, batch, CHUNK)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    scored = labels != -100
    want = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    torch.testing.assert_close(per_token[scored], want[scored], atol=1e-5, rtol=0)
    assert torch.all(per_token[~scored] == 0)


def test_lora_model_through_the_bypassed_head(micro_model, micro_data):
    """peft wraps the model: the head bypass reaches the base model's head, LoRA gradients match."""
    tok, examples = _examples(micro_model, micro_data, n=4)
    torch.manual_seed(0)
    model = prepare_for_training(load_causal_lm(micro_model, torch.device("cpu")), lora_rank=4)
    for name, p in model.named_parameters():  # LoRA B starts at 0: give it values so A gets gradients too
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    batch = collate_padded(examples, tok.pad_token_id)
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])
    ref = sequence_logprobs(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                            batch["labels"])
    (ref * weights).sum().backward()
    expected = _grads(model)
    assert any("lora_A" in n for n in expected)
    got = response_logprobs(model, batch, head=CHUNK)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    (got * weights).sum().backward()
    _assert_grads_close(_grads(model), expected)
    assert model.get_output_embeddings() is not None and not isinstance(model.get_output_embeddings(),
                                                                        torch.nn.Identity)


def _rl_rows(micro_model, prompts: list[str], seed: int):
    """The micro model and 3 sampled rows a prompt of ``prompts``: ``(model, exp, prompt width, response mask)``."""
    from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams

    model = load_causal_lm(micro_model, torch.device("cpu")).eval()
    batch = HFGenerateEngine(model, load_tokenizer(micro_model)).generate(
        prompts, SamplingParams(n=3, max_new_tokens=6, seed=seed))
    exp = batch.learner_inputs()
    return model, exp, batch.prompt_ids.shape[1], batch.response_mask.float()


def _assert_rl_logprobs_agree(model, exp, p, mask, adv_seed: int, ways: list[dict]) -> None:
    """RL's response-token log-probs and entropies (temperature 0.7, the entropy with its gradient) and the
    gradients of an advantage-weighted loss agree between two ``token_logprobs`` keyword sets ``ways``."""
    from rlhf_core.trainers.rl_forward import token_logprobs

    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(adv_seed)) * mask
    results = []
    for way in ways:
        model.zero_grad()
        logp, entropy = token_logprobs(model, exp, p, 0.7, with_entropy=True, entropy_grad=True, **way)
        assert logp.shape == mask.shape
        ((logp * adv).sum() + 0.1 * (entropy * mask).sum()).backward()
        results.append((logp.detach() * mask, entropy.detach() * mask, _grads(model)))
    (lp0, e0, g0), (lp1, e1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(e1, e0, atol=1e-5, rtol=0)
    _assert_grads_close(g1, g0)


@pytest.mark.parametrize("share", [False, True], ids=["one-pass", "shared-prompts"])
def test_rl_token_logprobs_chunked_equal_full(micro_model, micro_data, share):
    """RL's response-token log-probs and entropies (temperature 0.7), chunked vs full logits, with
    advantage-weighted gradients, with and without prompts shared across a group."""
    model, exp, p, mask = _rl_rows(micro_model, ["12+30=", "7*8=", "sort 321="], seed=1)
    _assert_rl_logprobs_agree(model, exp, p, mask, 3, [dict(share_prompts=share, head=LMHead("full")),
                                                      dict(share_prompts=share, head=CHUNK)])


def test_no_grad_chunks_count_vocabulary_logits_only_where_the_model_makes_them(micro_model, micro_data):
    """A no-grad log-prob pass (reference, pi_old) is split by its largest transient: float32 logits
    ``R x V`` a row with the model's own head, the decoder's MLP projection ``width x 2I`` with a bypassed
    head, which bounds its own logits; any split gives the same log-probs."""
    from rlhf_core.trainers.rl_forward import _CHUNK_BYTES, Sharded, chunk_bytes_per_row, in_chunks, token_logprobs
    from rlhf_core.distributed.parallel import World

    model = load_causal_lm(micro_model, torch.device("cpu")).eval()
    cfg = model.config
    full = chunk_bytes_per_row(model, LMHead("full"), width=40, response_len=30)
    assert full == 30 * cfg.vocab_size * 4
    assert chunk_bytes_per_row(model, CHUNK, width=40, response_len=30) == 40 * 2 * cfg.intermediate_size * 4
    # 1.5B GRPO reference pass (512 rows, 19 + 256 tokens, V = 151,936, I = 8,960, bf16): 38 chunks by
    # the logits it never makes, 3 by its MLP projection
    logits_row, mlp_row = 256 * 151_936 * 4, 275 * 2 * 8_960 * 2
    assert Sharded(World(), 512, 512, logits_row).n_chunks == 38
    assert Sharded(World(), 512, 512, mlp_row).n_chunks == 3 == -(-512 * mlp_row // _CHUNK_BYTES)
    assert Sharded(World(), 512, 32, mlp_row).n_chunks == 16  # the micro-batch rows, where fewer

    model, exp, p, mask = _rl_rows(micro_model, ["12+30=", "7*8=", "sort 321=", "1+1="], seed=2)
    rows = torch.arange(len(mask))
    with torch.no_grad():
        by = {n: in_chunks(lambda e, w: token_logprobs(model, e, w, 1.0, share_prompts=True, head=CHUNK)[0],
                           exp, p, rows, n) * mask for n in (1, 3, 12)}
    torch.testing.assert_close(by[3], by[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(by[12], by[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", [LMHead("full"), CHUNK], ids=["full", "chunked"])
def test_rl_token_logprobs_packed_equal_padded(micro_model, micro_data, head):
    """``rl.packing``: the rows as one padding-free row (left-padded prompts of three lengths, responses
    of several) give the padded pass's log-probs, entropies and advantage-weighted gradients."""
    model, exp, p, mask = _rl_rows(micro_model, ["12+30=", "7*8=", "sort 321="], seed=4)
    assert (exp["attention_mask"] == 0).any(), "no padding: the test would not exercise packing"
    _assert_rl_logprobs_agree(model, exp, p, mask, 5, [dict(head=head), dict(head=head, packed=True)])


def test_rl_packed_layout_worked_out_ahead_gives_the_same_pass(micro_model, micro_data):
    """The policy update works out each micro-batch's packed layout before its first forward
    (``rl_forward.pack_rows``, so no micro-batch waits for the device): passing that layout gives the pass
    that works it out itself, and it holds one entry per attended token and one per response column."""
    from rlhf_core.trainers.rl_forward import pack_rows

    model, exp, p, mask = _rl_rows(micro_model, ["12+30=", "7*8=", "sort 321="], seed=6)
    rows = pack_rows(model, exp, p)
    assert rows.index.shape == (int(exp["attention_mask"].sum()),) and rows.positions.shape == (1, len(rows.index))
    assert rows.scored.shape == (mask.numel(),)
    _assert_rl_logprobs_agree(model, exp, p, mask, 7, [dict(head=CHUNK, packed=True), dict(head=CHUNK, packed=rows)])


def test_torch_rms_norm_gives_the_modules_values_and_gradients(micro_model, micro_data):
    """``lm_head.use_torch_rms_norm`` (torch's fused RMSNorm in place of the Llama-family module's, which
    ``apply_fused_kernels`` takes on a GPU): every norm routed, parameter names unchanged, and the same
    log-probs and gradients under a signed per-row upstream gradient (fp32: summation order only)."""
    from rlhf_core.models.lm_head import use_torch_rms_norm

    torch.manual_seed(0)
    tok, examples = _examples(micro_model, micro_data)
    batch = collate_padded(examples, tok.pad_token_id)
    weights = torch.randn(len(examples)) * 2
    results = []
    for routed in (False, True):
        model = load_causal_lm(micro_model, torch.device("cpu"))
        names = [n for n, _ in model.named_parameters()]
        if routed:
            assert use_torch_rms_norm(model) == 2 * model.config.num_hidden_layers + 1
            assert [n for n, _ in model.named_parameters()] == names
        logps = response_logprobs(model, batch, head=CHUNK)
        (logps * weights).sum().backward()
        results.append((logps.detach(), _grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
    _assert_grads_close(results[1][1], results[0][1])


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_rl_micro_batches_read_once_equal_the_micro_batch_by_micro_batch_reads(micro_model, micro_data, packing):
    """The policy update splits its mini-batch (``rl_forward.micro_batches``) from one read of the device: the
    micro-batches' rows and trimmed columns, prompt widths, packed layouts, loss units and the token count are
    exactly those of reading each micro-batch on its own (``by_length``, ``trim_padding``, ``aggregation_units``,
    ``pack_rows`` one by one, as the update did)."""
    from rlhf_core.algorithms.rl_math import LossAggregation, aggregation_units
    from rlhf_core.trainers.rl_forward import by_length, micro_batches, pack_rows, trim_padding

    model, exp, p, mask = _rl_rows(micro_model, ["12+30=", "7*8=", "sort 321=", "sort 90817="], seed=8)
    mb = {**exp, "mask": mask, "advantages": torch.randn(mask.shape) * mask}
    for agg in (LossAggregation.TOKEN_MEAN, LossAggregation("seq_mean_token_mean")):
        micro, packed, units, n_tok = micro_batches(model, mb, p, 3, agg, packing)
        chunks = torch.tensor_split(by_length(mb, torch.arange(len(mask)), p), 3)
        one_by_one = [trim_padding({k: v[c] for k, v in mb.items()}, p) for c in chunks]
        assert [w for _, w in micro] == [w for _, w in one_by_one]
        assert len({w for _, w in micro}) > 1 or len({m["input_ids"].shape[1] for m, _ in micro}) > 1
        for (m, _), (ref, _) in zip(micro, one_by_one):
            assert m.keys() == ref.keys() and all(torch.equal(m[k], ref[k]) for k in m)
        assert units == [float(aggregation_units(m["mask"], agg)) for m, _ in one_by_one]
        assert n_tok == float(mask.sum())
        for got, (m, width) in zip(packed, one_by_one):
            if not packing:
                assert got is False
                continue
            want = pack_rows(model, m, width)
            for field in ("index", "positions", "scored"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field
            assert got.forward_kwargs.keys() == want.forward_kwargs.keys()
