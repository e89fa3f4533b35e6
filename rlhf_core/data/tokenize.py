"""Turn strings into token ids with loss masks, and batch them (padded or padding-free).

Two input shapes, both with the loss on the response only:

* a prompt and its completion (strings, already rendered for the tokenizer by
  :mod:`rlhf_core.data.formats` where they were a conversation): tokenized separately and
  joined (so the prompt's ids equal what generation later sees), the eos token closing the
  completion unless the rendered answer already ends its turn with it; labels are ``-100``
  on the prompt.
* ``messages`` (chat): rendered by :func:`rlhf_core.data.chat.render_chat` (the tokenizer's own
  chat template, or ``PLAIN_CHAT_TEMPLATE`` when it has none); labels are ``-100`` everywhere except the
  assistant turns (found by rendering each prefix, so any prefix-stable template works).

Records become these strings in :mod:`rlhf_core.data.sequences` (one reader per stage kind).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlhf_core.data.chat import render_chat

IGNORE_INDEX = -100


@dataclass
class TokenizedExample:
    """One training sequence: ids and labels of the same length (labels -100 where no loss)."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    # The collators below read these, made once per example: turning Python lists into tensors at every
    # step took 12.6 ms (padded) / 15.8 ms (packed) for 32 rows x 465 tokens on a 2-core host, 0.8 / 0.3 ms
    # now; on a GPU host it was a device gap between steps (BENCHMARKS.md, the step-gap profiles).
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


