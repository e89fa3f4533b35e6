"""Guards on an aligned model and the registry's promotion gate: pure math over per-item eval results.

A policy stage (a guarded stage of rlhf_core/config/stage_registry.py, or a cycle) turns a parent model into a child. Both answer the
same held-out items (:mod:`rlhf_core.promotion.probe` records, per item, whether the answer is correct, its
reward score, its length, and along the child's answer the KL to the reference and the entropy); this
module turns two such records into the guards and the gate's decision:

* **eval delta** with its *paired* standard error: on the same items the difference of two models is the
  mean of the per-item differences ``d_i = c_i - p_i``, and its error is ``sd(d) / sqrt(n)``, not
  ``sqrt(se_c^2 + se_p^2)`` (that treats the two runs as independent; on positively correlated results
  it is larger, often several times);
* **reward hacking**: the held-out reward score rose beyond noise while accuracy did not (Gao et al.
  2022, "Scaling Laws for Reward Model Overoptimization": proxy reward keeps rising as the gold score
  falls); and **reward disagreement**: the answers the reward scores highest are correct *less* often than
  the child's answers overall (the reward and the rule disagree where the reward is surest). A guard named
  in ``guards.advisory_guards`` (default: reward_disagreement) is logged and shown but does not block;
* **KL** to the reference, **response length** and its change, **entropy collapse**, and **per-slice
  regressions** (a skill that lost beyond noise while the total rose).

The gate (:func:`gate`) promotes only when the gate metric rose by more than ``min_improvement_se`` paired
standard errors and no guard fired. The gate metric is accuracy, the held-out reward (eval items without labels),
or a user's metric command's per-item scores paired by id (:mod:`rlhf_core.promotion.metric_command`). No torch, MLflow or Prefect here: a test calls it with hand-made lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_core.config import GUARD_NAMES, GuardsConfig

__all__ = ["GUARD_NAMES", "Delta", "GateDecision", "GuardReport", "GuardResult", "ProbeRecord", "check_guards",
           "fired_guards", "gate", "paired_delta"]


def fired_guards(metrics: dict[str, float]) -> list[str]:
    """The names of the guards a stage's ``guard/<name>_fired`` metrics say fired, in :data:`GUARD_NAMES` order."""
    return [name for name in GUARD_NAMES if metrics.get(f"guard/{name}_fired")]


@dataclass(frozen=True)
class Delta:
    """``child - parent`` of a per-item quantity on the same ``n`` items, with its paired standard error."""

    delta: float
    se: float
    n: int

    def beyond(self, k: float) -> bool:
        """True when the change is up by more than ``k`` standard errors (any rise when ``se`` is 0 and k >= 0)."""
        return self.delta > k * self.se

    def text(self) -> str:
        return f"{self.delta:+.4f} ± {self.se:.4f} (paired, n={self.n})"


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error ``sqrt(sum (x - mean)^2 / (n (n - 1)))`` (0 for fewer than 2 values)."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((x - mean) ** 2 for x in values) / (n * (n - 1)))


def paired_delta(parent: Sequence[float], child: Sequence[float]) -> Delta:
    """Mean of ``child_i - parent_i`` and its paired standard error ``sd(d) / sqrt(n)`` (sample sd, n - 1).

    ``parent`` and ``child``: ``(n,)`` per-item values (0/1 correctness, reward scores) on the same items in
    the same order. For 0/1 results ``d_i`` is -1, 0 or +1: only items where the two models disagree add
    variance, which is why the paired error is small when the models mostly agree."""
    if len(parent) != len(child):
        raise ValueError(f"paired_delta: {len(parent)} parent items vs {len(child)} child items; "
                         "a paired difference needs the same items")
    diffs = [float(c) - float(p) for p, c in zip(parent, child)]
    delta, se = mean_and_se(diffs)
    return Delta(delta, se, len(diffs))


def unpaired_se(se_a: float, se_b: float) -> float:
    """``sqrt(se_a^2 + se_b^2)``: the error of a difference of independent estimates (different eval items)."""
    return math.sqrt(se_a ** 2 + se_b ** 2)


