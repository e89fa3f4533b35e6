"""What each training stage trains on: records read per stage kind, rendered, tokenized.

The glue between :mod:`rlhf_core.data.formats` (a file read per stage kind; a prompt and an answer
rendered for one tokenizer: a conversation with its chat template, standard text as it is) and
:mod:`rlhf_core.data.tokenize` (strings to ids with loss masks). A trainer calls one function here
per dataset and gets :class:`~rlhf_core.data.tokenize.TokenizedExample` sequences whose labels are
-100 everywhere but the answer: the assistant's turn, its end-of-turn marker included. Standard
(plain string) data takes exactly the path it took before chat formats existed, token for token.

:func:`rendered_rows` is the reviewer's view of the same sequences: the decoded text the model saw,
special tokens kept, and the decoded spans that carry loss. Every trainer returns a few of them and
the stage logs them as ``samples/rendered_examples.json`` (:func:`rlhf_core.stages.wrappers._train_stage`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from rlhf_core.data.formats import (PairExample, Text, check_messages, completion_text, is_conversational,
                                    prompt_text, read_completion_examples, read_pair_examples, read_prompt_examples)
from rlhf_core.data.io import DataError, Record
from rlhf_core.data.tokenize import IGNORE_INDEX, TokenizedExample, tokenize_messages, tokenize_prompt_completion
from rlhf_core.common.redact import redact_secrets

Pair = tuple[TokenizedExample, TokenizedExample]

SAMPLE_ROWS = 4
"""Training sequences a stage logs for a reviewer (the first of its file)."""
SAMPLE_CHARS = 2000
"""Each logged text is clipped to this many characters (a row may be a whole document)."""


def tokenize_completion(tokenizer: Any, prompt: Text, completion: Text, max_length: int) -> TokenizedExample:
    """``prompt + answer`` rendered for ``tokenizer`` (:func:`~rlhf_core.data.formats.prompt_text`,
    :func:`~rlhf_core.data.formats.completion_text`), the loss on the answer and its end of turn (eos)."""
    return tokenize_prompt_completion(tokenizer, prompt_text(tokenizer, prompt),
                                      completion_text(tokenizer, prompt, completion), max_length)


def _with_answer(ex: TokenizedExample, path: str | Path, line: int, max_length: int) -> TokenizedExample:
    if all(t == IGNORE_INDEX for t in ex.labels):
        raise DataError(path, line, f"no response tokens left after truncation to max_length={max_length}")
    return ex


def _chat(rec: Record, field: str, path: str | Path) -> list[dict]:
    messages = check_messages(rec.data[field], path, rec.line, field)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(path, rec.line, "no assistant turn to train on", field)
    return messages


def tokenize_sft_records(
    tokenizer: Any,
    records: Sequence[Record],
    *,
    path: str | Path,
    prompt_field: str,
    completion_field: str,
    messages_field: str,
    max_length: int,
) -> list[TokenizedExample]:
    """SFT / RAFT / distillation sequences: a ``messages_field`` chat (loss on every assistant turn,
    :func:`~rlhf_core.data.tokenize.tokenize_messages`), else a prompt-completion record, standard or
    conversational (loss on the completion)."""
    out: list[TokenizedExample] = []
    for rec in records:
        if messages_field in rec.data:
            ex = tokenize_messages(tokenizer, _chat(rec, messages_field, path), max_length)
        else:
            example = read_completion_examples([rec], path, prompt_field=prompt_field,
                                               completion_field=completion_field)[0]
            ex = tokenize_completion(tokenizer, example.prompt, example.completion, max_length)
        out.append(_with_answer(ex, path, rec.line, max_length))
    return out


def tokenize_labelled_prompts(tokenizer: Any, records: Sequence[Record], *, path: str | Path, prompt_field: str,
                              label_field: str, max_length: int) -> list[TokenizedExample]:
    """Held-out sequences for an eval loss: each prompt answered by its label (for a conversation, the
    label as one assistant message, so the loss covers the end-of-turn marker as in training)."""
    out: list[TokenizedExample] = []
    for example in read_prompt_examples(records, path, prompt_field=prompt_field, label_field=label_field):
        if example.label is None:
            raise DataError(path, example.line, "missing", label_field)
        if not example.label.strip():
            raise DataError(path, example.line, "empty string", label_field)
        answer: Text = ([{"role": "assistant", "content": example.label}] if is_conversational(example.prompt)
                        else example.label)
        out.append(_with_answer(tokenize_completion(tokenizer, example.prompt, answer, max_length), path,
                                example.line, max_length))
    return out


def tokenize_pair_examples(tokenizer: Any, examples: Sequence[PairExample], max_length: int) -> list[Pair]:
    """``(chosen, rejected)`` sequences of each pair, the loss masks on the two answers."""
    return [(tokenize_completion(tokenizer, e.prompt, e.chosen, max_length),
             tokenize_completion(tokenizer, e.prompt, e.rejected, max_length)) for e in examples]


def tokenize_preference_records(tokenizer: Any, records: Sequence[Record], *, path: str | Path, prompt_field: str,
                                chosen_field: str, rejected_field: str, max_length: int,
                                margin_field: str = "margin") -> list[Pair]:
    """Preference records (explicit or implicit prompt, standard or conversational) as ``(chosen,
    rejected)`` sequences (:func:`~rlhf_core.data.formats.read_pair_examples`)."""
    examples = read_pair_examples(records, path, prompt_field=prompt_field, chosen_field=chosen_field,
                                  rejected_field=rejected_field, margin_field=margin_field)
    return tokenize_pair_examples(tokenizer, examples, max_length)


# --------------------------------------------------------------------------------------
# The rendered text the model saw, for a reviewer
# --------------------------------------------------------------------------------------


def _clip(text: str) -> str:
    return text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + f"... [{len(text) - SAMPLE_CHARS} chars]"


def loss_spans(example: TokenizedExample) -> list[list[int]]:
    """The runs of consecutive tokens that carry loss (label set), as token ids."""
    spans: list[list[int]] = []
    previous = False
    for token, label in zip(example.input_ids, example.labels):
        labelled = label != IGNORE_INDEX
        if labelled and not previous:
            spans.append([])
        if labelled:
            spans[-1].append(token)
        previous = labelled
    return spans


def rendered_row(tokenizer: Any, example: TokenizedExample) -> dict[str, Any]:
    """One sequence as the model saw it: ``text`` (decoded, special tokens kept), ``loss_spans`` (the decoded
    runs of tokens that carry loss), token counts. Clipped to :data:`SAMPLE_CHARS`, secrets redacted."""
    spans = loss_spans(example)
    return redact_secrets({
        "text": _clip(tokenizer.decode(example.input_ids, skip_special_tokens=False)),
        "loss_spans": [_clip(tokenizer.decode(s, skip_special_tokens=False)) for s in spans],
        "n_tokens": len(example), "n_loss_tokens": sum(len(s) for s in spans)})


def rendered_rows(tokenizer: Any, examples: Sequence[TokenizedExample], n: int = SAMPLE_ROWS) -> list[dict[str, Any]]:
    """:func:`rendered_row` of the first ``n`` sequences."""
    return [rendered_row(tokenizer, e) for e in examples[:n]]


def rendered_pair_rows(tokenizer: Any, pairs: Sequence[Pair], n: int = SAMPLE_ROWS, *,
                       scored: bool = False) -> list[dict[str, Any]]:
    """:func:`rendered_row` of the chosen and rejected sequence of the first ``n`` pairs; with ``scored``
    (a reward model) also the token each score is read at (the last)."""
    rows = []
    for chosen, rejected in pairs[:n]:
        row = {"chosen": rendered_row(tokenizer, chosen), "rejected": rendered_row(tokenizer, rejected)}
        if scored:
            for key, seq in (("chosen", chosen), ("rejected", rejected)):
                row[key]["scored_token"] = tokenizer.decode(seq.input_ids[-1:], skip_special_tokens=False)
        rows.append(row)
    return rows
