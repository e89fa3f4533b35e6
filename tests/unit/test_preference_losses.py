"""Hand-derived checks of the reward-model, DPO-family, KTO and distillation losses."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.algorithms.losses import (
    IGNORE_INDEX,
    PreferenceLoss,
    bradley_terry_loss,
    distillation_loss,
    kto_loss,
    kto_reference_point,
    log_exp_loss,
    preference_loss,
)

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_bradley_terry_and_log_exp():
    """r_c=2, r_r=0: -log sigmoid(2) = log(1 + e^-2) = 0.126928.
    Margin 2: -log sigmoid(0) = ln 2 = 0.693147. Equal rewards: ln 2."""
    assert close(bradley_terry_loss(T([2.0, 1.0]), T([0.0, 1.0])), [0.126928, 0.693147])
    assert close(bradley_terry_loss(T([2.0]), T([0.0]), margin=T([2.0])), [0.693147])
    assert close(log_exp_loss(T([2.0, 1.0]), T([0.0, 1.0])), [0.126928, 0.693147])


def _pair(kind, beta, eps=0.0):
    """policy (c, r) = (-1, -3), reference (-2, -2): ratios +1 and -1, so h = 2."""
    return preference_loss(kind, T([-1.0]), T([-3.0]), T([-2.0]), T([-2.0]), beta=beta, label_smoothing=eps)


def test_dpo_hand_computed():
    """beta = 0.5: beta*h = 1 -> -log sigmoid(1) = 0.313262; rewards 0.5 * (+1, -1)."""
    out = _pair(PreferenceLoss.DPO, 0.5)
    assert close(out.losses, [0.313262])
    assert close(out.chosen_rewards, [0.5]) and close(out.rejected_rewards, [-0.5])


def test_equal_logps_give_ln2_for_dpo_and_cdpo():
    """h = 0: -(1-eps) log sigmoid(0) - eps log sigmoid(0) = ln 2 whatever eps."""
    for kind, eps in ((PreferenceLoss.DPO, 0.0), (PreferenceLoss.CDPO, 0.1)):
        out = preference_loss(kind, T([-2.0]), T([-2.0]), T([-2.0]), T([-2.0]), beta=0.1, label_smoothing=eps)
        assert close(out.losses, [math.log(2)])


def test_cdpo_label_smoothing():
    """eps = 0.2, beta*h = 1: 0.8 * 0.313262 + 0.2 * 1.313262 = 0.513262. eps = 0 equals DPO."""
    assert close(_pair(PreferenceLoss.CDPO, 0.5, 0.2).losses, [0.513262])
    assert close(_pair(PreferenceLoss.CDPO, 0.5, 0.0).losses, _pair(PreferenceLoss.DPO, 0.5).losses)
    with pytest.raises(ValueError, match="label_smoothing"):
        _pair(PreferenceLoss.CDPO, 0.5, 0.5)


def test_ipo_target_margin():
    """beta = tau = 0.25: target 1/(2 tau) = 2. h = 2 -> 0; h = 0 (equal) -> (0 - 2)^2 = 4."""
    assert close(_pair(PreferenceLoss.IPO, 0.25).losses, [0.0])
    out = preference_loss(PreferenceLoss.IPO, T([-1.0]), T([-1.0]), T([-1.0]), T([-1.0]), beta=0.25)
    assert close(out.losses, [4.0])
    assert all(k.needs_reference_model for k in PreferenceLoss)


def test_kto_all_desirable_and_mixed():
    """beta=1, z0=0.5. Desirable r=0.5 -> 1 - sigmoid(0) = 0.5; r=2.5 -> 1 - sigmoid(2) = 0.119203.
    Undesirable r=0.5 with lambda_U=2 -> 2 * (1 - sigmoid(0)) = 1.0."""
    z0 = T(0.5)
    all_good = kto_loss(T([0.5, 2.5]), T([0.0, 0.0]), T([True, True]), z0, beta=1.0)
    assert close(all_good, [0.5, 0.119203])
    mixed = kto_loss(T([0.5, 0.5]), T([0.0, 0.0]), T([True, False]), z0, beta=1.0, undesirable_weight=2.0)
    assert close(mixed, [0.5, 1.0])


def test_kto_reference_point_clamps_at_zero():
    """mean([0.2, -1.0]) = -0.4 -> clamped to 0; mean([1, 2]) = 1.5."""
    assert float(kto_reference_point(T([0.2, -1.0]), T([0.0, 0.0]))) == 0.0
    assert close(kto_reference_point(T([1.0, 2.0]), T([0.0, 0.0])), 1.5)


def test_distillation_kl_hand_computed():
    """V=2. Teacher logits [0, ln 3] -> p_T = [1/4, 3/4]; student uniform [1/2, 1/2].
    KL(T||S) = 1/4 ln(1/2) + 3/4 ln(3/2) = -0.173287 + 0.304099 = 0.130812 per token."""
    teacher = T([[0.0, math.log(3)]]).expand(1, 3, 2).clone()
    student = torch.zeros(1, 3, 2)
    labels = T([[IGNORE_INDEX, 1, 0]])
    assert close(distillation_loss(student, teacher, labels), 0.130812)
    assert close(distillation_loss(teacher, teacher, labels), 0.0)
    # nll_weight = 1 is plain NLL on the labels: uniform student -> ln 2
    assert close(distillation_loss(student, teacher, labels, nll_weight=1.0), math.log(2))
