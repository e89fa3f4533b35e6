"""Multi-turn rollouts on a micro model: a trajectory is the sampled ids plus the observation ids, the learner
trains on exactly those ids, and observation tokens carry zero loss and zero advantage.

The micro model is nudged to close a tool call often (``</calc>``'s embedding gets a large shared
component, :func:`_nudged_model`), so a few sampled turns end at the stop token and the environment
answers; no training is needed for the mechanics. The RL-to-0.5 check of the real tool task is slow-tier
(tests/e2e/test_tool_task_slow.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TOOL_OBSERVATION, Recorder, recomputed_logprobs

from rlhf_core.config import RLConfig, build_config
from rlhf_core.rollout.environments import rollout_with_environment
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.algorithms.rl_math import policy_loss
from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
from rlhf_core.rollout.static import StaticCacheEngine

REPO = Path(__file__).resolve().parents[2]


def _rollout(engine, tokenizer, params, **kw):
    from rlhf_core.rewards.sources import load_function

    make_env = load_function(kw.pop("env"))[2]
    return rollout_with_environment(engine, tokenizer, ["12+3=", "4*5=", "77-9="], ["15", "20", "68"], params,
                                    make_env, **kw)


def _two_iterations(tool_model, env, micro_data, tmp_path, **kw) -> RLConfig:
    """Two RL iterations of 4 prompts x 4 trajectories with ``env``, up to 3 turns, on the HF engine."""
    return build_config(RLConfig, "rl", {**{**{
        "model_path": str(tool_model), "prompts_file": str(micro_data["prompts"]), "eval_file": str(micro_data["eval"]),
        "output_dir": str(tmp_path / "rl"), "checkpoint_dir": str(tmp_path / "ckpt"),
        "reward.function": str(REPO / "rlhf_core/rollout/tool_task.py:reward"), "environment.spec": env,
        "environment.max_turns": 3,
        "environment.max_trajectory_tokens": 20, "rollout.max_new_tokens": 6, "max_steps": 2,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "batch_size": 64,
        "algorithm.mini_batch_size": 16, "lr": 3e-3, "warmup_steps": 0, "eval_items": 8, "eval_at_start": False,
        "log_rollouts_every": 1,
        "num_threads": 1, "rollout.engine": "hf"}, **kw}})


def test_trajectory_is_the_sampled_ids_plus_the_observation_ids(tool_model, scripted_env):
    """Each turn's tokens are the engine's samples, unchanged; between turns the observation's own ids; the
    learner's recomputed log-prob of every sampled token equals the engine's (so it scores the same tokens in
    the same contexts); limits hold."""
    model, tokenizer = load_causal_lm(tool_model), load_tokenizer(tool_model)
    engine = HFGenerateEngine(model, tokenizer)
    turns: list = []
    real = engine.generate_ids
    engine.generate_ids = lambda enc, p, prompts=None: turns.append(real(enc, p, prompts)) or turns[-1]
    batch, env_rewards = _rollout(engine, tokenizer, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=3),
                                  env=scripted_env, max_turns=3, max_trajectory_tokens=30)
    obs_ids = tokenizer.encode(TOOL_OBSERVATION, add_special_tokens=False)
    stop = tokenizer.convert_tokens_to_ids("</calc>")
    calls = batch.tool_calls.tolist()
    assert 0 < sum(calls) and 0 in calls and 2 in calls  # some trajectories called the tool, some twice
    assert torch.equal(env_rewards, torch.zeros(12))
    # turn t sampled the rows that had made t tool calls (a call is what continues a trajectory), in order
    sampled: dict[int, list[int]] = {i: [] for i in range(len(batch))}
    for t, turn in enumerate(turns):
        live = [i for i in range(len(batch)) if calls[i] >= t]
        assert len(turn) == len(live)
        for pos, i in enumerate(live):
            sampled[i] += turn.response_ids[pos, :int(turn.response_mask[pos].sum())].tolist()
    for i in range(len(batch)):
        k = int(batch.response_mask[i].sum())
        ids, actions = batch.response_ids[i, :k].tolist(), batch.action_mask[i, :k].tolist()
        assert [t for t, a in zip(ids, actions) if a] == sampled[i]  # the policy's tokens: the samples, unchanged
        assert k <= 30 and calls[i] <= 2 and ids.count(stop) >= calls[i]
        # the rest: one observation's ids right after each closing tag
        expected = []
        for t in sampled[i]:
            expected.append(t)
            if t == stop and expected.count(stop) <= calls[i]:
                expected += obs_ids
        assert ids == expected
    assert torch.equal(batch.sampling_logprobs * (1 - batch.action_mask), torch.zeros_like(batch.sampling_logprobs))
    logp = recomputed_logprobs(model, batch)
    mask = batch.loss_mask().float()
    assert torch.allclose(logp * mask, batch.sampling_logprobs, atol=1e-4)


def test_static_engine_decodes_the_same_greedy_trajectories_as_hf(tool_model, scripted_env):
    model, tokenizer = load_causal_lm(tool_model), load_tokenizer(tool_model)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    hf, _ = _rollout(HFGenerateEngine(model, tokenizer), tokenizer, greedy, env=scripted_env, max_turns=3,
                     max_trajectory_tokens=30)
    ours, _ = _rollout(StaticCacheEngine(model, tokenizer), tokenizer, greedy, env=scripted_env, max_turns=3,
                       max_trajectory_tokens=30)
    assert torch.equal(hf.response_ids, ours.response_ids) and torch.equal(hf.action_mask, ours.action_mask)
    assert torch.allclose(hf.sampling_logprobs, ours.sampling_logprobs, atol=1e-4)


def test_trainer_trains_on_the_sampled_ids_and_gives_observations_no_loss_and_no_advantage(
        tool_model, scripted_env, micro_data, tmp_path):
    """One RL iteration with the environment, phase by phase: the learner's response ids are the rollout's
    (the engine's samples plus observations), its mask and advantages are 0 on observation tokens, and the
    policy loss has no gradient there. Then two iterations end to end: tool metrics, the trajectory table
    (text, action mask, tool calls) and the greedy multi-turn eval."""
    from rlhf_core.trainers.rl import RLTrainer, PhaseTimes, train_rl

    cfg = _two_iterations(tool_model, scripted_env, micro_data, tmp_path)
    trainer = RLTrainer(cfg, Recorder())
    sampled = trainer.generate(1, PhaseTimes())
    batch = sampled.batch
    assert batch.action_mask is not None and bool((batch.action_mask[batch.response_mask.bool()] == 0).any())
    exp = trainer.score_logprobs(batch)
    trainer.estimate_advantages(exp, sampled.rewards + torch.arange(len(batch)) % 2)  # distinct scores
    observation = (batch.response_mask * (1 - batch.action_mask)).bool()
    assert torch.equal(exp.tensors["response_ids"].cpu(), batch.response_ids)
    assert not exp.tensors["mask"][observation].any() and not exp.tensors["advantages"][observation].any()
    assert exp.tensors["advantages"][batch.loss_mask().bool()].abs().sum() > 0
    logp = exp.sampling_logp.clone().requires_grad_(True)
    loss, _ = policy_loss("ppo_clip", logp, exp.sampling_logp, exp.tensors["advantages"], exp.tensors["mask"],
                          clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert not logp.grad[observation].any() and logp.grad.abs().sum() > 0

    sink = Recorder()
    result = train_rl(cfg, sink, show_progress=False)
    assert len(sink.series("rollout/tool_call_rate")) == 2 and sink.series("rollout/observation_tokens")[0] > 0
    row = result.rollout_table[0]
    assert {"text", "action_mask", "tool_calls", "segments"} <= set(row)
    assert set(row["action_mask"]) <= {"0", "1"} and {seg["source"] for seg in json.loads(row["segments"])} \
        <= {"policy", "observation"}
    assert {"eval/accuracy_tool", "eval/tool_call_rate", "eval/accuracy_tool_stderr"} <= set(result.metrics)


def test_an_environment_server_that_is_down_stops_the_run_with_a_clear_error_and_nothing_written(
        tool_model, micro_data, tmp_path):
    """After its retries the HTTP environment raises a RewardError the CLI reports (exit 1); no model, no
    checkpoint, no metrics file is written."""
    import socket

    from rlhf_core.rollout.environments import EnvironmentFailure
    from rlhf_core.trainers.rl import train_rl

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = build_config(RLConfig, "rl", {"model_path": str(tool_model), "prompts_file": str(micro_data["prompts"]),
                                        "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / "rl"),
                                        "checkpoint_dir": str(tmp_path / "ckpt"),
                                        "reward.function": str(REPO / "rlhf_core/rollout/tool_task.py:reward"),
                                        "environment.spec": f"http://127.0.0.1:{port}/step",
                                        "environment.stop_tokens": ["</calc>"], "reward.retries": 1,
                                        "reward.backoff_cap_s": 0.01, "environment.max_turns": 2,
                                        "environment.max_trajectory_tokens": 20, "rollout.max_new_tokens": 6,
                                        "max_steps": 2, "rollout.prompts_per_step": 4, "rollout.group_size": 2,
                                        "batch_size": 64, "algorithm.mini_batch_size": 8, "eval_at_start": False,
                                        "num_threads": 1, "rollout.engine": "hf"})
    with pytest.raises(EnvironmentFailure, match=rf"environment server http://127.0.0.1:{port}/step: failed after 2 "
                                                 "attempts; last error: connection failed"):
        train_rl(cfg, Recorder(), show_progress=False)
    assert not (tmp_path / "rl").exists()
    written = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    assert written == ["ckpt/.lock"], written  # the run lock only: no checkpoint, no model


@pytest.mark.slow
def test_multi_turn_rollouts_run_on_ray_replicas_with_the_environment_in_the_controller(
        ray_local, tool_model, scripted_env, micro_data, tmp_path):
    """Disaggregated placement, one policy rank and two rollout replicas: each turn's trajectories are split
    across the replicas (``RemoteRollout.generate_ids``), the environment runs in this process between turns,
    and the learner trains on the trajectories with observations outside the loss. (Slow tier: a minute of
    Ray start-up and actor loading on 2 CPU cores.)"""
    from safetensors.torch import load_file

    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

    cfg = _two_iterations(tool_model, scripted_env, micro_data, tmp_path, **{"distribution.placement": "disaggregated"},
                          num_workers=1, **{"distribution.rollout_workers": 2}, precision="fp32")
    sink = Recorder()
    result = train_rl_on_ray(cfg, sink, show_progress=False)
    assert len(sink.series("rollout/tool_call_rate")) == 2 and sink.series("rollout/tool_call_rate")[0] > 0
    assert sink.series("rollout/observation_tokens")[0] > 0
    rows = result.rollout_table
    assert len(rows) > 0 and all(set(r["action_mask"]) <= {"0", "1"} for r in rows)
    # a trajectory that called the tool holds the observation's text, as observation tokens (mask 0)
    called = [r for r in rows if r["tool_calls"] > 0]
    assert called and all(TOOL_OBSERVATION in r["text"] and "0" in r["action_mask"] for r in called)
    assert any(seg["source"] == "observation" and seg["text"] == TOOL_OBSERVATION
               for r in called for seg in json.loads(r["segments"]))
    start = load_file(str(tool_model / "model.safetensors"))
    after = load_file(str(result.output_dir / "model.safetensors"))
    assert any(not torch.equal(start[k], after[k]) for k in start)
    assert {"eval/accuracy_tool", "eval/tool_call_rate"} <= set(result.metrics)