@dataclass
class ProbeRecord:
    """One model's answers to the held-out items (what :mod:`rlhf_core.promotion.probe` measures).

    ``correct``: ``(n,)`` 0/1 exact match, or None when the items carry no labels; ``reward``: ``(n,)`` held-out
    reward score of each greedy answer, or None without a reward; ``length``: ``(n,)`` answer length in characters;
    ``entropy``: mean next-token entropy (nats) along the model's own answers; ``kl``: mean over items of the
    summed per-token KL(model || reference) along its answers (None for the parent); ``slices``: ``(n,)`` slice
    name per item (None: not sliced)."""

    correct: list[float] | None
    reward: list[float] | None
    length: list[float]
    entropy: float
    kl: float | None = None
    slices: list[str | None] = field(default_factory=list)


@dataclass
class GuardResult:
    """One guard: did it fire, the value it looked at, the threshold, and a sentence for tags and the card."""

    name: str
    fired: bool
    value: float
    threshold: float
    detail: str
    blocking: bool = True


@dataclass
class GuardReport:
    """Every guard's result and the deltas behind them; ``metrics()`` and ``tags()`` are what runs log."""

    guards: list[GuardResult]
    eval_delta: Delta | None
    reward_delta: Delta | None
    values: dict[str, float]
    metric_delta: Delta | None = None
    """the metric command's paired change (gate_metric command), else None"""

    @property
    def fired(self) -> list[GuardResult]:
        return [g for g in self.guards if g.fired]

    @property
    def blocking(self) -> list[GuardResult]:
        """Fired guards that block promotion (not advisory)."""
        return [g for g in self.fired if g.blocking]

    def metrics(self) -> dict[str, float]:
        """``guard/*`` metrics: the measured values and one 0/1 ``guard/<name>_fired`` per guard."""
        out = {f"guard/{k}": v for k, v in self.values.items() if v is not None and math.isfinite(v)}
        out.update({f"guard/{g.name}_fired": float(g.fired) for g in self.guards})
        out["guard/n_fired"] = float(len(self.fired))
        return out

    def tags(self) -> dict[str, str]:
        """``guard.fired`` (comma-separated names, or ``none``) and ``guard.<name>``: fired/ok with its value."""
        tags = {"guard.fired": ",".join(g.name for g in self.fired) or "none",
                "guard.blocking": ",".join(g.name for g in self.blocking) or "none"}
        for g in self.guards:
            status = ("FIRED" if g.blocking else "FIRED (advisory)") if g.fired else "ok"
            tags[f"guard.{g.name}"] = f"{status}: {g.detail}"
        if self.eval_delta is not None:
            tags["guard.eval_delta"] = self.eval_delta.text()
        if self.reward_delta is not None:
            tags["guard.reward_delta"] = self.reward_delta.text()
        if self.metric_delta is not None:
            tags["guard.metric_delta"] = self.metric_delta.text()
        return tags

    def to_dict(self) -> dict[str, Any]:
        return {"guards": [g.__dict__ for g in self.guards], "values": self.values,
                "eval_delta": None if self.eval_delta is None else self.eval_delta.__dict__,
                "reward_delta": None if self.reward_delta is None else self.reward_delta.__dict__,
                "metric_delta": None if self.metric_delta is None else self.metric_delta.__dict__,
                "fired": [g.name for g in self.fired]}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def top_scored_accuracy(correct: Sequence[float], reward: Sequence[float], fraction: float) -> tuple[float, int]:
    """Accuracy of the ``ceil(fraction * n)`` answers with the highest reward (ties: earlier items first) and
    that count."""
    n = len(correct)
    k = max(1, math.ceil(fraction * n))
    order = sorted(range(n), key=lambda i: (-reward[i], i))[:k]
    return _mean([correct[i] for i in order]), k


def reward_hacking(eval_delta: Delta | None, reward_delta: Delta | None, cfg: GuardsConfig) -> GuardResult:
    """The held-out reward rose by more than ``hacking_reward_se`` paired SEs while accuracy did not rise by more
    than ``hacking_eval_se`` (flat or down). Value: the reward change in paired SEs."""
    if reward_delta is None:
        return GuardResult("reward_hacking", False, float("nan"), cfg.hacking_reward_se, "no held-out reward to compare")
    value = (reward_delta.delta / reward_delta.se if reward_delta.se > 0
             else (math.inf if reward_delta.delta > 0 else 0.0))
    if eval_delta is None:
        return GuardResult("reward_hacking", False, value, cfg.hacking_reward_se,
                           f"reward {reward_delta.text()}; no labels, so no accuracy to compare (the kl guard watches)")
    fired = (reward_delta.delta > 0 and reward_delta.beyond(cfg.hacking_reward_se)
             and not eval_delta.beyond(cfg.hacking_eval_se))
    return GuardResult("reward_hacking", fired, value, cfg.hacking_reward_se,
                       f"reward {reward_delta.text()} {'while' if fired else 'and'} accuracy {eval_delta.text()}")


