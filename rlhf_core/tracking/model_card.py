"""The model card: a registered version's description (markdown), which the MLflow UI shows on its version page.

It says what the version was trained from (stage, parent model and its registered version, datasets with
their DVC md5s, git commit, the stage's key params), its held-out eval against the parent with paired
standard errors, every guard with its value and threshold, and the promotion decision. Built from the
stage run's tags, params and metrics alone (what :func:`rlhf_core.stages.guard.check_stage_guards` and the
lineage tags logged), so a card can be rebuilt from the tracking store at any time.

Run: called by ``tasks.registry.register_model``.
"""

from __future__ import annotations

import math
from typing import Any

from rlhf_core.config import GUARD_NAMES
from rlhf_core.tracking.run_dashboard import DASHBOARD_TAG

KEY_PARAMS = ("algorithm.estimator", "reward.kind", "reward.function", "reward.model_path", "reward_model_path",
              "kl.coef", "kl.estimator", "kl.in_reward", "algorithm.policy_objective", "loss", "beta", "nll_weight",
              "lr", "max_steps", "batch_size", "rollout.prompts_per_step", "rollout.group_size", "rollout.temperature",
              "temperature", "seed")
"""Params shown on the card when the stage has them (all params stay on the source run)."""


def _num(value: float | None, digits: int = 4) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _row(*cells: str) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _dashboard_lines(run_id: str, tags: dict[str, str]) -> list[str]:
    """The run dashboard's link, when the run logged one (online RL stages)."""
    if DASHBOARD_TAG not in tags:
        return []
    uri = f"runs:/{run_id}/{tags[DASHBOARD_TAG]}"
    return [(f"**Run dashboard:** [`{tags[DASHBOARD_TAG]}`]({uri}), an artifact of run `{run_id}`: one HTML file that "
             f"opens offline (`mlflow artifacts download -u {uri}`), with the per-step phase timeline, staleness, "
             "reward / length / KL / entropy distributions, mismatch KL and per-sample log-probs."), ""]


def render_model_card(name: str, version: str, run_id: str, tags: dict[str, str], params: dict[str, str],
                      metrics: dict[str, float], outcome: dict[str, Any], parent_version: str | None) -> str:
    """The card's markdown. ``tags``, ``params``, ``metrics``: the stage run's; ``outcome``: the registry's answer
    (``promoted``, ``verdict``, ``gate``); ``parent_version``: ``NAME vN`` of the parent model, if registered."""
    stage = tags.get("alignflow.stage", "?")
    status = "champion" if outcome.get("promoted") else "candidate (not promoted)"
    lines = [f"## {name} v{version}: {status}", "",
             (f"**Trained by** stage `{stage}`, run `{run_id}`, git commit `{tags.get('git.commit', '?')}`, "
              f"alignflow {tags.get('alignflow.version', '?')}."), "",
             (f"**Parent:** `{tags.get('input.model', tags.get('guard.parent_model', '?'))}` (DVC md5 "
              f"`{tags.get('dvc.md5.model', tags.get('guard.parent_md5', '?'))}`), registered as "
              f"{parent_version or 'none (not registered)'}."), "",
             *_dashboard_lines(run_id, tags),
             "### Data", "", _row("input", "path", "DVC md5"), _row("---", "---", "---")]
    for key in sorted(k for k in tags if k.startswith("dvc.md5.") and k != "dvc.md5.output_model"):
        what = key[len("dvc.md5."):]
        lines.append(_row(what, f"`{tags.get(f'input.{what}', '')}`", f"`{tags[key]}`"))
    lines.append(_row("output model", "", f"`{tags.get('dvc.md5.output_model', '?')}`"))
    shown = [(k, params[k]) for k in KEY_PARAMS if k in params]
    if shown:
        lines += ["", "### Key params", "", _row("param", "value"), _row("---", "---")]
        lines += [_row(k, f"`{v}`") for k, v in shown]

    n = metrics.get("guard/n_items", metrics.get("eval/n_items"))
    lines += ["", f"### Held-out eval ({int(n) if n else '?'} items; parent and this model on the same items)", "",
              _row("metric", "parent", "this model", "change ± paired s.e."), _row("---", "---", "---", "---")]
    if "guard/accuracy" in metrics:
        lines.append(_row("accuracy", _num(metrics.get("guard/accuracy_parent")), _num(metrics["guard/accuracy"]),
                          f"{metrics['guard/eval_delta']:+.4f} ± {metrics['guard/eval_delta_se']:.4f}"))
    elif "eval/accuracy" in metrics:
        lines.append(_row("accuracy", "–", f"{_num(metrics['eval/accuracy'])} ± "
                                           f"{_num(metrics.get('eval/accuracy_stderr'))}", "–"))
    for key in sorted(k for k in metrics if k.startswith("guard/skill_delta_") and "_se_" not in k):
        skill = key[len("guard/skill_delta_"):]
        child_acc = metrics.get(f"eval/accuracy_{skill}")
        lines.append(_row(f"accuracy, {skill}", _num(None if child_acc is None else child_acc - metrics[key]),
                          _num(child_acc),
                          f"{metrics[key]:+.4f} ± {metrics.get(f'guard/skill_delta_se_{skill}', float('nan')):.4f}"))
    if "guard/reward_mean" in metrics:
        lines.append(_row("held-out reward score", _num(metrics.get("guard/reward_mean_parent")),
                          _num(metrics["guard/reward_mean"]),
                          f"{metrics['guard/reward_delta']:+.4f} ± {metrics['guard/reward_delta_se']:.4f}"))
    if "guard/metric_mean" in metrics:
        lines.append(_row("metric command score", _num(metrics.get("guard/metric_mean_parent")),
                          _num(metrics["guard/metric_mean"]),
                          f"{metrics['guard/metric_delta']:+.4f} ± {metrics['guard/metric_delta_se']:.4f}"))
    if "guard/length_mean" in metrics:
        lines.append(_row("answer length (characters)", _num(metrics.get("guard/length_mean_parent"), 2),
                          _num(metrics["guard/length_mean"], 2), f"{metrics.get('guard/length_change', 0):+.1%}"))
    if "guard/entropy" in metrics:
        lines.append(_row("next-token entropy (nats)", _num(metrics.get("guard/entropy_parent")),
                          _num(metrics["guard/entropy"]), f"ratio {_num(metrics.get('guard/entropy_ratio'), 3)}"))
    if "guard/kl" in metrics:
        lines.append(_row("KL to reference (nats/answer)", "0", _num(metrics["guard/kl"]), ""))

    lines += ["", (f"### Guards (fired: {tags.get('guard.fired', 'not computed')}; blocking promotion: "
                   f"{tags.get('guard.blocking', 'none')})"), ""]
    if "guard.fired" in tags:
        lines += [_row("guard", "status"), _row("---", "---")]
        lines += [_row(g, tags.get(f"guard.{g}", "–")) for g in GUARD_NAMES]
    else:
        lines.append("No guards were computed for this stage (guards.enabled off, or no eval file).")
    lines += ["", "### Promotion", "", f"{outcome.get('verdict', '?')}", "",
              f"Gate ({tags.get('guard.gate_metric', 'accuracy')}): {outcome.get('gate', 'no gate')}"]
    return "\n".join(lines) + "\n"
