"""Hand-derived checks of the pure loss math (each docstring shows the arithmetic)."""

from __future__ import annotations

import math

import torch

from rlhf_core.algorithms.losses import IGNORE_INDEX, sequence_logprobs, sft_loss, token_nll_sum


def test_token_nll_uniform_logits_counts_only_labelled_tokens():
    """Uniform logits over V=4: every labelled token costs ln 4.

    labels [-100, -100, 2, 3] shift to [-100, 2, 3]: 2 labelled tokens -> sum 2 ln 4 = 2.7726.
    """
    logits = torch.zeros(1, 4, 4)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 2, 3]])
    nll, n = token_nll_sum(logits, labels)
    assert int(n) == 2
    assert math.isclose(float(nll), 2 * math.log(4), rel_tol=1e-6)
    assert math.isclose(float(sft_loss(logits, labels)), math.log(4), rel_tol=1e-6)


def test_sequence_logprobs_hand_computed():
    """V=2, logits [0, ln 3] at each position: p(1) = 3/4, p(0) = 1/4.

    Sequence 0: labels [x, 1, 0] -> log(3/4) + log(1/4) = -0.2877 - 1.3863 = -1.6740.
    Sequence 1: labels [x, -100, 1] -> log(3/4) = -0.2877.
    """
    logits = torch.tensor([[0.0, math.log(3)]]).expand(2, 3, 2).clone()
    labels = torch.tensor([[IGNORE_INDEX, 1, 0], [IGNORE_INDEX, IGNORE_INDEX, 1]])
    got = sequence_logprobs(logits, labels)
    assert torch.allclose(got, torch.tensor([math.log(0.75) + math.log(0.25), math.log(0.75)]), atol=1e-6)


def test_prompt_positions_contribute_zero_loss_and_gradient():
    """Changing the logits that predict prompt tokens changes neither loss nor its gradient elsewhere.

    Positions 0..1 predict prompt tokens 1..2 (labels -100); only position 2 predicts a
    labelled token. Loss = -log softmax(logits[0, 2])[label].
    """
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 5, requires_grad=True)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 4]])
    loss = sft_loss(logits, labels)
    loss.backward()
    assert torch.count_nonzero(logits.grad[0, :2]) == 0
    assert torch.count_nonzero(logits.grad[0, 3]) == 0  # the last position predicts nothing
    expected = -torch.log_softmax(logits.detach()[0, 2], -1)[4]
    assert torch.isclose(loss.detach(), expected)
    perturbed = logits.detach().clone()
    perturbed[0, :2] += 100.0
    assert torch.isclose(sft_loss(perturbed, labels), loss.detach())


def test_all_ignored_gives_zero_not_nan():
    """No labelled token: sum 0, count 0, mean clamps the denominator to 1 -> 0, not NaN."""
    logits = torch.randn(2, 3, 4)
    labels = torch.full((2, 3), IGNORE_INDEX)
    assert float(sft_loss(logits, labels)) == 0.0
    assert torch.equal(sequence_logprobs(logits, labels), torch.zeros(2))
