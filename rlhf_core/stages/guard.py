"""Guard a policy stage's model: answer the stage's eval items with the parent model and the trained one, check
every guard and the promotion gate (:mod:`rlhf_core.promotion.guards`), and log them to the stage's run.

Here rather than in :mod:`rlhf_core.promotion` because it needs what sits above that package: the DVC md5s and
the project folder of :mod:`rlhf_core.tracking` (the probe cache's keys and place) and RL's reward sources
(:mod:`rlhf_core.trainers.rl`). Called by :mod:`rlhf_core.stages.wrappers` after the trainer, before the model is
registered.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from rlhf_core.common.redact import redact_secrets
from rlhf_core.config import GuardsConfig
from rlhf_core.promotion.guards import check_guards, gate
from rlhf_core.promotion.metric_command import pair_scores, read_scores, run_metric_command
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.tracking.mlflow_runs import project_root


def _reward_for_guards(stage: str, cfg: Any, guards: GuardsConfig, device: Any) -> tuple[Any, Any]:
    """The held-out reward and its identity (a cache key part; None: never cache): rl's own reward (model,
    function or server), else the reward model of ``guards.reward_model_path`` when that folder exists."""
    from rlhf_core.rewards.sources import (  # lazy: torch (light `alignflow validate`)
        RewardKind, build_reward_source, resolve_reward_file)

    if stage == "rl":
        kind = RewardKind(cfg.reward.kind)
        if kind is RewardKind.MODEL:
            ident: Any = {"model": dvc_md5(cfg.reward.model_path)}
        elif kind is RewardKind.FUNCTION:
            file, fn = cfg.reward.function.rsplit(":", 1)
            ident = {"function": dvc_md5(resolve_reward_file(file)), "name": fn}
        else:
            ident = None  # a server's answers may change: never cache them
        from rlhf_core.trainers.rl_parts import reward_source_for  # lazy: torch (light `alignflow validate`)

        return reward_source_for(cfg, kind, device), ident
    if guards.reward_model_path and Path(guards.reward_model_path).is_dir():
        return (build_reward_source("model", path=guards.reward_model_path, device=device),
                {"model": dvc_md5(guards.reward_model_path)})
    return None, {"reward": None}


def check_stage_guards(stage: str, cfg: Any, child_dir: Path, guards: GuardsConfig, run: Any,
                       eval_answers: dict[str, Any] | None = None) -> dict[str, float]:
    """Answer the stage's eval items with its parent (``cfg.model_path``, cached) and the trained model, check every
    guard (:func:`rlhf_core.promotion.guards.check_guards`) and the gate, and log them to ``run``: ``guard/*`` metrics,
    ``guard.*`` tags (``guard.fired``, ``guard.gate``, ...), ``guards/report.json`` and ``guards/per_item.json``
    (both models' per-item results on the same items: what a paired comparison needs). Returns the metrics.

    ``eval_answers``: the stage's final eval's greedy answers (:class:`rlhf_core.rollout.evaluate.GreedyAnswers`), reused
    for the child when their settings are the probe's (:func:`rlhf_core.promotion.probe.reusable_answers`). A stage with
    an environment (``rl.environment.spec``) is probed multi-turn with it, as its own eval answers
    (:func:`_probe_environment`; tag ``guard.probe``). With ``guards.gate_metric: command`` the user's metric command scores both models first
    (:func:`_metric_command_scores`); any fault there fails the stage before its model is registered."""
    from rlhf_core.promotion.probe import read_eval_items  # lazy: torch (light `alignflow validate`)
    from rlhf_core.models.loading import load_tokenizer, pick_device  # lazy: torch (light `alignflow validate`)

    metric = _metric_command_scores(cfg, guards, child_dir, run) if guards.gate_metric == "command" else None
    device = pick_device()
    tokenizer = load_tokenizer(child_dir)
    items = read_eval_items(cfg.eval_file, tokenizer, prompt_field=cfg.prompt_field, label_field=cfg.label_field,
                            slice_field=guards.slice_field, max_items=getattr(cfg, "eval_items", 1000),
                            label_check=cfg.label_check)
    reward_fn, reward_id = _reward_for_guards(stage, cfg, guards, device)
    env = _probe_environment(stage, cfg)
    run.set_tags({"guard.probe": "single-turn" if env is None else
                  f"multi-turn with the environment {redact_secrets(cfg.environment.spec)} (max_turns {env.max_turns}, "
                  f"max_trajectory_tokens {env.max_trajectory_tokens}, max_new_tokens {env.max_new_tokens})"})
    parent, parent_answers = _probe_parent(cfg, guards, items, reward_fn, reward_id, device, env)
    child, child_answers = _probe_child(cfg, child_dir, tokenizer, items, reward_fn, device, eval_answers, run, env)
    report = check_guards(parent, child, guards, metric)
    decision = gate(report, guards)
    metrics = report.metrics()
    metrics["guard/gate_passed"] = float(decision.passed)
    parent_dir = Path(cfg.model_path)
    run.log_metrics(metrics, 0)
    run.set_tags({**report.tags(), "guard.gate": decision.text()[:4900], "guard.gate_metric": decision.metric,
                  "guard.gate_passed": str(decision.passed).lower(), "guard.parent_model": str(parent_dir),
                  "guard.parent_md5": dvc_md5(parent_dir)})
    run.log_dict({**report.to_dict(), "gate": decision.__dict__}, "guards/report.json")
    run.log_dict({"eval_file": str(cfg.eval_file), "eval_md5": dvc_md5(cfg.eval_file), "parent": str(parent_dir),
                  "child": str(child_dir), "items": [
                      {"i": i, "prompt": p, "label": None if y is None else str(y), "slice": sl,
                       "parent_answer": pa, "child_answer": ca,
                       "parent_correct": None if parent.correct is None else parent.correct[i],
                       "child_correct": None if child.correct is None else child.correct[i],
                       "parent_reward": None if parent.reward is None else parent.reward[i],
                       "child_reward": None if child.reward is None else child.reward[i]}
                      for i, (p, y, sl, pa, ca) in enumerate(zip(items.prompts, items.labels, items.slices,
                                                                 parent_answers, child_answers))]},
                 "guards/per_item.json")
    return metrics


def _probe_environment(stage: str, cfg: Any) -> Any:
    """The multi-turn probe setting of an rl stage with an environment (the environment, turn limit and token
    budgets of its own eval, :func:`rlhf_core.rollout.environments.evaluate_with_environment`), else None (single-turn)."""
    from rlhf_core.rollout.environments import environment_factory  # lazy: torch (light `alignflow validate`)
    from rlhf_core.promotion.probe import ProbeEnvironment  # lazy: torch (light `alignflow validate`)
    from rlhf_core.rewards.sources import resolve_reward_file  # lazy: torch (light `alignflow validate`)

    if stage != "rl" or not cfg.environment.spec:
        return None
    spec = cfg.environment.spec
    make_env = environment_factory(spec, stop_tokens=cfg.environment.stop_tokens, timeout_s=cfg.reward.timeout_s,
                                   retries=cfg.reward.retries, backoff_cap_s=cfg.reward.backoff_cap_s,
                                   deadline_s=cfg.reward.deadline_s, token_env=cfg.environment.token_env,
                                   max_response_bytes=cfg.reward.max_response_bytes)
    limits = {"max_turns": cfg.environment.max_turns, "max_trajectory_tokens": cfg.environment.max_trajectory_tokens,
              "max_new_tokens": cfg.rollout.max_new_tokens, "tool_messages": cfg.environment.tool_messages}
    identity = None  # a server's replies may change: never cache them
    if not spec.startswith(("http://", "https://")):
        file, fn = spec.rsplit(":", 1)
        identity = {"file": dvc_md5(resolve_reward_file(file)), "name": fn, **limits}
    return ProbeEnvironment(make_env, identity, **limits, prompt_field=cfg.prompt_field)


def _max_new_tokens(cfg: Any) -> int:
    """The generation budget an answer is probed with: rl's rollouts' (``rl.rollout.max_new_tokens``), else 12."""
    return getattr(getattr(cfg, "rollout", None), "max_new_tokens", 12)


def _probe_settings(cfg: Any, guards: GuardsConfig, reward_id: Any, env: Any = None) -> dict[str, Any]:
    """What the parent's probe depends on besides the model and the eval file (its cache key's settings); a
    multi-turn probe adds its environment's identity, so it never reads a single-turn record (and single-turn keys
    stay what they were)."""
    settings = {"max_items": getattr(cfg, "eval_items", 1000), "max_new_tokens": _max_new_tokens(cfg),
                "reward": reward_id, "fields": [cfg.prompt_field, cfg.label_field, guards.slice_field], "probe": 1}
    if cfg.label_check:  # keys without one stay what they were
        settings["label_check"] = cfg.label_check
    if env is not None:
        settings["environment"] = env.identity
    return settings


def _probe_parent(cfg: Any, guards: GuardsConfig, items: Any, reward_fn: Any, reward_id: Any,
                  device: Any, env: Any = None) -> tuple[Any, list[str]]:
    """The parent's probe record and answers: from the cache under ``.alignflow/probes/`` when there (never for a
    reward or an environment without an identity, a server), else answered now (multi-turn with ``env`` when
    given) and cached."""
    from rlhf_core.promotion.probe import (  # lazy: torch (light `alignflow validate`)
        load_cached, probe, probe_key, probe_with_environment, save_cached)
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer  # lazy: torch (light `alignflow validate`)

    parent_dir = Path(cfg.model_path)
    settings = _probe_settings(cfg, guards, reward_id, env)
    cacheable = reward_id and (env is None or env.identity is not None)
    cache = (project_root() / ".alignflow" / "probes" /
             f"{probe_key(dvc_md5(parent_dir), dvc_md5(cfg.eval_file), settings)}.json") if cacheable else None
    cached = load_cached(cache) if cache is not None else None
    if cached is None:
        parent_model = load_causal_lm(parent_dir, device)
        if env is not None:
            cached = probe_with_environment(parent_model, load_tokenizer(parent_dir), items, env, reward_fn=reward_fn)
        else:
            cached = probe(parent_model, load_tokenizer(parent_dir), items, reward_fn=reward_fn,
                           max_new_tokens=settings["max_new_tokens"])
        del parent_model
        if cache is not None:
            save_cached(cache, *cached)
    return cached


def _probe_child(cfg: Any, child_dir: Path, tokenizer: Any, items: Any, reward_fn: Any, device: Any,
                 eval_answers: dict[str, Any] | None, run: Any, env: Any = None) -> tuple[Any, list[str]]:
    """The trained model's probe record (KL against ``cfg.ref_model_path``, else the parent) and answers; the
    stage's final-eval answers stand in for generating them again when they match (tag ``guard.child_answers``).
    With ``env`` the child answers multi-turn, afresh (the stage's eval keeps only its first trajectories)."""
    from rlhf_core.promotion.probe import (  # lazy: torch (light `alignflow validate`)
        probe, probe_with_environment, reusable_answers)
    from rlhf_core.models.loading import load_causal_lm  # lazy: torch (light `alignflow validate`)

    reference_dir = Path(getattr(cfg, "ref_model_path", "") or cfg.model_path)
    child_model = load_causal_lm(child_dir, device)
    if env is not None:
        run.set_tags({"guard.child_answers": "generated by the probe (multi-turn, with the environment)"})
        reference = load_causal_lm(reference_dir, device)
        out = probe_with_environment(child_model, tokenizer, items, env, reward_fn=reward_fn, reference=reference)
        del child_model, reference
        return out
    answers = reusable_answers(eval_answers, child_model, eval_file=cfg.eval_file,
                               max_items=getattr(cfg, "eval_items", 1000),
                               max_new_tokens=_max_new_tokens(cfg), prompt_field=cfg.prompt_field,
                               n_items=len(items.prompts))
    run.set_tags({"guard.child_answers": "reused from the stage's final eval" if answers is not None
                  else "generated by the probe"})
    reference = load_causal_lm(reference_dir, device)
    out = probe(child_model, tokenizer, items, reward_fn=reward_fn, reference=reference,
                max_new_tokens=_max_new_tokens(cfg), answers=answers)
    del child_model, reference
    return out


def _metric_command_scores(cfg: Any, guards: GuardsConfig, child_dir: Path,
                           run: Any) -> tuple[list[float], list[float]]:
    """``guards.metric_command``'s per-item scores of the parent (cached on its md5, the eval file's, the command
    and the md5 of each existing file the command names) and of the child, paired by id
    (:mod:`rlhf_core.promotion.metric_command`); the pairs go to the run as ``guards/metric_scores.json``."""
    from rlhf_core.promotion.probe import probe_key  # lazy: torch (light `alignflow validate`)

    root, parent_dir = project_root(), Path(cfg.model_path)
    named = sorted({t for t in shlex.split(guards.metric_command) if "{" not in t and (root / t).is_file()})
    key = probe_key(dvc_md5(parent_dir), dvc_md5(cfg.eval_file),
                    {"command": guards.metric_command, "files": {t: dvc_md5(root / t) for t in named}})
    cache = root / ".alignflow" / "probes" / f"{key}.metric.jsonl"
    common = dict(eval_file=cfg.eval_file, cwd=root, timeout_s=guards.metric_command_timeout_s)
    if cache.exists():
        parent = read_scores(cache)
    else:
        parent = run_metric_command(guards.metric_command, model=parent_dir, out=cache.with_suffix(".tmp"), **common)
        os.replace(cache.with_suffix(".tmp"), cache)
    child_file = root / ".alignflow" / "metric" / f"{getattr(run, 'run_id', None) or 'stage'}-child.jsonl"
    child = run_metric_command(guards.metric_command, model=child_dir, out=child_file, **common)
    ids, parent_scores, child_scores = pair_scores(parent, child)
    run.log_dict({"command": guards.metric_command, "parent": str(parent_dir), "child": str(child_dir),
                  "items": [{"id": i, "parent": p, "child": c} for i, p, c in zip(ids, parent_scores, child_scores)]},
                 "guards/metric_scores.json")
    return parent_scores, child_scores
