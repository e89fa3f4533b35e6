"""Hand-derived checks of the online-RL math in ``rlhf_core.algorithms.rl_math`` (each docstring shows the arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.algorithms.rl_math import (
    AdaptiveKLController,
    AdvantageEstimator,
    FixedKLController,
    KLEstimator,
    LossAggregation,
    PolicyObjective,
    aggregate_loss,
    cispo_policy_loss,
    clipped_policy_loss,
    clipped_value_loss,
    compute_advantages,
    discounted_returns,
    distill_advantages,
    dr_grpo_advantages,
    dynamic_sampling_keep,
    entropy_from_logits,
    explained_variance,
    gae,
    grpo_advantages,
    gspo_policy_loss,
    kl_penalty,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    policy_loss,
    reinforce_plus_plus,
    reverse_kl_token_rewards,
    rloo_advantages,
    token_level_rewards,
)


def T(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(a, b, atol=1e-5) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=atol)


# --------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------


def test_masked_mean_all_and_per_row():
    """x = [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [1, 0, 0]].
    All: (1 + 2 + 4) / 3 = 2.333333. Per row: [(1 + 2) / 2, 4 / 1] = [1.5, 4].
    A fully masked row gives 0 / max(0, 1) = 0, not NaN."""
    x = T([[1, 2, 3], [4, 5, 6]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    assert close(masked_mean(x, mask), 7 / 3)
    assert close(masked_mean(x, mask, dim=1), [1.5, 4.0])
    assert close(masked_mean(x, mask.bool(), dim=1), [1.5, 4.0])
    assert close(masked_mean(x, torch.zeros(2, 3), dim=1), [0.0, 0.0])


def test_masked_whiten_ignores_padding():
    """Valid [1, 2, 3] (padding value 100 ignored): mean 2, population var (1 + 0 + 1) / 3 = 2/3,
    std 0.816497 -> [-1.224745, 0, 1.224745], padding -> 0.
    shift_mean=False adds the mean back: [0.775255, 2, 3.224745, 0]."""
    x = T([[1, 2], [3, 100]])
    mask = T([[1, 1], [1, 0]])
    assert close(masked_whiten(x, mask), [[-1.224745, 0.0], [1.224745, 0.0]])
    assert close(masked_whiten(x, mask, shift_mean=False), [[0.775255, 2.0], [3.224745, 0.0]])


# --------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------


def test_aggregation_modes_differ_on_ragged_mask():
    """loss [[1, 2, 3], [4, 9, 9]] with mask [[1, 1, 1], [1, 0, 0]] (the 9s are padding).
    token_mean: (1 + 2 + 3 + 4) / 4 = 2.5.
    seq_mean_token_mean: (6/3 + 4/1) / 2 = (2 + 4) / 2 = 3.0.
    seq_mean_token_sum_norm, max_len 4: (6/4 + 4/4) / 2 = (1.5 + 1) / 2 = 1.25."""
    loss = T([[1, 2, 3], [4, 9, 9]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    assert close(aggregate_loss(loss, mask, LossAggregation.TOKEN_MEAN), 2.5)
    assert close(aggregate_loss(loss, mask, LossAggregation.SEQ_MEAN_TOKEN_MEAN), 3.0)
    assert close(aggregate_loss(loss, mask, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM, max_len=4), 1.25)
    assert close(aggregate_loss(loss, mask, "seq_mean_token_sum_norm", max_len=4), 1.25)


def test_aggregation_ignores_fully_masked_rows():
    """A third, fully masked row is not a sequence: seq_mean_token_mean stays (2 + 4) / 2 = 3.0,
    sum_norm stays 1.25 (not divided by 3 rows)."""
    loss = T([[1, 2, 3], [4, 9, 9], [7, 7, 7]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert close(aggregate_loss(loss, mask, "seq_mean_token_mean"), 3.0)
    assert close(aggregate_loss(loss, mask, "seq_mean_token_sum_norm", max_len=4), 1.25)


def test_aggregation_errors():
    """sum_norm without the generation budget, an unknown mode, and a shape mismatch are refused."""
    loss, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(loss, mask, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM)
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "sum")
    with pytest.raises(ValueError, match="shape"):
        aggregate_loss(loss, torch.ones(2, 4), "token_mean")
    assert LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM.needs_max_len
    assert not LossAggregation.TOKEN_MEAN.needs_max_len


# --------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------


def test_clip_higher_only_upper_bound_binds():
    """clip_low 0.2, clip_high 0.28 -> ratio range [0.8, 1.28]; A = +1 on every token.
    r = 1.25: inside, loss -1.25 (symmetric 0.2 would clip it to -1.2).
    r = 1.5:  upper bound binds, loss -min(1.5, 1.28) = -1.28, zero gradient.
    r = 0.5:  below 0.8 but for A > 0 the min picks r: loss -0.5 (the lower bound does not bind).
    token_mean = (-1.25 - 1.28 - 0.5) / 3 = -1.01; clip_frac = 1/3; ratio_mean = 3.25/3 = 1.083333.
    approx_kl = mean((r - 1) - ln r) = (0.026856 + 0.094535 + 0.193147) / 3 = 0.104846."""
    logprobs = torch.log(T([[1.25, 1.5, 0.5]])).requires_grad_()
    old = torch.zeros(1, 3)
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    loss, stats = clipped_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert close(loss, -1.01)
    assert close(stats.clip_frac, 1 / 3)
    assert close(stats.dual_clip_frac, 0.0)
    assert close(stats.ratio_mean, 3.25 / 3)
    assert close(stats.approx_kl, 0.104846)
    loss.backward()
    # d/dlogp of -r/3 is -r/3 where unclipped; exactly 0 at the clipped token
    assert close(logprobs.grad, [[-1.25 / 3, 0.0, -0.5 / 3]])
    symmetric, _ = clipped_policy_loss(logprobs.detach(), old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert close(symmetric, (-1.2 - 1.2 - 0.5) / 3)


def test_dual_clip_bounds_negative_advantage_only():
    """clip 0.2 (range [0.8, 1.2]), dual_clip c = 3.
    Token 1: A = -1, r = 5: PPO loss max(5, 1.2) = 5; dual bound c|A| = 3 -> 3 (dual clip binds).
    Token 2: A = +1, r = 5: PPO loss max(-5, -1.2) = -1.2 (PPO clip binds); dual not applied to A > 0.
    Token 3: A = -1, r = 2: max(2, 1.2) = 2 < 3, nothing binds.
    With dual clip: (3 - 1.2 + 2) / 3 = 1.266667; without: (5 - 1.2 + 2) / 3 = 1.933333.
    clip_frac = 1/3 (token 2), dual_clip_frac = 1/3 (token 1)."""
    logprobs = torch.log(T([[5.0, 5.0, 2.0]]))
    old = torch.zeros(1, 3)
    adv = T([[-1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, stats = clipped_policy_loss(logprobs, old, adv, mask, dual_clip=3.0)
    assert close(loss, 3.8 / 3)
    assert close(stats.clip_frac, 1 / 3) and close(stats.dual_clip_frac, 1 / 3)
    plain, plain_stats = clipped_policy_loss(logprobs, old, adv, mask)
    assert close(plain, 5.8 / 3)
    assert close(plain_stats.dual_clip_frac, 0.0)


def test_policy_loss_masks_padding_and_uses_aggregation():
    """Ratio 1 everywhere, A = 2 on valid tokens, garbage A = 50 on padding: per-token loss -2.
    mask [[1, 1], [1, 0]] -> token_mean -2; seq_mean_token_sum_norm with max_len 4:
    (-4/4 + -2/4) / 2 = -0.75. Padding moves no statistic: clip_frac 0, ratio_mean 1, approx_kl 0."""
    lp = torch.zeros(2, 2)
    adv = T([[2.0, 2.0], [2.0, 50.0]])
    mask = T([[1, 1], [1, 0]])
    loss, stats = clipped_policy_loss(lp, lp, adv, mask)
    assert close(loss, -2.0)
    assert close(stats.ratio_mean, 1.0) and close(stats.approx_kl, 0.0) and close(stats.clip_frac, 0.0)
    loss, _ = clipped_policy_loss(lp, lp, adv, mask, aggregation="seq_mean_token_sum_norm", max_len=4)
    assert close(loss, -0.75)


def test_policy_loss_argument_errors():
    """Bounds that make no sense are refused with a message naming the argument."""
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_low"):
        clipped_policy_loss(x, x, x, x, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        clipped_policy_loss(x, x, x, x, clip_high=-0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_policy_loss(x, x, x, x, dual_clip=1.0)
    with pytest.raises(ValueError, match="shape"):
        clipped_policy_loss(x, torch.zeros(1, 3), x, x)


def test_gspo_sequence_ratio_and_clipping():
    """GSPO's paper bounds: s in [1 - 3e-4, 1 + 4e-4] = [0.9997, 1.0004]; old log-probs 0, so log r = logp.
    Row 0: valid log ratios [0.1, -0.3] (the padding entry's 5.0 is left out of the mean): mean -0.1,
      s_0 = e^-0.1 = 0.904837; A = -1: l = max(-A s, -A clip(s)) = max(0.904837, 0.9997) = 0.9997 on both
      tokens: clipped, zero gradient.
    Row 1: log ratios [0.001, 0.003, 0.002], mean 0.002, s_1 = e^0.002 = 1.002002; A = -1:
      l = max(1.002002, 1.0004) = 1.002002 on all three tokens: not clipped.
    seq_mean_token_mean = (0.9997 + 1.002002) / 2 = 1.000851; token_mean = (2 x 0.9997 + 3 x 1.002002) / 5
    = 1.001081. clip_frac = 2/5 tokens; ratio_mean = (2 x 0.904837 + 3 x 1.002002) / 5 = 0.963136.
    approx_kl is per token: k3(x) = e^x - 1 - x = [0.005171, 0.040818] and [5.0e-7, 4.5e-6, 2.0e-6],
    sum 0.045996 / 5 = 0.009199.
    Gradient (seq_mean_token_mean): row 0 clipped -> 0; row 1: d(-A s_1t)/d logp_1t = -A s_1 = 1.002002,
    times 1/3 (row mean) x 1/2 (two rows) = 0.167000 on each of its tokens; padding 0."""
    logprobs = T([[0.1, -0.3, 5.0], [0.001, 0.003, 0.002]]).requires_grad_()
    old = torch.zeros(2, 3)
    adv = T([[-1.0, -1.0, 7.0], [-1.0, -1.0, -1.0]])
    mask = T([[1, 1, 0], [1, 1, 1]])
    loss, stats = gspo_policy_loss(logprobs, old, adv, mask, clip_low=3e-4, clip_high=4e-4,
                                   aggregation="seq_mean_token_mean")
    assert close(loss, 1.000851)
    assert close(stats.clip_frac, 0.4) and close(stats.dual_clip_frac, 0.0)
    assert close(stats.ratio_mean, 0.963136)
    assert close(stats.approx_kl, 0.009199)
    loss.backward()
    assert close(logprobs.grad, [[0.0, 0.0, 0.0], [0.167000, 0.167000, 0.167000]])
    tok, _ = gspo_policy_loss(logprobs.detach(), old, adv, mask, clip_low=3e-4, clip_high=4e-4,
                              aggregation="token_mean")
    assert close(tok, 1.001081)
    # PPO's 0.2 bound on the same sequence ratios never binds: why gspo has its own, ~1000x smaller, pair
    _, wide = gspo_policy_loss(logprobs.detach(), old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert close(wide.clip_frac, 0.0)


def test_gspo_token_gradient_equals_the_sequence_level_objective():
    """GSPO-token with one advantage per row and seq_mean_token_mean is GSPO (Eq. 5): the reference below
    computes s_i = exp(masked mean_t (logp - old)) with its full gradient and
    loss = -(1/G) sum_i min(s_i A_i, clip(s_i, 0.95, 1.05) A_i); d/d logp_it = -(1/G) s_i A_i / |y_i| on
    unclipped rows, which is what sg[s_i] * pi/sg[pi] gives token by token. Ragged mask, garbage padding,
    log ratios of +-0.1 so that some rows clip and some do not."""
    torch.manual_seed(0)
    old = torch.randn(6, 5) * 0.5 - 1
    logprobs = (old + torch.randn(6, 5) * 0.1).requires_grad_()
    mask = (torch.arange(5) < torch.tensor([5, 3, 1, 4, 2, 5]).unsqueeze(1)).float()
    adv_seq = torch.randn(6)
    adv = adv_seq.unsqueeze(1) * mask + (1 - mask) * 99.0  # padding garbage
    loss, stats = gspo_policy_loss(logprobs, old, adv, mask, clip_low=0.05, clip_high=0.05,
                                   aggregation="seq_mean_token_mean")
    (grad,) = torch.autograd.grad(loss, logprobs)

    ref_logp = logprobs.detach().clone().requires_grad_()
    s = torch.exp(((ref_logp - old) * mask).sum(-1) / mask.sum(-1))
    ref = -torch.minimum(s * adv_seq, s.clamp(0.95, 1.05) * adv_seq).mean()
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert 0 < float(stats.clip_frac) < 1  # both branches are exercised
    assert torch.allclose(loss, ref, atol=1e-6)
    assert torch.allclose(grad, ref_grad, atol=1e-6)
    assert float(grad[mask == 0].abs().max()) == 0.0


def test_cispo_clips_the_weight_but_keeps_every_tokens_gradient():
    """CISPO, weight w = sg(clip(r, -, 1 + 0.28)) (no lower bound), loss -w A per token (gradient -w A dlogp).
    Row 0, r = [1.25, 1.5, 0.5], A = [+1, +1, -1]: w = [1.25, 1.28, 0.5]; values [-1.25, -1.28, +0.5].
    Row 1: one valid token r = 1, A = +1: w = 1, value -1; its padding (logp 30, A 50) is ignored.
    token_mean = (-1.25 - 1.28 + 0.5 - 1) / 4 = -0.7575; clip_frac = 1/4 (the r = 1.5 token).
    Gradient -w A / 4: [-0.3125, -0.32, +0.125] and [-0.25, 0]. PPO (0.2 / 0.28) gives 0 at r = 1.5
    (A > 0, upper bound) and at r = 0.5 (A < 0, lower bound 0.8): CISPO drops no token.
    With clip_low 0.2 the r = 0.5 weight becomes 0.8: gradient +0.2 there, clip_frac 2/4.
    Same gradient as MiniMax-M1's objective written literally, -sg(w) A log pi."""
    logprobs = torch.log(T([[1.25, 1.5, 0.5], [1.0, 1.0, 1.0]]))
    logprobs[1, 1:] = 30.0
    logprobs.requires_grad_()
    old = torch.zeros(2, 3)
    adv = T([[1.0, 1.0, -1.0], [1.0, 50.0, 50.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    loss, stats = cispo_policy_loss(logprobs, old, adv, mask, clip_high=0.28)
    assert close(loss, -0.7575)
    assert close(stats.clip_frac, 0.25) and close(stats.dual_clip_frac, 0.0)
    assert close(stats.ratio_mean, (1.25 + 1.5 + 0.5 + 1.0) / 4)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert close(grad, [[-0.3125, -0.32, 0.125], [-0.25, 0.0, 0.0]])
    literal = aggregate_loss(-T([[1.25, 1.28, 0.5], [1.0, 0.0, 0.0]]) * adv * logprobs, mask, "token_mean")
    assert close(torch.autograd.grad(literal, logprobs)[0], grad)
    ppo, _ = clipped_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert close(torch.autograd.grad(ppo, logprobs)[0], [[-0.3125, 0.0, 0.0], [-0.25, 0.0, 0.0]])
    low, low_stats = cispo_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert close(torch.autograd.grad(low, logprobs)[0], [[-0.3125, -0.32, 0.2], [-0.25, 0.0, 0.0]])
    assert close(low_stats.clip_frac, 0.5)


def test_policy_loss_dispatch():
    """ppo_clip is clipped_policy_loss itself (same loss bits, same gradient); gspo and cispo reach their
    functions; settings an objective cannot honour are refused."""
    torch.manual_seed(1)
    old = torch.randn(3, 4) - 1
    logprobs = (old + 0.3 * torch.randn(3, 4)).requires_grad_()
    adv, mask = torch.randn(3, 4), T([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation="seq_mean_token_mean")
    a, sa = policy_loss("ppo_clip", logprobs, old, adv, mask, **kw)
    b, sb = clipped_policy_loss(logprobs, old, adv, mask, **kw)
    assert torch.equal(a, b) and torch.equal(sa.clip_frac, sb.clip_frac) and torch.equal(sa.approx_kl, sb.approx_kl)
    assert torch.equal(torch.autograd.grad(a, logprobs)[0], torch.autograd.grad(b, logprobs)[0])
    g, _ = policy_loss(PolicyObjective.GSPO, logprobs, old, adv, mask, **kw)
    assert torch.equal(g, gspo_policy_loss(logprobs, old, adv, mask, **kw)[0])
    c, _ = policy_loss("cispo", logprobs, old, adv, mask, clip_low=None, clip_high=0.28)
    assert torch.equal(c, cispo_policy_loss(logprobs, old, adv, mask, clip_high=0.28)[0])
    with pytest.raises(ValueError, match="cispo has none"):
        policy_loss("cispo", logprobs, old, adv, mask, clip_low=None, clip_high=0.28, dual_clip=3.0)
    with pytest.raises(ValueError, match="gspo needs clip_low"):
        policy_loss("gspo", logprobs, old, adv, mask, clip_low=None, clip_high=4e-4)
    with pytest.raises(ValueError, match="gspo_token"):
        policy_loss("gspo_token", logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_low"):
        gspo_policy_loss(logprobs, old, adv, mask, clip_low=1.0)


def test_every_objective_is_neutral_on_policy_with_zero_advantage_and_ignores_padding():
    """pi = pi_old (ratio 1, s_i = 1, weight 1) and A = 0 on valid tokens: loss 0 and zero gradient for every
    objective, whatever the padding holds (log-prob 40, A 1e6): a masked entry reaches no output."""
    logprobs = T([[-1.0, -2.0, 40.0]]).requires_grad_()
    old = T([[-1.0, -2.0, -3.0]])
    adv, mask = T([[0.0, 0.0, 1e6]]), T([[1, 1, 0]])
    for objective in PolicyObjective:
        low = None if objective is PolicyObjective.CISPO else 0.2
        loss, stats = policy_loss(objective, logprobs, old, adv, mask, clip_low=low, clip_high=0.28)
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert float(loss.detach()) == 0.0 and float(grad.abs().max()) == 0.0, objective
        assert close(stats.ratio_mean, 1.0) and close(stats.approx_kl, 0.0) and close(stats.clip_frac, 0.0)


# --------------------------------------------------------------------------------------
# Value loss and explained variance
# --------------------------------------------------------------------------------------


def test_clipped_value_loss():
    """clip_eps 0.2.
    Token 1: V_old 1, V 1.5, R 2: clipped V 1.2; errors (0.5)^2 = 0.25 vs (0.8)^2 = 0.64
             -> 0.5 * 0.64 = 0.32 (clip binds).
    Token 2: V_old 1, V 1.5, R 1: errors 0.25 vs (0.2)^2 = 0.04 -> 0.5 * 0.25 = 0.125.
    Token 3: V_old 0, V 0.1, R 1: inside the range, both 0.81 -> 0.405.
    token_mean = (0.32 + 0.125 + 0.405) / 3 = 0.283333, clip_frac 1/3; token 1 gets zero gradient.
    Unclipped: (0.125 + 0.125 + 0.405) / 3 = 0.218333."""
    values = T([[1.5, 1.5, 0.1]]).requires_grad_()
    old = T([[1.0, 1.0, 0.0]])
    returns = T([[2.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, clip_frac = clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
    assert close(loss, 0.85 / 3)
    assert close(clip_frac, 1 / 3)
    loss.backward()
    # d/dV of 0.5 (V - R)^2 / 3 = (V - R) / 3 where unclipped
    assert close(values.grad, [[0.0, 0.5 / 3, -0.9 / 3]])
    plain, frac = clipped_value_loss(values.detach(), old, returns, mask, clip_eps=None)
    assert close(plain, 0.655 / 3) and close(frac, 0.0)
    with pytest.raises(ValueError, match="clip_eps"):
        clipped_value_loss(values.detach(), old, returns, mask, clip_eps=0.0)


def test_explained_variance():
    """R = [1, 2, 3, 4], V = [1, 2, 3, 3] (plus a masked pair 0 vs 99).
    Var[R] = 1.25; R - V = [0, 0, 0, 1] has mean 0.25, var (3 * 0.0625 + 0.5625) / 4 = 0.1875.
    EV = 1 - 0.1875 / 1.25 = 0.85. V = R gives 1; constant returns give NaN."""
    returns = T([[1, 2, 3], [4, 0, 0]])
    values = T([[1, 2, 3], [3, 99, 0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    assert close(explained_variance(values, returns, mask), 0.85)
    assert close(explained_variance(returns, returns, mask), 1.0)
    assert math.isnan(float(explained_variance(values, torch.ones(2, 3), mask)))


# --------------------------------------------------------------------------------------
# KL penalty and controllers
# --------------------------------------------------------------------------------------


def test_kl_estimators_on_known_log_ratio():
    """logp = ln 0.4, logp_ref = ln 0.2 -> log_ratio = ln 2 = 0.693147, r = pi_ref/pi = 0.5.
    k1 = 0.693147; k2 = 0.5 * 0.693147^2 = 0.240227; k3 = (0.5 - 1) - ln 0.5 = 0.193147.
    Swapped (log_ratio = -ln 2, r = 2): k1 = -0.693147 (k1 can be negative), k2 = 0.240227,
    k3 = (2 - 1) - ln 2 = 0.306853."""
    logp = torch.log(T([[0.4, 0.2]]))
    ref = torch.log(T([[0.2, 0.4]]))
    assert close(kl_penalty(logp, ref, KLEstimator.K1), [[0.693147, -0.693147]])
    assert close(kl_penalty(logp, ref, KLEstimator.K2), [[0.240227, 0.240227]])
    assert close(kl_penalty(logp, ref, KLEstimator.K3), [[0.193147, 0.306853]])
    assert close(kl_penalty(logp, ref, "k3"), [[0.193147, 0.306853]])
    assert close(kl_penalty(logp, logp, "k3"), [[0.0, 0.0]])
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_k3_clamp_bounds_the_estimate():
    """log_ratio = -5 (policy gives the token e^-5 of the reference's probability).
    Exact k3 = e^5 - 1 - 5 = 142.413159; clamped to -2: e^2 - 1 - 2 = 4.389056."""
    logp, ref = T([[-5.0]]), T([[0.0]])
    assert torch.allclose(kl_penalty(logp, ref, "k3"), T([[math.exp(5) - 6]]), rtol=1e-6)
    assert close(kl_penalty(logp, ref, "k3", clamp=2.0), [[4.389056]])


def D(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_k3_cap_at_extreme_log_ratios():
    """k3 = e^x - 1 - x with x = log pi_ref - log pi = -log_ratio; log-ratio clamp 20 (KL_CLAMP), cap 10.
    log_ratio -12: e^12 - 1 - 12 = 162754.791419 - 13 = 162741.791419; capped 10.
    log_ratio -20: e^20 - 21 = 485165195.409790 - 21 = 485165174.409790; capped 10.
    log_ratio -30: the log-ratio clamp makes it -20 first: 485165174.409790; capped 10.
    log_ratio +12 (policy far above the reference): e^-12 - 1 + 12 = 11.000006144; capped 10 too.
    log_ratio -2.5: e^2.5 - 3.5 = 12.182494 - 3.5 = 8.682494 < 10: the cap does not bind.
    log_ratio 0: e^0 - 1 - 0 = 0.
    log_ratio 1e-3: e^-x - 1 + x = x^2/2 - x^3/6 + ... = 5e-7 - 1.667e-10 = 4.998334e-7 (~ x^2 / 2)."""
    ratios = [-12.0, -20.0, -30.0, 12.0, -2.5, 0.0, 1e-3]
    logp, ref = D([ratios]), torch.zeros(1, len(ratios), dtype=torch.float64)
    exact = [162741.791419, 485165174.409790, 485165174.409790, 11.000006144, 8.682494, 0.0, 4.998334e-7]
    uncapped = kl_penalty(logp, ref, "k3", clamp=20.0)
    capped = kl_penalty(logp, ref, "k3", clamp=20.0, k3_cap=10.0)
    assert torch.allclose(uncapped, D([exact]), rtol=1e-6, atol=0.0)
    assert torch.allclose(capped, D([[10.0, 10.0, 10.0, 10.0, 8.682494, 0.0, 4.998334e-7]]), rtol=1e-6, atol=0.0)
    # the cap applies to k3 only: k1 and k2 are unchanged
    assert torch.equal(kl_penalty(logp, ref, "k1", clamp=20.0, k3_cap=10.0), kl_penalty(logp, ref, "k1", clamp=20.0))
    assert torch.equal(kl_penalty(logp, ref, "k2", clamp=20.0, k3_cap=10.0), kl_penalty(logp, ref, "k2", clamp=20.0))
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="k3_cap must be > 0"):
            kl_penalty(logp, ref, "k3", k3_cap=bad)


def test_k3_cap_zeroes_the_gradient_only_where_it_binds():
    """d k3 / d logp = d(e^-l - 1 + l)/dl = 1 - e^-l, l = log_ratio (logp_ref fixed at 0):
    l = -12: 1 - e^12 = -162753.791419 uncapped, 0 capped (k3 = 162741.79 > 10);
    l = +12: 1 - e^-12 = 0.999993856 uncapped, 0 capped (k3 = 11.000006 > 10);
    l = -2: 1 - e^2 = -6.389056 both (k3 = e^2 - 3 = 4.389056 < 10);
    l = 0.5: 1 - e^-0.5 = 0.393469 both (k3 = 0.106531 < 10)."""
    grads = {}
    for cap in (None, 10.0):
        logp = D([[-12.0, 12.0, -2.0, 0.5]]).requires_grad_(True)
        kl_penalty(logp, torch.zeros_like(logp), "k3", clamp=20.0, k3_cap=cap).sum().backward()
        grads[cap] = logp.grad
    assert torch.allclose(grads[None], D([[-162753.791419, 0.999993856, -6.389056, 0.393469]]), rtol=1e-6)
    assert torch.equal(grads[10.0][0, :2], D([0.0, 0.0]))
    assert torch.equal(grads[10.0][0, 2:], grads[None][0, 2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_k3_is_never_negative(dtype):
    """k3 = e^x - 1 - x >= 0 for every x (e^x >= 1 + x). In floating point ``exp(x) - 1`` cancels every
    digit near x = 0 and went below 0 (about -4e-8 in fp32, -4e-3 in bf16, 1e-16 in fp64); ``expm1``
    keeps it >= 0. Log-ratios from -30 to 30 and +-1e-12 .. 1, with and without the cap; capped <= 10."""
    small = torch.logspace(-12, 0, 20001, dtype=torch.float64)
    ratios = torch.cat([torch.linspace(-30, 30, 600001, dtype=torch.float64), small, -small]).to(dtype)
    zeros = torch.zeros_like(ratios)
    for cap in (None, 10.0):
        k3 = kl_penalty(ratios[None], zeros[None], "k3", clamp=20.0, k3_cap=cap)
        assert bool((k3 >= 0).all()), (cap, float(k3.min()))
        assert cap is None or bool((k3 <= cap).all())
    # and accurate where cancellation hurt: x = 1e-4 gives x^2/2 - x^3/6 = 4.99983e-9 (fp32: within 1e-3)
    if dtype is torch.float32:
        assert close(kl_penalty(T([[-1e-4]]), T([[0.0]]), "k3") * 1e9, [[4.99983]], atol=5e-3)


def test_fixed_kl_controller():
    """update leaves beta at 0.05; state_dict round-trips."""
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=256)
    assert ctl.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1.0)


def test_adaptive_kl_controller_one_step():
    """beta 0.1, target 6, horizon 10000, n_steps 256.
    KL 6.6: e = 6.6/6 - 1 = 0.1 -> beta = 0.1 * (1 + 0.1 * 256/10000) = 0.1 * 1.00256 = 0.100256.
    KL 9:   e = 0.5 clipped to 0.2 -> 0.1 * (1 + 0.2 * 0.0256) = 0.1 * 1.00512 = 0.100512.
    KL 3:   e = -0.5 clipped to -0.2 -> 0.1 * 0.99488 = 0.099488."""
    for kl, expected in ((6.6, 0.100256), (9.0, 0.100512), (3.0, 0.099488)):
        ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
        ctl.update(kl, n_steps=256)
        assert math.isclose(ctl.value, expected, rel_tol=1e-9)
    resumed = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target=6.0, horizon=0)


# --------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------


def test_estimator_properties():
    """Only GAE needs a critic; rloo, grpo, dr-grpo and reinforce++-baseline need groups."""
    assert [e.value for e in AdvantageEstimator if e.needs_critic] == ["gae"]
    assert {e.value for e in AdvantageEstimator if e.needs_groups} == {
        "rloo", "grpo", "dr-grpo", "reinforce++-baseline"}
    assert AdvantageEstimator("reinforce++") is AdvantageEstimator.REINFORCE_PP


def test_gae_three_step_episode():
    """gamma = lam = 0.5, rewards [0, 0, 1], values [0.5, 0.25, 0.5], terminal after step 3
    (a 4th padding token with reward 9 and value 7 must be ignored).
    t=2: delta = 1 + 0.5 * 0 - 0.5 = 0.5;              A2 = 0.5
    t=1: delta = 0 + 0.5 * 0.5 - 0.25 = 0;             A1 = 0 + 0.25 * 0.5 = 0.125
    t=0: delta = 0 + 0.5 * 0.25 - 0.5 = -0.375;        A0 = -0.375 + 0.25 * 0.125 = -0.34375
    returns = A + V = [0.15625, 0.375, 1.0]; padding gives 0 in both."""
    rewards = T([[0, 0, 1, 9]])
    values = T([[0.5, 0.25, 0.5, 7.0]])
    mask = T([[1, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert close(adv, [[-0.34375, 0.125, 0.5, 0.0]])
    assert close(ret, [[0.15625, 0.375, 1.0, 0.0]])


def test_gae_lambda_one_is_monte_carlo():
    """gamma = lam = 1: A_t = (sum of future rewards) - V_t, so returns = reward-to-go [3, 3, 2]
    for rewards [0, 1, 2] whatever the values."""
    rewards, values, mask = T([[0, 1, 2]]), T([[5.0, -1.0, 0.3]]), torch.ones(1, 3)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert close(ret, [[3.0, 3.0, 2.0]])
    assert close(adv, [[-2.0, 4.0, 1.7]])


def test_discounted_returns_and_token_level_rewards():
    """gamma 0.5, rewards [1, 0, 2, pad]: G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5.
    token_level_rewards: score 1 on the last valid token (index 1 of [1, 1, 0]) plus -0.1 per
    token -> [-0.1, 0.9, 0]; row with no valid token -> zeros."""
    assert close(discounted_returns(T([[1, 0, 2, 5]]), T([[1, 1, 1, 0]]), gamma=0.5), [[1.5, 1.0, 2.0, 0.0]])
    r = token_level_rewards(T([1.0, 3.0]), T([[1, 1, 0], [0, 0, 0]]), token_rewards=torch.full((2, 3), -0.1))
    assert close(r, [[-0.1, 0.9, 0.0], [0.0, 0.0, 0.0]])


def test_reinforce_plus_plus_global_whitening():
    """scores [1, 0], mask [[1, 1, 1], [1, 1, 0]], gamma 1, no KL: returns [[1, 1, 1], [0, 0, -]].
    Valid returns [1, 1, 1, 0, 0]: mean 0.6, population var (3 * 0.16 + 2 * 0.36) / 5 = 0.24,
    std 0.489898 -> 0.4 / 0.489898 = 0.816497 and -0.6 / 0.489898 = -1.224745."""
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages("reinforce++", scores=T([1.0, 0.0]), mask=mask)
    assert close(ret, [[1, 1, 1], [0, 0, 0]])
    assert close(adv, [[0.816497] * 3, [-1.224745, -1.224745, 0.0]])
    direct_adv, _ = reinforce_plus_plus(token_level_rewards(T([1.0, 0.0]), mask), mask)
    assert close(direct_adv, adv)


def test_reinforce_plus_plus_with_kl_token_rewards():
    """One row, score 1, per-token KL reward -0.1, gamma 1: rewards [-0.1, -0.1, 0.9],
    returns [0.7, 0.8, 0.9]; whitened: mean 0.8, var 0.02/3, std 0.081650 -> [-1.224745, 0, 1.224745]."""
    adv, ret = compute_advantages(AdvantageEstimator.REINFORCE_PP, scores=T([1.0]), mask=torch.ones(1, 3),
                                  token_rewards=torch.full((1, 3), -0.1))
    assert close(ret, [[0.7, 0.8, 0.9]])
    assert close(adv, [[-1.224745, 0.0, 1.224745]])


def test_reinforce_plus_plus_baseline():
    """group_size 2, scores [1, 0 | 1, 1] -> minus group mean: [0.5, -0.5, 0, 0]; T = 2, gamma 1,
    so each row's return is its centred score on both tokens. Whitening over the 8 tokens:
    mean 0, var 4 * 0.25 / 8 = 0.125, std 0.353553 -> +-0.5 / 0.353553 = +-1.414214, 0."""
    adv, ret = compute_advantages("reinforce++-baseline", scores=T([1, 0, 1, 1]), mask=torch.ones(4, 2),
                                  group_size=2)
    assert close(ret, [[0.5, 0.5], [-0.5, -0.5], [0, 0], [0, 0]])
    assert close(adv, [[1.414214] * 2, [-1.414214] * 2, [0, 0], [0, 0]])


def test_rloo_two_and_three_samples():
    """n = 2: baseline is the other sample: [1, 3] -> [1 - 3, 3 - 1] = [-2, 2].
    n = 3, [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> [-3, -1.5, 4.5]."""
    assert close(rloo_advantages(T([1.0, 3.0]), 2), [-2.0, 2.0])
    assert close(rloo_advantages(T([1.0, 2.0, 6.0]), 3), [-3.0, -1.5, 4.5])
    adv, ret = compute_advantages("rloo", scores=T([1.0, 3.0]), mask=T([[1, 1, 0], [1, 0, 0]]), group_size=2)
    assert ret is None
    assert close(adv, [[-2.0, -2.0, 0.0], [2.0, 0.0, 0.0]])


def test_grpo_zero_variance_group_gives_zeros():
    """Groups [1, 0] and [2, 2], eps 1e-6.
    [1, 0]: mean 0.5, sample std sqrt((0.25 + 0.25) / 1) = 0.707107 -> +-0.5 / 0.707108 = +-0.707106.
    [2, 2]: std 0 -> 0 / 1e-6 = 0 exactly (no NaN).
    Broadcast over mask [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]."""
    scores = T([1.0, 0.0, 2.0, 2.0])
    assert close(grpo_advantages(scores, 2), [0.707106, -0.707106, 0.0, 0.0])
    mask = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    adv, ret = compute_advantages(AdvantageEstimator.GRPO, scores=scores, mask=mask, group_size=2)
    assert ret is None
    assert close(adv, [[0.707106, 0.707106, 0.0], [-0.707106, 0.0, 0.0], [0.0] * 3, [0.0] * 3])
    assert torch.equal(adv[2:], torch.zeros(2, 3))


def test_grpo_group_of_four():
    """[1, 1, 0, 0]: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.577350 -> +-0.5 / 0.577350 = +-0.866025."""
    assert close(grpo_advantages(T([1, 1, 0, 0]), 4), [0.866025, 0.866025, -0.866025, -0.866025])


def test_dr_grpo_advantages_and_constant_normaliser():
    """Group [1, 0]: A = r - mean = [0.5, -0.5] (no std division; [3, 5] gives [-1, 1], not +-0.707).
    Correct answer 3 tokens, wrong answer 1 token (mask [[1, 1, 1, 0], [1, 0, 0, 0]]); ratio 1 so the
    per-token loss is -A: [-0.5, -0.5, -0.5] and [0.5].
    Dr.GRPO sum_norm, max_len 4: (-1.5/4 + 0.5/4) / 2 = -0.125.
    GRPO seq_mean_token_mean: (-0.5 + 0.5) / 2 = 0 (length information lost).
    token_mean: (-1.5 + 0.5) / 4 = -0.25."""
    assert close(dr_grpo_advantages(T([1.0, 0.0]), 2), [0.5, -0.5])
    assert close(dr_grpo_advantages(T([3.0, 5.0]), 2), [-1.0, 1.0])
    mask = T([[1, 1, 1, 0], [1, 0, 0, 0]])
    adv, _ = compute_advantages("dr-grpo", scores=T([1.0, 0.0]), mask=mask, group_size=2)
    lp = torch.zeros(2, 4)
    dr, _ = clipped_policy_loss(lp, lp, adv, mask, aggregation="seq_mean_token_sum_norm", max_len=4)
    grpo, _ = clipped_policy_loss(lp, lp, adv, mask, aggregation="seq_mean_token_mean")
    tok, _ = clipped_policy_loss(lp, lp, adv, mask, aggregation="token_mean")
    assert close(dr, -0.125) and close(grpo, 0.0) and close(tok, -0.25)


def test_compute_advantages_gae_dispatch():
    """Score 1 on the last of 3 valid tokens, values [0.5, 0.25, 0.5], gamma = lam = 0.5: the same
    episode as the GAE test, so A = [-0.34375, 0.125, 0.5] and returns [0.15625, 0.375, 1.0]."""
    adv, ret = compute_advantages("gae", scores=T([1.0]), mask=T([[1, 1, 1, 0]]),
                                  values=T([[0.5, 0.25, 0.5, 7.0]]), gamma=0.5, lam=0.5)
    assert close(adv, [[-0.34375, 0.125, 0.5, 0.0]])
    assert close(ret, [[0.15625, 0.375, 1.0, 0.0]])


def test_compute_advantages_errors():
    """Indivisible batch, group_size < 2 for group estimators, gae without values,
    token_rewards for a sequence-level estimator, mis-shaped scores, unknown estimator."""
    mask = torch.ones(5, 2)
    with pytest.raises(ValueError, match="divisible"):
        compute_advantages("grpo", scores=torch.zeros(5), mask=mask, group_size=2)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("rloo", scores=torch.zeros(5), mask=mask, group_size=1)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("reinforce++-baseline", scores=torch.zeros(5), mask=mask)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", scores=torch.zeros(5), mask=mask)
    with pytest.raises(ValueError, match="token_rewards"):
        compute_advantages("grpo", scores=torch.zeros(4), mask=torch.ones(4, 2), group_size=2,
                           token_rewards=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="scores"):
        compute_advantages("reinforce++", scores=torch.zeros(4), mask=mask)
    with pytest.raises(ValueError):
        compute_advantages("ppo", scores=torch.zeros(5), mask=mask)


# --------------------------------------------------------------------------------------
# On-policy distillation
# --------------------------------------------------------------------------------------


def test_distill_estimator_properties():
    """Only distill needs a teacher; it takes token rewards like gae and the reinforce++ variants."""
    assert [e.value for e in AdvantageEstimator if e.needs_teacher] == ["distill"]
    assert {e.value for e in AdvantageEstimator if e.takes_token_rewards} == {
        "gae", "reinforce++", "reinforce++-baseline", "distill"}
    assert not AdvantageEstimator.DISTILL.needs_critic and not AdvantageEstimator.DISTILL.needs_groups


def test_reverse_kl_token_rewards():
    """student [-1.0, -0.5, -2.0, (9.0 pad)], teacher [-0.5, -1.5, -2.0, (3.0 pad)]:
    log-ratio s - t = [-0.5, 1.0, 0.0] -> r = -(s - t) = [0.5, -1.0, 0.0], 0 on the pad.
    clamp 0.75: the log-ratio 1.0 becomes 0.75 -> r = [0.5, -0.75, 0.0, 0.0]."""
    s, t, mask = T([[-1.0, -0.5, -2.0, 9.0]]), T([[-0.5, -1.5, -2.0, 3.0]]), T([[1, 1, 1, 0]])
    assert close(reverse_kl_token_rewards(s, t, mask), [[0.5, -1.0, 0.0, 0.0]])
    assert close(reverse_kl_token_rewards(s, t, mask, clamp=0.75), [[0.5, -0.75, 0.0, 0.0]])
    # a teacher identical to the student gives no signal anywhere
    assert close(reverse_kl_token_rewards(s, s, mask), [[0.0, 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="teacher_logp"):
        reverse_kl_token_rewards(s, t[:, :3], mask)


def test_distill_advantages_discount_zero_plus_score():
    """Rows r = [[0.5, -1.0, 0.0, 0], [2.0, 0, 0, 0]] with masks [1, 1, 1, 0] and [1, 0, 0, 0], scores [2, -1].
    Discount 0: each token keeps its own reward (no reward-to-go: token 0 of row 0 stays 0.5, not -0.5).
    coef 0.5 adds 0.5 * score to every valid token: row 0 + 1.0 -> [1.5, 0.0, 1.0, 0]; row 1 - 0.5 -> [1.5, 0, 0, 0].
    compute_advantages("distill") is the same, with no returns; coef 0 is the rewards alone."""
    r, mask = T([[0.5, -1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]), T([[1, 1, 1, 0], [1, 0, 0, 0]])
    scores = T([2.0, -1.0])
    expected = [[1.5, 0.0, 1.0, 0.0], [1.5, 0.0, 0.0, 0.0]]
    assert close(distill_advantages(r, mask, scores, 0.5), expected)
    adv, ret = compute_advantages("distill", scores=scores, mask=mask, token_rewards=r, distill_reward_coef=0.5,
                                  gamma=1.0)
    assert close(adv, expected) and ret is None
    adv0, _ = compute_advantages("distill", scores=scores, mask=mask, token_rewards=r)
    assert close(adv0, r)
    with pytest.raises(ValueError, match="distill needs token_rewards"):
        compute_advantages("distill", scores=scores, mask=mask)


# --------------------------------------------------------------------------------------
# DAPO pieces
# --------------------------------------------------------------------------------------


def test_dynamic_sampling_keep():
    """group_size 2, scores [1, 1 | 0, 1 | 0, 0]: only the middle group has a spread -> keep rows 2 and 3.
    With atol 0.5, [0.3, 0.0] (spread 0.3) counts as equal."""
    keep = dynamic_sampling_keep(T([1, 1, 0, 1, 0, 0]), 2)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, False, False]
    assert keep.view(-1, 2)[:, 0].tolist() == [False, True, False]
    assert dynamic_sampling_keep(T([0.3, 0.0]), 2, atol=0.5).tolist() == [False, False]
    with pytest.raises(ValueError, match="divisible"):
        dynamic_sampling_keep(T([1, 0, 1]), 2)


def test_overlong_penalty_three_regimes():
    """max_len 20, cache_len 4 -> ramp starts at 16.
    L = 10, 16: 0 (within budget); L = 18: (16 - 18) / 4 = -0.5; L = 20: (16 - 20) / 4 = -1;
    L = 25: beyond max_len -> -1."""
    got = overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_len=20, cache_len=4)
    assert close(got, [0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=0)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=11)


# --------------------------------------------------------------------------------------
# Entropy
# --------------------------------------------------------------------------------------


def test_entropy_uniform_is_log_v_and_known_distribution():
    """Equal logits over V = 5 (any constant, even 1000): H = ln 5 = 1.609438.
    Logits [0, ln 3] -> p = [1/4, 3/4]: H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335.
    A one-hot-like row (logits [0, 1000]) gives 0, not NaN."""
    uniform = torch.cat([torch.zeros(1, 1, 5), torch.full((1, 1, 5), 1000.0)], dim=1)
    assert close(entropy_from_logits(uniform), [[math.log(5), math.log(5)]])
    two = T([[[0.0, math.log(3)], [0.0, 1000.0]]])
    assert close(entropy_from_logits(two), [[0.562335, 0.0]])
    assert entropy_from_logits(torch.zeros(2, 3, 7, dtype=torch.bfloat16)).shape == (2, 3)


def test_truncated_is_weights():
    from rlhf_core.algorithms.rl_math import truncated_is_weights

    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]], requires_grad=True)
    sampler = torch.tensor([[-1.0, -3.0, -0.1], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, sampler, mask, cap=2.0)
    expected = torch.tensor([[1.0, 2.0, math.exp(-0.4)], [math.exp(-2.0), 1.0, 0.0]])  # e^1 = 2.72 capped at 2
    assert torch.allclose(w, expected) and not w.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, sampler, mask, cap=0.0)


def test_tis_as_scaled_advantages_weights_each_token_of_the_clipped_loss():
    """Scaling advantages by w > 0 scales each token's clipped surrogate by w (w factors out of the min)."""
    from rlhf_core.algorithms.rl_math import clipped_policy_loss

    torch.manual_seed(0)
    logp, old = torch.randn(3, 5) * 0.3 - 1, torch.randn(3, 5) * 0.3 - 1
    adv, mask, w = torch.randn(3, 5), torch.ones(3, 5), torch.rand(3, 5) + 0.1
    weighted, _ = clipped_policy_loss(logp, old, adv * w, mask, aggregation="token_mean")
    per_token = [clipped_policy_loss(logp[i:i + 1, j:j + 1], old[i:i + 1, j:j + 1], adv[i:i + 1, j:j + 1],
                                     mask[i:i + 1, j:j + 1], aggregation="token_mean")[0] * w[i, j]
                 for i in range(3) for j in range(5)]
    assert torch.allclose(weighted, torch.stack(per_token).mean(), atol=1e-6)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_sharded_losses_recombine_exactly(mode):
    """Data parallelism's identity: with u_r = aggregation_units(shard r), the whole batch's loss is
    sum_r u_r * loss_r / sum_r u_r. Rows 0, 2 and 1, 3 are two ranks' shards (rows rank::2); row 3 has
    no valid token, so the sequence modes count 2 + 1 sequences and token_mean 3 + 2 + 2 + 0 = 7 tokens."""
    from rlhf_core.algorithms.rl_math import aggregate_loss, aggregation_units

    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 7.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float32)
    whole = aggregate_loss(loss, mask, mode, max_len=3)
    shards = [slice(0, 4, 2), slice(1, 4, 2)]
    units = [aggregation_units(mask[s], mode) for s in shards]
    parts = [aggregate_loss(loss[s], mask[s], mode, max_len=3) for s in shards]
    assert float(aggregation_units(mask, mode)) == (7.0 if mode == "token_mean" else 3.0)
    assert torch.isclose(sum(u * p for u, p in zip(units, parts)) / sum(units), whole)


def test_sequence_is_mask_keeps_responses_whose_sequence_ratio_is_within_the_band():
    """threshold C = 2 (ln 2 = 0.693): rho = exp(sum of valid log-ratios log pi_old - log pi_sampler).
    Row 0: 0.1 + 0.2 = 0.3, rho = e^0.3 = 1.350 in [0.5, 2] -> kept.
    Row 1: 0.5 + 0.4 = 0.9 (the masked third token's 5.0 is ignored), rho = e^0.9 = 2.460 > 2 -> masked.
    Row 2: -0.4 - 0.5 = -0.9, rho = e^-0.9 = 0.407 < 1/2 -> masked.
    Row 3: no valid token, rho = e^0 = 1 -> kept.
    Row 4: 0.69 < 0.693 (rho 1.994) -> kept, the band's inside edge.
    Token-level TIS would have kept every row, capping only row 1's tokens at 2 (none reach it: e^0.5 = 1.65)."""
    from rlhf_core.algorithms.rl_math import sequence_is_mask

    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, 4.0], [-1.4, -1.5, 0.0], [0.0, 0.0, 0.0],
                        [-1.0, -1.0, 0.0]], requires_grad=True)
    sampler = torch.tensor([[-1.1, -2.2, 0.0], [-1.0, -1.4, -1.0], [-1.0, -1.0, 0.0], [-3.0, -3.0, 0.0],
                            [-1.69, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    keep, rho = sequence_is_mask(old, sampler, mask, threshold=2.0)
    assert keep.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert torch.allclose(rho, torch.tensor([math.exp(0.3), math.exp(0.9), math.exp(-0.9), 1.0, math.exp(0.69)]),
                          atol=1e-5)
    assert not keep.requires_grad and not rho.requires_grad
    with pytest.raises(ValueError, match="threshold must be > 1"):
        sequence_is_mask(old, sampler, mask, threshold=1.0)
