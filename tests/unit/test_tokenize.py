"""Tokenization: prompt and non-assistant tokens carry no loss; packing equals padding."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.data.io import Record
from rlhf_core.data.sequences import tokenize_sft_records
from rlhf_core.data.chat import PLAIN_CHAT_TEMPLATE
from rlhf_core.data.tokenize import (
    IGNORE_INDEX,
    collate_packed,
    collate_padded,
    tokenize_messages,
    tokenize_prompt_completion,
)
from rlhf_core.algorithms.losses import token_nll_sum
from rlhf_core.models.loading import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def tok(micro_model):
    return load_tokenizer(micro_model)


@pytest.mark.parametrize("text", ["12+34=46", "hello, world", "  spaces  and\ttabs\n", "ünïcødé ✓ 数学", ""])
def test_tokenizer_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_digits_are_single_tokens(tok):
    pieces = tok.convert_ids_to_tokens(tok("1234+56=", add_special_tokens=False)["input_ids"])
    assert pieces == ["1", "2", "3", "4", "+", "5", "6", "="]


def test_prompt_completion_masks_prompt(tok):
    """'12+34=' is 6 tokens: labels are -100 there, then '4','6',eos are learned."""
    ex = tokenize_prompt_completion(tok, "12+34=", "46", max_length=64)
    assert ex.labels[:6] == [IGNORE_INDEX] * 6
    assert ex.labels[6:] == ex.input_ids[6:]
    assert tok.decode(ex.input_ids[6:]) == "46" + tok.eos_token


def test_chat_loss_only_on_assistant_turns(tok):
    """With the plain template each assistant turn renders 'assistant: {content}{eos}\\n'; only
    '{content}{eos}\\n' of the two assistant turns is labelled, never system/user text."""
    assert tok.chat_template == PLAIN_CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "be exact"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": "7"},
    ]
    ex = tokenize_messages(tok, messages, max_length=256)
    learned = [t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE_INDEX]
    assert tok.decode(learned) == f"4{tok.eos_token}\n7{tok.eos_token}\n"
    masked_text = tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab == IGNORE_INDEX])
    assert "be exact" in masked_text and "2+2=" in masked_text and "3+4=" in masked_text


def test_non_assistant_turns_contribute_zero_loss(tok, micro_model):
    """Rewriting user/system content (same token count) leaves the loss unchanged when the
    logits for assistant tokens are held fixed: loss reads labels only where they are set."""
    messages = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    ex = tokenize_messages(tok, messages, max_length=64)
    labels = torch.tensor([ex.labels])
    logits = torch.randn(1, len(ex), len(tok))
    mask = torch.tensor(ex.labels[1:] + [IGNORE_INDEX]) == IGNORE_INDEX  # positions predicting masked tokens
    noisy = logits.clone()
    noisy[0, mask] += 50 * torch.randn_like(noisy[0, mask])
    assert torch.allclose(token_nll_sum(logits, labels)[0], token_nll_sum(noisy, labels)[0])


def test_records_dispatch_and_errors(tok, tmp_path):
    recs = [Record({"q": "1+1=", "a": "2"}, 1), Record({"messages": [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": "yo"}]}, 2)]
    out = tokenize_sft_records(tok, recs, path="x.jsonl", prompt_field="q", completion_field="a",
                               messages_field="messages", max_length=64)
    assert len(out) == 2
    with pytest.raises(ValueError, match=r"x.jsonl:5: field 'a': missing"):
        tokenize_sft_records(tok, [Record({"q": "1+1="}, 5)], path="x.jsonl", prompt_field="q",
                             completion_field="a", messages_field="messages", max_length=64)


def test_packed_batch_equals_padded_batch(tok, micro_model):
    """Padding-free packing (position ids restart per sequence) gives the padded batch's loss."""
    model = load_causal_lm(micro_model, torch.device("cpu")).eval()
    exs = [tokenize_prompt_completion(tok, p, c, 64) for p, c in [("12+34=", "46"), ("7*8=", "56"), ("99-1=", "98")]]
    padded = collate_padded(exs, tok.pad_token_id)
    packed = collate_packed(exs)
    with torch.no_grad():
        nll_pad, n_pad = token_nll_sum(model(input_ids=padded["input_ids"], use_cache=False,
                                             attention_mask=padded["attention_mask"]).logits, padded["labels"])
        nll_pack, n_pack = token_nll_sum(model(input_ids=packed["input_ids"], use_cache=False,
                                               position_ids=packed["position_ids"]).logits, packed["labels"])
    assert int(n_pad) == int(n_pack)
    assert torch.isclose(nll_pad, nll_pack, rtol=1e-4), (nll_pad, nll_pack)
