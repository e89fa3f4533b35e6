"""Stage sequences from records (data/sequences.py): standard text as before, a conversation rendered with
the template and its loss on the assistant's answer and end of turn only; the reviewer's rendered rows."""

from __future__ import annotations

import pytest

from rlhf_core.data.formats import completion_text, prompt_text
from rlhf_core.data.io import DataError, Record
from rlhf_core.data.sequences import (loss_spans, rendered_pair_rows, rendered_row, tokenize_labelled_prompts,
                                      tokenize_preference_records, tokenize_sft_records)
from rlhf_core.data.tokenize import IGNORE_INDEX, TokenizedExample, tokenize_prompt_completion
from rlhf_core.models.loading import load_tokenizer

USER = [{"role": "user", "content": "2+2="}]


@pytest.fixture(scope="module")
def tok(micro_model):
    return load_tokenizer(micro_model)  # no template of its own: the plain one


def test_a_chat_answer_ends_at_its_eos(tok):
    """The plain template renders an assistant turn 'assistant: 4<eos>\\n'; generation stops at eos, so the
    rendered answer is '4<eos>' and the newline after it carries no loss."""
    assert prompt_text(tok, USER) == "user: 2+2=\nassistant: "
    assert completion_text(tok, USER, [{"role": "assistant", "content": "4"}]) == "4" + tok.eos_token


def test_standard_records_tokenize_as_plain_prompt_completion(tok):
    recs = [Record({"prompt": "12+34=", "completion": "46"}, 1)]
    [ex] = tokenize_sft_records(tok, recs, path="x", prompt_field="prompt", completion_field="completion",
                                messages_field="messages", max_length=64)
    assert ex == tokenize_prompt_completion(tok, "12+34=", "46", 64)


def test_conversational_prompt_completion_masks_everything_but_the_answer(tok):
    """'user: 2+2=\\nassistant: ' carries no loss; '4' and eos do (eos once: the template's, no second)."""
    recs = [Record({"prompt": USER, "completion": [{"role": "assistant", "content": "4"}]}, 1)]
    [ex] = tokenize_sft_records(tok, recs, path="x", prompt_field="prompt", completion_field="completion",
                                messages_field="messages", max_length=64)
    assert tok.decode(ex.input_ids) == "user: 2+2=\nassistant: 4" + tok.eos_token
    assert [tok.decode(s) for s in loss_spans(ex)] == ["4" + tok.eos_token]


def test_implicit_and_explicit_pairs_give_the_same_sequences(tok):
    explicit = Record({"prompt": USER, "chosen": [{"role": "assistant", "content": "4"}],
                       "rejected": [{"role": "assistant", "content": "5"}]}, 1)
    implicit = Record({"chosen": USER + [{"role": "assistant", "content": "4"}],
                       "rejected": USER + [{"role": "assistant", "content": "5"}]}, 2)
    fields = dict(path="p", prompt_field="prompt", chosen_field="chosen", rejected_field="rejected", max_length=64)
    a, b = tokenize_preference_records(tok, [explicit, implicit], **fields)
    assert a == b
    rows = rendered_pair_rows(tok, [a], scored=True)
    assert rows[0]["chosen"]["loss_spans"] == ["4" + tok.eos_token]
    assert rows[0]["rejected"]["scored_token"] == tok.eos_token  # where the reward model reads its score


def test_an_eval_label_answers_its_prompt_in_the_prompts_form(tok):
    recs = [Record({"prompt": "2+2=", "label": "4"}, 1), Record({"prompt": USER, "label": 4}, 2)]
    plain, chat = tokenize_labelled_prompts(tok, recs, path="e", prompt_field="prompt", label_field="label",
                                            max_length=64)
    assert plain == tokenize_prompt_completion(tok, "2+2=", "4", 64)
    assert [tok.decode(s) for s in loss_spans(chat)] == ["4" + tok.eos_token]
    with pytest.raises(DataError, match=r"e:3: field 'label': missing"):
        tokenize_labelled_prompts(tok, [Record({"prompt": "1+1="}, 3)], path="e", prompt_field="prompt",
                                  label_field="label", max_length=64)


def test_rendered_row_shows_loss_spans_and_redacts_secrets(tok):
    """Two labelled runs separated by an unlabelled token are two spans; a credential in the text is
    scrubbed before the row can be logged."""
    ids = tok("a https://user:hunter22@host b", add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] + ids[1:3] + [IGNORE_INDEX] + ids[4:]
    row = rendered_row(tok, TokenizedExample(ids, labels))
    assert len(row["loss_spans"]) == 2 and row["n_loss_tokens"] == len(ids) - 2
    assert "hunter22" not in row["text"] and "***" in row["text"]