def tokenize_messages(tokenizer: Any, messages: Sequence[dict], max_length: int) -> TokenizedExample:
    """Render a chat and keep the loss on assistant turns only.

    For assistant turn ``i`` the loss span is the text between ``render(messages[:i],
    add_generation_prompt=True)`` and ``render(messages[:i+1])``; token offsets map that
    span to tokens. Raises ValueError when the template is not prefix-stable.
    """
    full = render_chat(tokenizer, list(messages), add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        before = render_chat(tokenizer, list(messages[:i]), add_generation_prompt=True) if i else ""
        upto = render_chat(tokenizer, list(messages[: i + 1]), add_generation_prompt=False)
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


def group_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Positions of ``lengths`` grouped into bins of at most ``budget`` tokens, first-fit decreasing.

    Longest first (ties: the earlier position), each into the first bin it fits, else a new one;
    an item longer than ``budget`` gets a bin of its own. FFD uses at most 11/9 OPT + 6/9 bins
    (Dosa 2007). Deterministic, a function of ``lengths`` alone, so a resumed run regroups its steps
    exactly. Each bin lists its positions in increasing order; bins come in the order they opened.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        k = next((b for b, free in enumerate(room) if lengths[i] <= free), None)
        if k is None:
            bins.append([])
            room.append(budget)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= lengths[i]
    return [sorted(b) for b in bins]


def collate_pairs(pairs: Sequence[tuple[TokenizedExample, TokenizedExample]], pad_id: int, *,
                  packed: bool = False) -> dict[str, torch.Tensor]:
    """``2B`` sequences: the B chosen ones, then the B rejected ones; padded rows, or one packed row."""
    sequences = [c for c, _ in pairs] + [r for _, r in pairs]
    batch = collate_packed(sequences) if packed else collate_padded(sequences, pad_id)
    batch["n_pairs"] = torch.tensor(len(pairs))
    return batch


def collate_pair_tree(pairs: Sequence[tuple[TokenizedExample, TokenizedExample]],
                      pad_id: int) -> dict[str, torch.Tensor]:
    """``B`` pairs as prefix trees: each pair's leading tokens common to both sequences once, then the chosen
    sequence's own tokens, then the rejected one's (each keeps at least its last token); pairs packed first-fit
    decreasing (:func:`group_by_tokens`) into rows as long as the longest pair.

    A pair's two sequences share their prompt (and often the first answer tokens): on the embedded preference
    data the shared tokens are 32% of a pair's, and padding both sequences to the batch's longest is another
    third of a padded batch. The outputs at every real position equal the padded rows' to rounding (a causal
    model's state at a token depends only on the tokens it attends to), with none of the padding computed.

    Keys: ``input_ids``, ``position_ids`` ``(rows, L)``: the tokens and their positions in their own sequence
    (the rejected tokens' continue from the shared prefix); ``attention_mask`` ``(rows, 1, L, L)`` bool: a token
    sees the earlier tokens of its own pair that are shared or of its own sequence, a padding token itself only
    (padding ends a row; a query with no key would be NaN); ``last_index`` ``(2B,)``: the flat position
    (``row * L + column``) of each sequence's last token, the B chosen then the B rejected; ``scored_positions``,
    ``scored_targets``, ``scored_sequence`` ``(N,)``: for every labelled token of every sequence (sequence ``i``
    of the 2B as in ``last_index``), the flat position whose output predicts it, the token, and ``i``, ordered
    by position (:func:`rlhf_core.algorithms.logprobs.response_logprobs`); ``n_pairs``; ``n_tokens``: the tokens of the 2B
    sequences, as the padded batch counts them. No ``labels``: shifted by one column they would pair the rejected
    answer's first token with the chosen answer's last, so a path reading them fails instead of scoring wrongly.
    """
    groups, lengths = [], []
    for c, r in pairs:
        a, b = c.input_ids, r.input_ids
        p = 0
        while p < min(len(a), len(b)) - 1 and a[p] == b[p]:
            p += 1
        groups.append((c, r, p))
        lengths.append(len(a) + len(b) - p)
    L = max(lengths)
    bins = group_by_tokens(lengths, L)
    ids = torch.full((len(bins), L), pad_id, dtype=torch.long)
    pos = torch.zeros((len(bins), L), dtype=torch.long)
    pair = torch.full((len(bins), L), -1, dtype=torch.long)  # the pair each column belongs to (-1: padding)
    side = torch.zeros((len(bins), L), dtype=torch.long)  # 0 shared, 1 chosen's own, 2 rejected's own
    last = torch.zeros(2 * len(pairs), dtype=torch.long)
    scored: list[torch.Tensor] = []  # per sequence: (flat predictor position, target, sequence) of its labelled tokens
    for row, members in enumerate(bins):
        at = 0
        for g in members:
            c, r, p = groups[g]
            na, nb = len(c), len(r)
            end = at + na + nb - p  # [at, at+p) shared, then chosen's own, then rejected's own
            ids[row, at:end] = torch.cat([c.ids_tensor, r.ids_tensor[p:]])
            pos[row, at:at + na] = torch.arange(na)
            pos[row, at + na:end] = torch.arange(p, nb)
            pair[row, at:end] = g
            side[row, at + p:at + na], side[row, at + na:end] = 1, 2
            last[g], last[len(pairs) + g] = row * L + at + na - 1, row * L + end - 1
            # token k of a sequence is predicted from the column of its token k - 1: the chosen's tokens sit at
            # at + j, the rejected's at at + j while shared (j < p), then after the chosen's own
            chosen_cols = at + torch.arange(na)
            rejected_cols = torch.cat([at + torch.arange(p), at + na + torch.arange(nb - p)])
            for seq, ex, cols in ((g, c, chosen_cols), (len(pairs) + g, r, rejected_cols)):
                k = (ex.labels_tensor[1:] != IGNORE_INDEX).nonzero().squeeze(1) + 1
                scored.append(torch.stack([row * L + cols[k - 1], ex.ids_tensor[k], torch.full_like(k, seq)]))
            at = end
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same_pair = (pair[:, :, None] == pair[:, None, :]) & (pair[:, None, :] >= 0)
    visible_side = (side[:, None, :] == 0) | (side[:, :, None] == side[:, None, :])
    mask = (causal & same_pair & visible_side) | torch.eye(L, dtype=torch.bool)
    flat = torch.cat(scored, dim=1)
    flat = flat[:, torch.argsort(flat[0], stable=True)]  # by position (a shared labelled token: twice, once a side)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask.unsqueeze(1),
            "last_index": last, "scored_positions": flat[0], "scored_targets": flat[1], "scored_sequence": flat[2],
            "n_pairs": torch.tensor(len(pairs)), "n_tokens": torch.tensor(sum(len(c) + len(r) for c, r, _ in groups))}


def collate_pair_batch(pairs: Sequence[tuple[TokenizedExample, TokenizedExample]], pad_id: int,
                       packed: bool) -> dict[str, torch.Tensor]:
    """A batch of pairs as the pair trainers (DPO, reward model) run it: one padding-free row (``packing: true``,
    the variable-length flash path on a GPU), else prefix trees (:func:`collate_pair_tree`: on the CPU benchmark a
    reward-model forward and backward of 32 pairs took 0.068 s against 0.127 s as padded rows)."""
    return collate_pairs(pairs, pad_id, packed=True) if packed else collate_pair_tree(pairs, pad_id)
