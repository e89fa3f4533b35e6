"""Padding-free micro-batches: per-sequence sums and pooling of packed rows, and token-budget grouping.

Hand-derived: each expected value is worked out in the test's docstring.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.data.tokenize import TokenizedExample, collate_packed, collate_padded, collate_pair_tree
from rlhf_core.algorithms.logprobs import response_token_counts, sequence_sums
from rlhf_core.algorithms.losses import segment_ids, segment_last_index, segment_sums
from rlhf_core.data.tokenize import group_by_tokens
from rlhf_core.trainers.batches import EmptyMicroBatch, real_tokens


def test_segment_ids_number_sequences_row_major():
    """Positions [[0,1,2,0,1],[0,1,0,1,2]]: sequences start at each 0, numbered across rows:
    [[0,0,0,1,1],[2,2,3,3,3]]."""
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    assert segment_ids(pos).tolist() == [[0, 0, 0, 1, 1], [2, 2, 3, 3, 3]]


def test_segment_sums_add_each_value_to_the_sequence_of_the_token_it_predicts():
    """One row, sequences of 3 and 2 tokens (positions 0 1 2 0 1). values[t] predicts token t+1, whose
    sequences are [0, 0, 1, 1]: S_0 = 1 + 2 = 3, S_1 = 4 + 8 = 12 (4 predicts sequence 1's first token
    from sequence 0's last; callers mask it, here it is kept to show where it lands).
    The gradient of S_0 + 2 S_1 is [1, 1, 2, 2]."""
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    values = torch.tensor([[1.0, 2.0, 4.0, 8.0]], requires_grad=True)
    sums = segment_sums(values, pos)
    assert sums.tolist() == [3.0, 12.0]
    (sums[0] + 2 * sums[1]).backward()
    assert values.grad.tolist() == [[1.0, 1.0, 2.0, 2.0]]


def test_sequence_sums_of_a_padded_batch_are_row_sums():
    """No position ids, an attention mask: one sequence per row, [1+2, 3+4] = [3, 7]."""
    batch = {"attention_mask": torch.ones(2, 3), "input_ids": torch.zeros(2, 3)}
    assert sequence_sums(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), batch).tolist() == [3.0, 7.0]


def test_packed_and_padded_collation_count_the_same_response_tokens():
    """Labels [-100, 5, 6] and [-100, -100, 7, 8]: 2 and 2 next-token targets, padded or packed
    (packing also ignores each sequence's first label, which is -100 here anyway)."""
    exs = [TokenizedExample([1, 5, 6], [-100, 5, 6]), TokenizedExample([2, 3, 7, 8], [-100, -100, 7, 8])]
    assert response_token_counts(collate_padded(exs, 0)).tolist() == [2, 2]
    assert response_token_counts(collate_packed(exs)).tolist() == [2, 2]


def test_segment_last_index_reads_the_last_non_pad_token_of_each_sequence():
    """Row [a b P | c P P | d] with P the pad (9), positions 0 1 2 0 1 2 0: transformers' rule (rightmost
    non-pad token) gives flat indices 1 (b), 3 (c), 6 (d); a sequence of pads only falls back to its
    first token, like transformers' argmax over an all-zero row: [P P] at 7 -> 7."""
    ids = torch.tensor([[1, 2, 9, 3, 9, 9, 4, 9, 9]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 0, 1]])
    assert segment_last_index(pos, ids != 9).tolist() == [1, 3, 6, 7]


def test_group_by_tokens_first_fit_decreasing():
    """Lengths [3, 7, 5, 2, 5] in bins of 10. Decreasing, ties by position: 7(1), 5(2), 5(4), 3(0), 2(3).
    7 opens bin A (room 3); 5 opens B (room 5); 5 fits B (room 0); 3 fits A (room 0); 2 opens C.
    Bins in opening order, positions sorted: [[0, 1], [2, 4], [3]]."""
    assert group_by_tokens([3, 7, 5, 2, 5], 10) == [[0, 1], [2, 4], [3]]


def test_group_by_tokens_respects_the_budget_and_isolates_long_examples():
    """Random lengths: every example lands in exactly one bin, every bin of two or more fits the budget,
    an example over the budget is alone, the grouping repeats (a function of the lengths alone), and
    at most one bin is half full or less."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (200,), generator=gen).tolist()
    groups = group_by_tokens(lengths, 50)
    assert sorted(i for g in groups for i in g) == list(range(200))
    for g in groups:
        assert sum(lengths[i] for i in g) <= 50 or len(g) == 1
        assert len(g) == 1 or all(lengths[i] <= 50 for i in g)
    assert group_by_tokens(lengths, 50) == groups
    # first fit never leaves two bins half empty (the later one's items would have fitted the earlier)
    assert sum(sum(lengths[i] for i in g) <= 25 for g in groups) <= 1


def test_real_tokens_count_no_padding():
    """Padded rows of 3 and 1 tokens (width 3): 4 real tokens, not 6; packed: all 4; an empty micro-batch: 0."""
    exs = [TokenizedExample([1, 2, 3], [-100, 2, 3]), TokenizedExample([4], [4])]
    assert real_tokens(collate_padded(exs, 0)) == 4
    assert real_tokens(collate_packed(exs)) == 4
    assert real_tokens(EmptyMicroBatch(torch.zeros(1, 1, dtype=torch.long))) == 0


@pytest.mark.parametrize("budget", [1, 4])
def test_group_by_tokens_gives_each_oversized_example_its_own_bin(budget):
    """Every length exceeds a budget of 1; with 4, [5] and [6] are alone and 2 + 2 share: FFD order 6, 5, 2, 2."""
    groups = group_by_tokens([2, 5, 2, 6], budget)
    assert groups == ([[3], [1], [0], [2]] if budget == 1 else [[3], [1], [0, 2]])


def test_prefix_tree_lays_each_prompt_out_once_with_its_responses():
    """Prompt width 2, responses 2 wide. Row 0: prompt [5 6], response [7 8]; row 1: prompt [pad 9], response
    [10 pad]; row 2: prompt [5 6], response [11 pad]; row 3: prompt [pad 4], response [12 pad]. Distinct prompts
    sort as [0 4 | 0 1] < [0 9 | 0 1] < [5 6 | 1 1]: groups g0 = [4 12], g1 = [9 10], g2 = [5 6 7 8 11] (the prompt,
    then row 0's response, then row 2's). Tree rows are as long as the longest group, L = 5; first-fit decreasing
    puts g2 in row 0 and g0, g1 together in row 1 (starts 0, 5, 7 flat): [[5 6 7 8 11], [4 12 9 10 pad]].
    Positions are the rows' own: [0 1 2 3 2] and [0 1 0 1 .]. Row 2's token 11 sees its prompt (columns 0-1) and
    itself, not row 0's tokens; g1's tokens do not see g0's in the same tree row; padding sees itself.
    Response column c is predicted by the row's last attended token before c, or by its prompt's last token
    (flat index): row 0 -> [1, 2], row 1 -> [7, 8] (column 1 is padding: its row's last token), row 2 -> [1, 4],
    row 3 -> [5, 6]. The last 5 - 1 + 1 = 5 columns hold every scored position (the shortest prompt: 1 token)."""
    from rlhf_core.trainers.rl_forward import prefix_tree

    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 0], [5, 6, 11, 0], [0, 4, 12, 0]])
    att = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 0]])
    exp = {"input_ids": ids, "attention_mask": att, "position_ids": (att.cumsum(1) - 1).clamp(min=0)}
    tree = prefix_tree(exp, 2)
    assert tree.input_ids.tolist() == [[5, 6, 7, 8, 11], [4, 12, 9, 10, 0]]
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 1, 0]]
    sees = [[[j for j in range(5) if tree.mask[b, 0, i, j]] for i in range(5)] for b in range(2)]
    assert sees[0] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 4]]
    assert sees[1] == [[0], [0, 1], [2], [2, 3], [4]]
    assert tree.scored.tolist() == [1, 2, 7, 8, 1, 4, 5, 6]
    assert tree.keep == 5


def test_prefix_tree_is_none_when_no_prompt_repeats():
    """Two rows with different prompts: nothing to share, the caller runs the padded rows."""
    from rlhf_core.trainers.rl_forward import prefix_tree

    ids = torch.tensor([[5, 6, 7], [5, 9, 7]])
    att = torch.ones_like(ids)
    assert prefix_tree({"input_ids": ids, "attention_mask": att, "position_ids": att.cumsum(1) - 1}, 2) is None


def _example(ids):
    return TokenizedExample(input_ids=list(ids), labels=list(ids))


def test_pair_tree_lays_out_shared_tokens_once_and_masks_each_answer_from_the_other():
    """Pair 0: chosen [5 6 7 8], rejected [5 6 9] share [5 6]: one group [5 6 | 7 8 | 9], 5 tokens, positions
    [0 1 2 3 2]. Pair 1: chosen [3 4], rejected [3 5] share [3]: [3 | 4 | 5], positions [0 1 1]. First-fit
    decreasing into rows of the longest group (5): pair 0 fills row 0, pair 1 takes row 1, padded by 2 (pad 0).
    Last tokens, flat (row * 5 + column): chosen 3 and 6, rejected 4 and 7. Row 0's rejected token 9 (column 4)
    sees columns 0, 1 (shared) and itself, not 7 8; row 1's padding (columns 3, 4) sees itself only."""
    pairs = [(_example([5, 6, 7, 8]), _example([5, 6, 9])), (_example([3, 4]), _example([3, 5]))]
    b = collate_pair_tree(pairs, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 5, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 2], [0, 1, 1, 0, 0]]
    assert b["last_index"].tolist() == [3, 6, 4, 7]
    assert int(b["n_pairs"]) == 2 and int(b["n_tokens"]) == 4 + 3 + 2 + 2
    mask = b["attention_mask"][:, 0].int().tolist()
    assert mask[0] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert mask[1] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]


def test_pair_tree_keeps_each_sequences_last_token_its_own():
    """Identical sequences [1 2 3] share [1 2] only, so each keeps its last token: [1 2 | 3 | 3]; a chosen
    [1 2] that is a prefix of the rejected [1 2 3] shares [1] and reads its score at its own 2."""
    b = collate_pair_tree([(_example([1, 2, 3]), _example([1, 2, 3]))], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 3]] and b["last_index"].tolist() == [2, 3]
    b = collate_pair_tree([(_example([1, 2]), _example([1, 2, 3]))], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 2, 3]] and b["position_ids"].tolist() == [[0, 1, 1, 2]]
    assert b["last_index"].tolist() == [1, 3]