def reward_disagreement(parent: ProbeRecord, child: ProbeRecord, cfg: GuardsConfig) -> GuardResult:
    """The top-rewarded ``top_fraction`` of the child's answers are correct less often than all of them by more than
    ``top_agreement_se`` binomial SEs, ``sqrt(p (1 - p) / k)`` at the child's overall accuracy p. The parent's
    figures are in the detail for comparison. Value: top accuracy minus overall accuracy."""
    if child.correct is None or child.reward is None or not child.correct:
        return GuardResult("reward_disagreement", False, float("nan"), 0.0, "needs labels and a held-out reward")
    p = _mean(child.correct)
    top, k = top_scored_accuracy(child.correct, child.reward, cfg.top_fraction)
    se = math.sqrt(p * (1 - p) / k)
    fired = top < p - cfg.top_agreement_se * se
    detail = f"top-{k} rewarded answers correct {top:.3f} vs all {p:.3f} (s.e. {se:.3f})"
    if parent.correct is not None and parent.reward is not None:
        parent_top, _ = top_scored_accuracy(parent.correct, parent.reward, cfg.top_fraction)
        detail += f"; parent {parent_top:.3f} vs {_mean(parent.correct):.3f}"
    return GuardResult("reward_disagreement", fired, top - p, -cfg.top_agreement_se * se, detail,
                       blocking="reward_disagreement" not in cfg.advisory_guards)


def skill_regressions(parent: ProbeRecord, child: ProbeRecord, cfg: GuardsConfig) -> tuple[GuardResult,
                                                                                          dict[str, float]]:
    """Per-slice paired accuracy change; fires for a slice below ``-skill_regression_se`` SEs and
    ``-skill_min_drop``. Returns the guard and ``skill_delta_<slice>`` values."""
    values: dict[str, float] = {}
    if parent.correct is None or child.correct is None or not child.slices:
        return GuardResult("skill_regression", False, float("nan"), -cfg.skill_min_drop, "no slices"), values
    worst, lost = math.inf, []
    for name in sorted({s for s in child.slices if s is not None}):
        idx = [i for i, s in enumerate(child.slices) if s == name]
        d = paired_delta([parent.correct[i] for i in idx], [child.correct[i] for i in idx])
        values[f"skill_delta_{name}"] = d.delta
        values[f"skill_delta_se_{name}"] = d.se
        worst = min(worst, d.delta)
        if d.delta < -cfg.skill_regression_se * d.se and d.delta < -cfg.skill_min_drop:
            lost.append(f"{name} {d.text()}")
    detail = ("lost: " + "; ".join(lost)) if lost else "no slice lost beyond noise"
    return GuardResult("skill_regression", bool(lost), worst, -cfg.skill_min_drop, detail), values


