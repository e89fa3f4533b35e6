"""Turn strings into token ids with loss masks, and batch them (padded or padding-free).

Two input shapes, both with the loss on the response only:

* a prompt and its completion (strings, already rendered for the tokenizer by
  :mod:`rlhf_core.data.formats` where they were a conversation): tokenized separately and
  joined (so the prompt's ids equal what generation later sees), the eos token closing the
  completion unless the rendered answer already ends its turn with it; labels are ``-100``
  on the prompt.
* ``messages`` (chat): rendered with the tokenizer's own chat template, or
  ``PLAIN_CHAT_TEMPLATE`` when it has none; labels are ``-100`` everywhere except the
  assistant turns (found by rendering each prefix, so any prefix-stable template works).

Records become these strings in :mod:`rlhf_core.data.sequences` (one reader per stage kind).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

IGNORE_INDEX = -100

# Used when a tokenizer ships no chat template: plain text, no special tokens needed
# beyond eos, which ends every assistant turn so that generation knows where to stop.
# Newlines are Jinja expressions because transformers renders with trim_blocks=True,
# which would eat a literal newline after a block tag.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def ensure_chat_template(tokenizer: Any) -> Any:
    """Give ``tokenizer`` the plain template if it has none; return it."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return tokenizer


@dataclass
class TokenizedExample:
    """One training sequence: ids and labels of the same length (labels -100 where no loss)."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    # The collators below read these, made once per example: turning Python lists into tensors at every
    # step took 12.6 ms (padded) / 15.8 ms (packed) for 32 rows x 465 tokens on a 2-core host, 0.8 / 0.3 ms
    # now; on the H100 host it was a 10-17 ms device gap between steps (bench/results/prof_h100_0p5b_gaps.json).
    # The lists are never changed after tokenizing.
    @functools.cached_property
    def ids_tensor(self) -> torch.Tensor:
        """``input_ids`` as a ``(len,)`` long tensor."""
        return torch.tensor(self.input_ids, dtype=torch.long)

    @functools.cached_property
    def labels_tensor(self) -> torch.Tensor:
        """``labels`` as a ``(len,)`` long tensor."""
        return torch.tensor(self.labels, dtype=torch.long)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a raw prompt, exactly as training saw them (no special tokens added)."""
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def tokenize_prompt_completion(tokenizer: Any, prompt: str, completion: str, max_length: int) -> TokenizedExample:
    """``prompt + completion + eos`` with the loss on completion and eos only.

    A completion rendered by a chat template that already holds the eos token (its end of turn)
    gets no second one."""
    p_ids = encode_prompt(tokenizer, prompt)
    c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id not in c_ids:
        c_ids = c_ids + [tokenizer.eos_token_id]
    ids = (p_ids + c_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(p_ids) + c_ids)[:max_length]
    return TokenizedExample(ids, labels)


def _render(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_messages(tokenizer: Any, messages: Sequence[dict], max_length: int) -> TokenizedExample:
    """Render a chat and keep the loss on assistant turns only.

    For assistant turn ``i`` the loss span is the text between ``render(messages[:i],
    add_generation_prompt=True)`` and ``render(messages[:i+1])``; token offsets map that
    span to tokens. Raises ValueError when the template is not prefix-stable.
    """
    ensure_chat_template(tokenizer)
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not full.startswith(upto) or not upto.startswith(before):
            raise ValueError("chat template is not prefix-stable; cannot locate assistant turns")
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    labels = [
        tok if any(s <= start < e for s, e in spans) else IGNORE_INDEX
        for tok, (start, _end) in zip(ids, enc["offset_mapping"])
    ]
    return TokenizedExample(ids[:max_length], labels[:max_length])


# --------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------


def collate_padded(examples: Sequence[TokenizedExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, labels, attention_mask, each ``(batch, max_len)``."""
    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e)
        ids[i, :n] = e.ids_tensor
        labels[i, :n] = e.labels_tensor
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def collate_packed(examples: Sequence[TokenizedExample]) -> dict[str, torch.Tensor]:
    """Padding-free batch: all sequences in one row ``(1, total_len)``.

    ``position_ids`` restart at 0 for each sequence; transformers derives a block-diagonal
    causal mask from them, so sequences do not attend to each other. The first label of
    each sequence is ignored so that no sequence is trained to predict the next one.
    """
    lengths = torch.tensor([len(e) for e in examples], dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths  # each sequence's first column in the row
    labels = torch.cat([e.labels_tensor for e in examples])
    labels[starts[lengths > 0]] = IGNORE_INDEX
    positions = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
    return {
        "input_ids": torch.cat([e.ids_tensor for e in examples]).unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "position_ids": positions.unsqueeze(0),
    }


def collate_pairs(pairs: Sequence[tuple[TokenizedExample, TokenizedExample]], pad_id: int, *,
                  packed: bool = False) -> dict[str, torch.Tensor]:
    """``2B`` sequences: the B chosen ones, then the B rejected ones; padded rows, or one packed row."""
    sequences = [c for c, _ in pairs] + [r for _, r in pairs]
    batch = collate_packed(sequences) if packed else collate_padded(sequences, pad_id)
    batch["n_pairs"] = torch.tensor(len(pairs))
    return batch
