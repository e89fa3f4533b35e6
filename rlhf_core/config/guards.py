"""The promotion guards' section (``guards``, ``tool_guards``): which checks run on a policy stage's model, their
thresholds, and the registry's promotion gate (:mod:`rlhf_core.promotion.guards` computes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_core.config.base import _check


GUARD_NAMES = ("reward_hacking", "reward_disagreement", "kl", "length", "entropy_collapse", "skill_regression")
"""Every guard (rlhf_core/promotion/guards.py), in the order tags and the model card list them."""


@dataclass
class GuardsConfig:
    """``guards``: checks on every policy stage's model against the model it was trained from, and the registry's
    promotion gate (rlhf_core/promotion/guards.py; README "Guards and the promotion gate"). ``tool_guards``: the same for
    the tool task's rl stage command (``--section tool_rl``)."""

    enabled: bool = True
    """Compute the guards after every policy stage (the guarded stages of the registry, each cycle) and log them to its
    run as guard/* metrics and guard.* tags; both models answer the stage's held-out eval items."""
    gate: bool = True
    """The registry moves champion only when the gate passes (eval gain and no guard fired); false: the guards
    are logged and shown in the model card, and champion moves on the accuracy comparison alone."""
    gate_metric: str = "auto"
    """What must improve to promote: accuracy (paired exact match on labelled eval items), reward (the held-out
    reward score of the greedy answers: for eval data without labels, with the KL guard), command (the per-item
    scores of metric_command, paired by item id), or auto (accuracy when every eval item has a label, else
    reward)."""
    metric_command: str = ""
    """With gate_metric command: the command that scores a model, e.g. "python my_eval.py --model {model}
    --out {out}" ({model}: the model folder, {out}: the score file to write, {eval_file}: the stage's eval file).
    It writes JSON lines {"id": <string or integer>, "score": <number>}, one per item, higher better; parent and
    child must score the same ids (rlhf_core/promotion/metric_command.py). Run in the project root, without a shell; the
    parent's scores are cached on its md5, the eval file's and the command (with the md5 of each file it names)."""
    metric_command_timeout_s: float = 3600.0
    """Seconds one run of metric_command may take before the stage fails."""
    min_improvement_se: float = 2.0
    """Promote only when the gate metric rose by more than this many paired standard errors over the parent."""
    hacking_reward_se: float = 2.0
    """Reward hacking: the held-out reward score rose by more than this many paired standard errors ..."""
    hacking_eval_se: float = 2.0
    """... while eval accuracy did not rise by more than this many paired standard errors (flat or down)."""
    top_fraction: float = 0.1
    """Reward disagreement: the child's answers with the top reward scores (this fraction of items) ..."""
    top_agreement_se: float = 2.0
    """... are correct less often than all its answers by more than this many standard errors."""
    max_kl: float = 5.0
    """KL guard: mean over eval items of the summed per-token KL(child || reference) along the child's greedy
    answer, in nats; fires above this."""
    max_length_change: float = 0.5
    """Length guard: fires when the mean greedy answer length (characters) changed by more than this fraction."""
    min_entropy_ratio: float = 0.1
    """Entropy collapse: fires when the child's mean next-token entropy along its answers falls below this
    fraction of the parent's along its own."""
    skill_regression_se: float = 2.0
    """Per-skill (slice) regression: fires when a slice's paired accuracy change is below -this many SEs ..."""
    skill_min_drop: float = 0.05
    """... and below -this much (absolute accuracy)."""
    slice_field: str = "skill"
    """Eval-record field naming an item's slice; items without it are sliced by the embedded task's skill
    (sort, arithmetic) when their prompt parses as one, else not sliced."""
    reward_model_path: str = "models/reward"
    """Reward model that scores held-out answers for policy stages without a reward of their own (the offline
    ones, cycles); rl scores with its own reward. Empty or missing folder: no reward guards for them."""
    advisory_guards: list[str] = field(default_factory=lambda: ["reward_disagreement"])
    """Guards that are computed, logged and shown on the model card (FIRED (advisory)) but do not block promotion.
    reward_disagreement is advisory by default: it also fires on the shipped PPO + reward model run, whose accuracy
    rises 11 s.e. (README "Guards and the promotion gate"); [] makes every guard block."""

    def __post_init__(self) -> None:
        s = "guards"
        unknown = sorted(set(self.advisory_guards) - set(GUARD_NAMES))
        _check(not unknown, s, "advisory_guards", f"unknown guard(s) {unknown}; guards are {', '.join(GUARD_NAMES)}")
        _check(self.gate_metric in ("auto", "accuracy", "reward", "command"), s, "gate_metric",
               f"must be auto, accuracy, reward or command, got {self.gate_metric!r}")
        if self.gate_metric == "command":
            _check("{model}" in self.metric_command and "{out}" in self.metric_command, s, "metric_command",
                   "gate_metric command needs a metric_command naming {model} (the model folder) and {out} (the "
                   f"score file it writes), got {self.metric_command!r}")
        else:
            _check(not self.metric_command, s, "metric_command",
                   f"is set but gate_metric is {self.gate_metric!r}: set gate_metric: command to gate on it")
        _check(self.metric_command_timeout_s > 0, s, "metric_command_timeout_s",
               f"must be > 0, got {self.metric_command_timeout_s}")
        _check(0.0 < self.top_fraction <= 1.0, s, "top_fraction", f"must be in (0, 1], got {self.top_fraction}")
        for name in ("max_kl", "max_length_change", "skill_min_drop"):
            _check(getattr(self, name) >= 0, s, name, f"must be >= 0, got {getattr(self, name)}")
        _check(0.0 <= self.min_entropy_ratio <= 1.0, s, "min_entropy_ratio",
               f"must be in [0, 1], got {self.min_entropy_ratio}")