def check_guards(parent: ProbeRecord, child: ProbeRecord, cfg: GuardsConfig,
                 metric: tuple[Sequence[float], Sequence[float]] | None = None) -> GuardReport:
    """Every guard of ``child`` against ``parent`` (answers to the same items, in the same order).

    ``metric``: the metric command's ``(n,)`` parent and child scores on the same items in the same order
    (:func:`rlhf_core.promotion.metric_command.pair_scores`), for gate_metric command; its paired change is
    ``metric_delta`` and ``metric_*`` values."""
    if len(parent.length) != len(child.length):
        raise ValueError(f"check_guards: parent answered {len(parent.length)} items, child {len(child.length)}")
    eval_delta = (paired_delta(parent.correct, child.correct)
                  if parent.correct is not None and child.correct is not None else None)
    reward_delta = (paired_delta(parent.reward, child.reward)
                    if parent.reward is not None and child.reward is not None else None)
    len_p, len_c = _mean(parent.length), _mean(child.length)
    length_change = (len_c - len_p) / len_p if len_p > 0 else (0.0 if len_c == 0 else math.inf)
    entropy_ratio = child.entropy / parent.entropy if parent.entropy > 0 else 1.0
    values: dict[str, float] = {
        "length_mean": len_c, "length_mean_parent": len_p, "length_change": length_change,
        "entropy": child.entropy, "entropy_parent": parent.entropy, "entropy_ratio": entropy_ratio,
        "n_items": float(len(child.length)),
    }
    if child.kl is not None:
        values["kl"] = child.kl
    if eval_delta is not None:
        values.update({"eval_delta": eval_delta.delta, "eval_delta_se": eval_delta.se,
                       "accuracy": _mean(child.correct), "accuracy_parent": _mean(parent.correct)})
    if reward_delta is not None:
        values.update({"reward_delta": reward_delta.delta, "reward_delta_se": reward_delta.se,
                       "reward_mean": _mean(child.reward), "reward_mean_parent": _mean(parent.reward)})
    if child.correct is not None and child.reward is not None:
        values["top_reward_accuracy"] = top_scored_accuracy(child.correct, child.reward, cfg.top_fraction)[0]
    if parent.correct is not None and parent.reward is not None:
        values["top_reward_accuracy_parent"] = top_scored_accuracy(parent.correct, parent.reward, cfg.top_fraction)[0]

    skill, skill_values = skill_regressions(parent, child, cfg)
    values.update(skill_values)

    kl = child.kl if child.kl is not None else float("nan")
    guards = [
        reward_hacking(eval_delta, reward_delta, cfg),
        reward_disagreement(parent, child, cfg),
        GuardResult("kl", kl > cfg.max_kl, kl, cfg.max_kl, f"KL to reference {kl:.3f} nats/answer (max {cfg.max_kl:g})"),
        GuardResult("length", abs(length_change) > cfg.max_length_change, length_change, cfg.max_length_change,
                    f"answer length {len_p:.2f} -> {len_c:.2f} characters ({length_change:+.1%}, max ±"
                    f"{cfg.max_length_change:.0%})"),
        GuardResult("entropy_collapse", entropy_ratio < cfg.min_entropy_ratio, entropy_ratio, cfg.min_entropy_ratio,
                    f"entropy {parent.entropy:.4f} -> {child.entropy:.4f} nats/token (ratio {entropy_ratio:.3f}, "
                    f"min {cfg.min_entropy_ratio:g})"),
        skill,
    ]
    for g in guards:
        g.blocking = g.name not in cfg.advisory_guards
    metric_delta = paired_delta(metric[0], metric[1]) if metric is not None else None
    if metric_delta is not None:
        values.update({"metric_delta": metric_delta.delta, "metric_delta_se": metric_delta.se,
                       "metric_mean": _mean(metric[1]), "metric_mean_parent": _mean(metric[0]),
                       "metric_n_items": float(metric_delta.n)})
    return GuardReport(guards, eval_delta, reward_delta, values, metric_delta)


@dataclass
class GateDecision:
    """The promotion gate's answer: ``passed``, the metric it judged, and why not (empty when passed)."""

    passed: bool
    metric: str
    reasons: list[str]

    def text(self) -> str:
        return "gate passed" if self.passed else "gate blocked: " + "; ".join(self.reasons)


def gate_metric_name(cfg: GuardsConfig, has_labels: bool) -> str:
    """``accuracy``, ``reward`` or ``command``: what must improve (``auto``: accuracy when the eval items have
    labels, else reward)."""
    if cfg.gate_metric == "auto":
        return "accuracy" if has_labels else "reward"
    return cfg.gate_metric


def gate(report: GuardReport, cfg: GuardsConfig) -> GateDecision:
    """Pass when the gate metric rose by more than ``min_improvement_se`` paired SEs over the parent and no blocking
    guard fired; otherwise name each reason (the fired guards with their values, and a missing gain)."""
    metric = gate_metric_name(cfg, report.eval_delta is not None)
    delta = {"accuracy": report.eval_delta, "reward": report.reward_delta, "command": report.metric_delta}[metric]
    reasons = [f"{g.name}: {g.detail}" for g in report.blocking]
    if delta is None:
        hint = (" (the eval items carry no labels and the stage has no held-out reward: set guards.reward_model_path "
                "to a reward model, or gate_metric: command with a metric_command)"
                if metric == "reward" and report.eval_delta is None else "")
        reasons.append(f"no {metric} measured for both models{hint}")
    elif not delta.beyond(cfg.min_improvement_se) or delta.delta <= 0:
        reasons.append(f"{metric} gain {delta.text()} is not above {cfg.min_improvement_se:g} s.e.")
    return GateDecision(not reasons, metric, reasons)
