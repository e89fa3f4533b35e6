"""KL penalties to the reference policy: per-token estimators (k1, k2, k3) and the fixed and adaptive
coefficient controllers.

Plain tensor functions (torch only). Tensor conventions (shapes, masks, group layout):
:mod:`rlhf_core.algorithms.rl_math`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlhf_core.algorithms.masked import _check_shapes
from rlhf_core.config.choices import KLEstimator


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: KLEstimator | str,
               clamp: float | None = None, k3_cap: float | None = None) -> torch.Tensor:
    """Per-token KL estimate (Schulman 2020, "Approximating KL Divergence", k1/k2/k3).

    Use it either as a reward penalty (``token_rewards = -beta * kl``, Ziegler et al. 2019,
    Sec. 2.2; k1 is the usual choice) or as a loss term aggregated with :func:`aggregate_loss`
    (GRPO, k3).

    Args:
        logp: ``(batch, response_len)`` log-probs of the sampled tokens under the policy.
        logp_ref: ``(batch, response_len)`` the same under the frozen reference.
        estimator: a :class:`KLEstimator` (or its string value).
        clamp: if set, ``log_ratio`` is clamped to ``[-clamp, clamp]`` first. k3 contains
            ``exp(-log_ratio)``, which explodes where the policy gives a token far less
            probability than the reference; clamping bounds k3 by ``e^clamp - 1 - clamp``
            (verl uses 20 on the log-ratio). ``None`` gives the exact estimator.
        k3_cap: k3 only: if set (> 0), each token's k3 value is clamped to at most ``k3_cap``
            after it is computed (verl's ``low_var_kl`` and OpenRLHF's k3 cap it at 10). The
            log-ratio clamp alone still lets one token at ``log pi - log pi_ref = -12`` add
            ``e^12 - 1 - 12 = 1.6e5`` (``4.9e8`` at -20), which swamps the whole batch's loss.
            Trade-off: where the cap binds, the value no longer depends on ``logp``, so the
            penalty's gradient there is zero: the token is no longer pulled back toward the
            reference (for k3, d k3 / d logp = 1 - pi_ref / pi, Schulman 2020), only the other
            tokens are. k3 >= 0 everywhere, capped or not. Ignored for k1 and k2.

    Returns:
        ``(batch, response_len)``; multiply by the mask before summing.
    """
    if k3_cap is not None and not k3_cap > 0:
        raise ValueError(f"k3_cap must be > 0 (or None for no cap), got {k3_cap}")
    estimator = KLEstimator(estimator)
    _check_shapes("logp", logp=logp, logp_ref=logp_ref)
    log_ratio = logp - logp_ref
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if estimator is KLEstimator.K1:
        return log_ratio
    if estimator is KLEstimator.K2:
        return 0.5 * log_ratio**2
    if estimator is KLEstimator.K3:
        # r = pi_ref / pi; (r - 1) - log r with log r = -log_ratio. expm1, not exp(.) - 1: near
        # log_ratio = 0 the subtraction cancels every digit (fp32, |log_ratio| < 1e-3: wrong by
        # orders of magnitude, and negative); expm1(-x) >= -x holds after rounding, so k3 >= 0.
        k3 = torch.expm1(-log_ratio) + log_ratio
        # an upper bound only, so k3 >= 0 still holds
        return k3 if k3_cap is None else k3.clamp(max=k3_cap)
    raise ValueError(f"unknown KL estimator {estimator!r}")  # pragma: no cover - the enum is closed


class KLController(Protocol):
    """The shape every KL-coefficient controller has; the trainer reads ``value`` each step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant KL coefficient ``beta``; ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        """``{"value": beta}`` for a checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore ``value`` from :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", Sec. 2.2).

    ``e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e_t * n_steps / horizon)``:
    a proportional controller that raises ``beta`` while the policy drifts past the target
    KL and lowers it while it stays below (the paper's ``K_beta = 0.1`` per step is
    ``n_steps / horizon`` here, as in TRL and OpenRLHF).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"target KL must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """One controller step after observing mean per-sequence KL ``current_kl`` over ``n_steps`` samples."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """``{"value": beta}``: target and horizon are configuration, not state, so a resumed
        run may change them."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore ``value`` from :meth:`state_dict`."""
        self.value = float(state["value"])
