"""The guard probe of a stage with an environment answers multi-turn, with the tool, as the stage's own eval does.

A micro model with the tool tags, nudged to close a tool call (``</calc>``'s embedding, as in
tests/model/test_tool_rollout.py), so greedy turns end at the stop token and the environment answers. The
scripted environment replies ``<result>7</result>`` and rewards half the items (by their label's length), so the
per-item correctness varies and must come out of the environment's reward plus the rule reward, as in
:func:`rlhf_core.rollout.environments.evaluate_with_environment`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_core.config import GuardsConfig, RLConfig, build_config
from rlhf_core.rollout.environments import evaluate_with_environment
from rlhf_core.promotion.probe import (ProbeEnvironment, load_cached, probe_key, probe_with_environment, read_eval_items,
                                   trajectory_statistics)
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.sources import load_function
from rlhf_core.rollout.tool_task import reward

OBS = "<result>7</result>"
LIMITS = dict(max_turns=2, max_trajectory_tokens=16, max_new_tokens=8)
N_ITEMS = 24


@pytest.fixture(scope="module")
def env_spec(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("env") / "env.py"
    path.write_text("from rlhf_core.rollout.environments import StepResult\n\n"
                    "class Env:\n    stop_tokens = ('</calc>',)\n"
                    "    def reset(self, prompt, label):\n        self.label = label\n"
                    f"    def step(self, action):\n        return StepResult({OBS!r}, reward=float(len(self.label) % 2))\n\n"
                    "def make_env():\n    return Env()\n")
    return f"{path}:make_env"


class _Run:
    """What check_stage_guards logs to, kept in memory."""

    def __init__(self):
        self.tags, self.dicts, self.metrics = {}, {}, {}

    def set_tags(self, tags):
        self.tags.update(tags)

    def log_metrics(self, metrics, step):
        self.metrics.update(metrics)

    def log_dict(self, obj, name):
        self.dicts[name] = obj


@torch.no_grad()
def _expected_policy_entropy(model, batch) -> float:
    """Mean next-token entropy over the positions that predict a policy token, one unpadded sequence at a time."""
    total, count = 0.0, 0
    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        k = int(batch.response_mask[i].sum())
        seq = torch.cat([prompt, batch.response_ids[i, :k]])[None]
        logp = torch.log_softmax(model(input_ids=seq).logits[0].float(), -1)
        for j in range(k):
            if batch.action_mask[i, j]:
                lp = logp[len(prompt) + j - 1]
                total += float(-(lp.exp() * lp).sum())
                count += 1
    return total / count


def test_probe_with_an_environment_is_the_stage_eval_multi_turn(tool_model, env_spec, micro_data):
    """Same trajectories and scores as evaluate_with_environment; length, entropy and KL over the policy's tokens."""
    from rlhf_core.rollout.environments import rollout_with_environment
    from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams

    model, tokenizer = load_causal_lm(tool_model), load_tokenizer(tool_model)
    make_env = load_function(env_spec)[2]
    items = read_eval_items(micro_data["eval"], tokenizer, prompt_field="prompt", label_field="label",
                            slice_field="skill", max_items=N_ITEMS)
    record, answers = probe_with_environment(model, tokenizer, items, ProbeEnvironment(make_env, {}, **LIMITS),
                                             reward_fn=reward, reference=model)
    metrics, rows = evaluate_with_environment(model, tokenizer, str(micro_data["eval"]), make_env, reward,
                                              max_items=N_ITEMS, **LIMITS)
    assert sum(OBS in a for a in answers) == N_ITEMS  # every item called the tool and read its reply
    assert 0.0 < sum(record.correct) / N_ITEMS < 1.0
    assert sum(record.correct) / N_ITEMS == metrics["eval/accuracy_tool"]
    assert record.reward[:len(rows)] == [r["reward"] for r in rows]
    assert record.slices == items.slices
    # the observation is the environment's, not the policy's: never in the length
    assert record.length == [float(len(a) - a.count(OBS) * len(OBS)) for a in answers]
    assert abs(record.kl) < 1e-5  # KL(model || model)
    batch, _ = rollout_with_environment(HFGenerateEngine(model, tokenizer, batch_size=256), tokenizer, items.prompts,
                                        [str(y) for y in items.labels],
                                        SamplingParams(n=1, temperature=0.0, max_new_tokens=8), make_env,
                                        max_turns=2, max_trajectory_tokens=16)
    assert record.entropy == pytest.approx(_expected_policy_entropy(model, batch), rel=1e-4)
    everything = dataclasses.replace(batch, action_mask=torch.ones_like(batch.action_mask))
    assert trajectory_statistics(model, tokenizer, everything)[1] != pytest.approx(record.entropy, rel=1e-4)


def test_rl_stage_with_an_environment_probes_multi_turn_under_its_own_cache_key(isolated_project, tool_model,
                                                                               env_spec, micro_data):
    """check_stage_guards probes an rl stage with an environment multi-turn (both models), and caches the parent under
    a key of its own: a single-turn record of the same model is never read for it."""
    from rlhf_core.stages.guard import _probe_environment, _probe_settings, check_stage_guards

    cfg = build_config(RLConfig, "rl", {"model_path": str(tool_model), "prompts_file": str(micro_data["prompts"]),
                                        "eval_file": str(micro_data["eval"]),
                                        "output_dir": str(isolated_project / "rl"), "reward.kind": "function",
                                        "reward.function": "rlhf_core/rollout/tool_task.py:reward",
                                        "environment.spec": env_spec, "eval_items": N_ITEMS, **LIMITS})
    single = dataclasses.replace(cfg, environment=dataclasses.replace(cfg.environment, spec=""))
    guards = GuardsConfig()
    runs = {}
    for name, c in (("single", single), ("multi", cfg)):
        runs[name] = _Run()
        check_stage_guards("rl", c, tool_model, guards, runs[name])
    multi, one = runs["multi"], runs["single"]
    assert multi.tags["guard.probe"].startswith("multi-turn with the environment")
    assert one.tags["guard.probe"] == "single-turn"
    per_item = multi.dicts["guards/per_item.json"]["items"]
    assert all(OBS in it["parent_answer"] and OBS in it["child_answer"] for it in per_item)
    assert not any(OBS in it["child_answer"] for it in one.dicts["guards/per_item.json"]["items"])
    assert multi.metrics["guard/eval_delta"] == 0.0  # the same model on both sides

    env = _probe_environment("rl", cfg)
    reward_id = {"function": "x", "name": "reward"}
    single_settings = _probe_settings(single, guards, reward_id)
    assert "environment" not in single_settings  # single-turn keys are what they were before
    key_single = probe_key("m", "e", single_settings)
    key_multi = probe_key("m", "e", _probe_settings(cfg, guards, reward_id, env))
    assert key_single != key_multi
    assert env.identity["max_turns"] == 2 and env.identity["file"]
    cached = sorted((isolated_project / ".alignflow" / "probes").glob("*.json"))
    assert len(cached) == 2  # one record per probe kind, neither standing in for the other
    answers = [load_cached(p)[1] for p in cached]
    assert sorted(any(OBS in a for a in ans) for ans in answers) == [False, True]
