"""Tiny-model online RL: every estimator updates the policy (and PPO its critic), the KL controller
adapts, DAPO dynamic sampling drops uninformative groups, bad rewards fail loudly (resume: test_resume.py).

The micro model is untrained, so the embedded rule reward is almost always 0 on it: most tests use
a dense reward file (longer answer, higher reward) whose samples differ within every group.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.common import redact
from rlhf_core.config import ConfigError, RLConfig, build_config
from rlhf_core.rewards.sources import RewardError
from rlhf_core.trainers.rl import train_rl
from conftest import Recorder

REPO = Path(__file__).resolve().parents[2]
ESTIMATORS = ["gae", "reinforce++", "reinforce++-baseline", "rloo", "grpo", "dr-grpo"]




def _cfg(micro_model, micro_data, tmp_path, reward_function, **overrides) -> RLConfig:
    values = {"model_path": str(micro_model), "prompts_file": str(micro_data["prompts"]),
              "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / "rl"),
              "checkpoint_dir": str(tmp_path / "ckpt"), "reward.function": reward_function, "max_steps": 2,
              "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6, "batch_size": 64,
              "algorithm.mini_batch_size": 8,
              "lr": 3e-3, "algorithm.critic_lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0, "eval_items": 8,
              "eval_at_start": False,
              "log_rollouts_every": 1, "num_threads": 1}
    values.update(overrides)
    return build_config(RLConfig, "rl", {**values})


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before if k in after)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_updates_the_policy(estimator, micro_model, micro_data, tmp_path, length_reward):
    """Two iterations change the policy's weights and log finite rollout/train/perf metrics under
    stable names. weight_decay is 0, so any change comes from the gradient of the RL loss."""
    token_level = estimator in ("gae", "reinforce++", "reinforce++-baseline")
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, **{"algorithm.estimator": estimator,
                                                                    "kl.in_reward": token_level},
               **{"kl.estimator": "k1" if token_level else "k3"}, save_every=0)
    result = train_rl(cfg, sink, show_progress=False)

    assert _changed(load_file(str(micro_model / "model.safetensors")),
                    load_file(str(result.output_dir / "model.safetensors")))
    names = ["rollout/reward_mean", "rollout/reward_std", "rollout/response_length", "rollout/kept_groups_frac",
             "train/policy_loss", "train/kl", "train/entropy", "train/clip_frac", "train/approx_kl",
             "train/adv_mean", "train/adv_std", "train/kl_coef", "perf/rollout_s", "perf/reward_s",
             "perf/logprob_s", "perf/update_s", "perf/step_s"]
    for name in names:
        values = sink.series(name)
        assert sink.steps(name) == [1, 2], name
        assert all(math.isfinite(v) for v in values), (name, values)
    assert all(math.isfinite(v) for _, row in sink.rows for v in row.values()), sink.rows
    assert sink.series("train/kl")[0] == pytest.approx(0.0, abs=1e-6)  # step 1 samples from the reference itself
    assert sink.series("train/kl")[1] > 0  # ... step 2 from the updated policy
    assert sink.series("train/adv_std")[0] > 0
    assert "eval/accuracy" in result.metrics and sink.steps("eval/accuracy") == [2]
    # rollout tables: whole groups of the step, with the reward the source gave
    assert [name for name, _ in sink.tables] == ["rollouts.json", "rollouts.json"]
    assert result.rollout_table[0].keys() == {"step", "prompt", "completion", "reward"}
    assert all(r["reward"] == pytest.approx(len(r["completion"]) / 10) for r in result.rollout_table)

    if estimator == "gae":  # PPO also trains its critic, which starts from the policy's backbone
        values = sink.series("train/value_loss")
        assert len(values) == 2 and all(math.isfinite(v) for v in values)
        assert all(math.isfinite(v) for v in sink.series("train/explained_variance"))
        # (that the critic's weights move is checked on its checkpoint in test_resume.py)
    else:
        assert not sink.series("train/value_loss")


def test_gspo_and_cispo_update_the_policy_and_clip_their_own_way(micro_model, micro_data, tmp_path, length_reward):
    """Each policy objective from the same start, two PPO epochs over two mini-batches per iteration (so pi
    leaves pi_old within an iteration and the ratios leave 1). gspo and cispo change the weights, and
    differently from ppo_clip; each one's clip binds on the first iteration: gspo's [1 - 3e-4, 1 + 4e-4]
    band on the sequence ratio clips far more tokens than ppo_clip's token band (the GSPO paper observes
    two orders of magnitude on its runs), cispo truncates some weights above 1.28."""
    start = load_file(str(micro_model / "model.safetensors"))
    runs = {}
    for objective in ("ppo_clip", "gspo", "cispo"):
        sink = Recorder()
        cfg = _cfg(micro_model, micro_data, tmp_path / objective, length_reward,
                   **{"algorithm.policy_objective": objective},
                   **{"algorithm.ppo_epochs": 2}, save_every=0)
        result = train_rl(cfg, sink, show_progress=False)
        runs[objective] = sink, load_file(str(result.output_dir / "model.safetensors"))
    for objective in ("gspo", "cispo"):
        sink, weights = runs[objective]
        assert _changed(start, weights) and _changed(runs["ppo_clip"][1], weights), objective
        for name in ("train/policy_loss", "train/clip_frac", "train/approx_kl", "train/kl"):
            assert len(sink.series(name)) == 2 and all(math.isfinite(v) for v in sink.series(name)), name
        assert sink.series("train/approx_kl")[0] > 0 and sink.series("train/kl")[1] > 0
        assert sink.series("train/clip_frac")[0] > 0, objective
    assert runs["gspo"][0].series("train/clip_frac")[0] > 2 * runs["ppo_clip"][0].series("train/clip_frac")[0]


def test_rule_reward_and_sampling_logprobs_match_the_recomputed_ones(micro_model, micro_data, tmp_path):
    """The embedded rule reward file (0 or 1 per sample) drives a GRPO step; the engine's sampling
    log-probs equal the trainer's recomputed old log-probs (same weights, same logits / T)."""
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, str(REPO / "rlhf_core/embedded/reward.py") + ":reward",
               max_steps=1, **{"algorithm.entropy_coef": 0.01, "rollout.temperature": 0.7})
    train_rl(cfg, sink, show_progress=False)
    assert 0.0 <= sink.series("rollout/reward_mean")[0] <= 1.0
    assert sink.series("rollout/logprob_mismatch")[0] < 1e-4


def test_adaptive_kl_controller(micro_model, micro_data, tmp_path, length_reward):
    """Ziegler et al.'s controller with horizon = samples per step moves beta by exactly
    1 + clip(KL / target - 1, -0.2, 0.2): step 1 samples from the reference (KL = 0, so x0.8);
    step 2's policy has moved far past a 1e-6 nat target (so x1.2)."""
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, max_steps=3, **{"kl.adaptive": True, "kl.coef": 0.1},
               **{"kl.target": 1e-6, "kl.horizon": 16})
    result = train_rl(cfg, sink, show_progress=False)
    beta = sink.series("train/kl_coef")
    assert beta[0] == pytest.approx(0.1)
    assert beta[1] == pytest.approx(0.1 * 0.8)
    assert beta[2] == pytest.approx(0.1 * 0.8 * 1.2)
    assert sink.series("train/kl")[1] > 1e-6 and "train/kl_loss" in result.metrics


def test_dynamic_sampling_drops_groups_that_all_scored_the_same(micro_model, micro_data, tmp_path):
    """Sorting prompts score 1 whatever the answer (an all-equal group, no signal); arithmetic ones
    score by length. DAPO keeps only arithmetic groups and tops up from more prompts."""
    path = tmp_path / "half_constant.py"
    path.write_text("def reward(prompts, completions, labels):\n"
                    "    return [1.0 if p.startswith('sort') else len(c) / 10 for p, c in zip(prompts, completions)]\n")
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, f"{path}:reward", **{"dapo.dynamic_sampling": True},
               **{"dapo.dynamic_sampling_max_rounds": 3})
    result = train_rl(cfg, sink, show_progress=False)
    kept = sink.series("rollout/kept_groups_frac")
    assert all(0 < k < 1 for k in kept), kept
    assert all(s > cfg.rollout.prompts_per_step for s in sink.series("rollout/sampled_groups"))  # topped up
    assert result.rollout_table and not any(r["prompt"].startswith("sort") for r in result.rollout_table)


def test_reward_that_returns_nan_names_file_and_function(micro_model, micro_data, tmp_path):
    path = tmp_path / "nan_reward.py"
    path.write_text("def score_answers(prompts, completions, labels):\n"
                    "    return [float('nan')] * len(completions)\n")
    cfg = _cfg(micro_model, micro_data, tmp_path, f"{path}:score_answers", max_steps=1)
    with pytest.raises(RewardError, match=r"reward function score_answers in .*nan_reward.py: sample 0: "
                                          r"reward nan is not finite"):
        train_rl(cfg, show_progress=False)


@pytest.fixture(scope="module")
def micro_rm(make_micro_rm) -> Path:
    """An untrained micro reward model directory (random head, stored normalisation)."""
    return make_micro_rm(mean=0.0, std=0.1)


def test_ppo_with_a_reward_model(micro_model, micro_data, micro_rm, tmp_path):
    """PPO scored by a reward model: the critic starts from the reward model (OpenRLHF's choice),
    and the RM's mean score of greedy eval answers is logged at the start and the end."""
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, "unused.py:reward", **{"algorithm.estimator": "gae",
                                                                         "reward.kind": "model"},
               **{"reward.model_path": str(micro_rm)}, critic_model_path=str(micro_rm), **{"kl.in_reward": True},
               **{"kl.estimator": "k1"}, eval_at_start=True)
    result = train_rl(cfg, sink, show_progress=False)
    assert sink.steps("eval/reward_model_score") == [0, 2]
    assert all(math.isfinite(v) for v in sink.series("eval/reward_model_score"))
    assert "eval/reward_model_score_start" in result.metrics and "eval/accuracy_start" in result.metrics
    assert all(math.isfinite(v) for v in sink.series("train/value_loss"))


def test_rl_stage_gate_takes_label_less_prompts_only_with_a_reward_model(isolated_project, micro_model, micro_data,
                                                                        micro_rm):
    """A TRL prompt-only file (conversational, no labels) passes the stage's gate and trains with a reward
    model, which never reads labels; with the embedded reward function, which compares against them, the
    gate refuses it (naming line and field) before anything is trained."""
    import json

    from rlhf_core.stages import wrappers as stages
    from rlhf_core.config import TrackingConfig
    from rlhf_core.data.validate import ValidationFailed

    rows = [json.loads(line) for line in Path(micro_data["prompts"]).read_text().splitlines()][:16]
    bare = isolated_project / "prompt_only.jsonl"
    bare.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}]}) + "\n" for r in rows))
    tracking = TrackingConfig(experiment="prompt-only", log_model=False)
    cfg = _cfg(micro_model, micro_data, isolated_project, "unused.py:reward", prompts_file=str(bare),
               **{"reward.kind": "model", "reward.model_path": str(micro_rm)})
    result = stages.rl(cfg, tracking, show_progress=False)
    assert (Path(result.outputs["model"]) / "model.safetensors").exists()
    assert math.isfinite(result.metrics["eval/reward_model_score"])

    rule = _cfg(micro_model, micro_data, isolated_project / "rule", RLConfig().reward.function, prompts_file=str(bare))
    with pytest.raises(ValidationFailed, match=r"prompt_only.jsonl:1: field 'label': missing"):
        stages.rl(rule, tracking, show_progress=False)
    assert not (isolated_project / "rule").exists()


def test_config_rejects_inconsistent_rl_settings():
    with pytest.raises(ConfigError, match=r"rl.kl.in_reward: grpo scores whole sequences"):
        build_config(RLConfig, "rl", {"algorithm.estimator": "grpo", "kl.in_reward": True})
    with pytest.raises(ConfigError, match=r"rl.rollout.group_size: must be >= 2 for rloo"):
        build_config(RLConfig, "rl", {"algorithm.estimator": "rloo", "rollout.group_size": 1})
    with pytest.raises(ConfigError, match=r"rl.algorithm.estimator: must be one of"):
        build_config(RLConfig, "rl", {"algorithm.estimator": "ppo"})
    with pytest.raises(ConfigError,
                       match=r"rl.algorithm.mini_batch_size: must be <= rollout.prompts_per_step x rollout.group_size"):
        build_config(RLConfig, "rl", {"rollout.prompts_per_step": 2, "rollout.group_size": 4,
                                      "algorithm.mini_batch_size": 16})
    with pytest.raises(ConfigError, match=r"rl.dapo.overlong_cache_len"):
        build_config(RLConfig, "rl", {"dapo.overlong_max_len": 20, "dapo.overlong_cache_len": 4,
                                      "rollout.max_new_tokens": 12})
    build_config(RLConfig, "rl", {"algorithm.estimator": "gae", "rollout.group_size": 1, "kl.in_reward": True,
                                  "algorithm.mini_batch_size": 16})  # PPO needs no groups


def test_config_rejects_a_negative_k3_cap():
    with pytest.raises(ConfigError, match=r"rl.kl.k3_cap: must be >= 0 \(an upper bound on each token's k3 value; "
                                          r"0 disables the cap\), got -1.0"):
        build_config(RLConfig, "rl", {"kl.k3_cap": -1.0})
    assert build_config(RLConfig, "rl", {"kl.k3_cap": 0.0}).kl.k3_cap == 0.0  # no cap


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_critic_gradient_that_overflows_stops_before_the_critic_step(micro_model, micro_data, tmp_path,
                                                                      max_grad_norm):
    """PPO (gae) with a reward file that returns 6e18 for every sample (one response token, two rows
    per mini-batch). The returns are ~6e18, so the value loss, a token mean of 0.5 * (V - R)^2, sums
    to ~2 x 0.5 x 3.6e37 = 3.6e37 < 3.4e38 (fp32's max): finite, and the loss guard passes. The
    gradient on the score head is -(R / tokens) x sum_t h_t, entries ~R; the fp32 sum of their
    squares in the norm overflows (measured on this model: inf from R ~ 2e18, the loss from ~1.8e19;
    6e18 sits in the middle). The guard raises NonFiniteError naming the critic before its optimizer
    step, with clipping off (max_grad_norm 0: the norm is still taken) or on; the critic's weights
    are those it started with and its optimizer never stepped. (Before the guard: with clipping off
    Adam stepped on the 1e18-sized gradient; with it on, the inf norm scaled the gradient to 0 and
    the step went ahead silently.)"""
    from rlhf_core.trainers.step import NonFiniteError
    from rlhf_core.trainers.rl_roles import PolicyLearner

    path = tmp_path / "huge_reward.py"
    path.write_text("def reward(prompts, completions, labels):\n"
                    "    return [6e18] * len(completions)\n")
    cfg = _cfg(micro_model, micro_data, tmp_path, f"{path}:reward", **{"algorithm.estimator": "gae",
                                                                       "kl.in_reward": True},
               **{"kl.estimator": "k1"}, max_steps=1, save_every=0, max_grad_norm=max_grad_norm,
               **{"rollout.max_new_tokens": 1},
               **{"algorithm.mini_batch_size": 2})
    torch.manual_seed(0)  # the critic's fresh score head
    learner = PolicyLearner(cfg, torch.device("cpu"))
    critic_before = {k: v.clone() for k, v in learner.critic.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"rl: iteration 1: critic gradient norm is inf; stopped before "
                                             r"the optimizer step"):
        train_rl(cfg, show_progress=False, learner=learner)
    critic_after = learner.critic.state_dict()
    assert critic_after.keys() == critic_before.keys()
    assert all(torch.equal(critic_after[k], v) for k, v in critic_before.items())
    # Adam never stepped: the step was launched with the skip flag (rlhf_core.distributed.parallel.optimizer_step), which a
    # fused AdamW takes after making its state (step count 0, zero moments); others are not called at all
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
               for s in learner.critic_opt.state.values())


def test_alignflow_rl_command_tracks_lineage(isolated_project, micro_model, micro_data, length_reward):
    """``alignflow rl`` runs the stage in an MLflow run: prompts and eval as inputs, the rollout table
    as an artifact, deterministic eval metrics in the metrics file."""
    import json

    import yaml
    from mlflow.tracking import MlflowClient

    from flows.cli import main

    params = isolated_project / "params.yaml"
    params.write_text(yaml.safe_dump({"rl": dict(
        model_path=str(micro_model), prompts_file=str(micro_data["prompts"]), eval_file=str(micro_data["eval"]),
        reward_function=length_reward, max_steps=2, prompts_per_step=4, group_size=4, max_new_tokens=6,
        mini_batch_size=8, eval_items=8, log_rollouts_every=1, save_every=0)}))
    assert main(["rl", "--params", str(params), "--metrics-file", "metrics/rl.json"]) == 0
    metrics = json.loads((isolated_project / "metrics/rl.json").read_text())
    assert {"eval/accuracy", "eval/accuracy_start"} <= metrics.keys()
    assert all(k.startswith(("eval/", "train/loss")) for k in metrics)
    assert (isolated_project / "models/rl/model.safetensors").exists()
    client = MlflowClient()
    (run,) = client.search_runs(client.get_experiment_by_name("alignflow").experiment_id)
    assert run.data.tags["input.prompts"] == str(micro_data["prompts"]) and run.data.tags["alignflow.stage"] == "rl"
    assert {"rollouts.json", "eval_samples.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def _learner_and_experience(micro_model, micro_data, tmp_path, **overrides):
    """A PolicyLearner and one batch of experience (16 rows) as the controller builds it."""
    from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
    from rlhf_core.trainers.rl_roles import PolicyLearner, ReferenceScorer

    cfg = _cfg(micro_model, micro_data, tmp_path, "unused.py:reward", **{"algorithm.mini_batch_size": 16}, **overrides)
    torch.manual_seed(0)
    learner = PolicyLearner(cfg, torch.device("cpu"))
    from rlhf_core.models.loading import load_tokenizer

    tok = load_tokenizer(micro_model)
    batch = HFGenerateEngine(learner.policy, tok).generate(["12+30=", "7*8=", "sort 321=", "1+1="],
                                                           SamplingParams(n=4, max_new_tokens=6, seed=1))
    exp = batch.learner_inputs()
    p = batch.prompt_ids.shape[1]
    mask = batch.response_mask.float()
    exp.update(mask=mask, ref_logp=ReferenceScorer(cfg, torch.device("cpu")).logprobs(exp, p) * mask,
               advantages=torch.randn(len(batch), 1).expand_as(mask) * mask)
    return learner, exp, p, batch.sampling_logprobs * mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_and_the_fused_old_logprob_give_the_one_pass_update(micro_model, micro_data, tmp_path,
                                                                          aggregation):
    """One update per batch three ways: pi_old from a separate forward, one pass; pi_old fused into the
    update (no extra forward), one pass; fused, over 4 micro-batches. Same weights and diagnostics."""
    results = []
    for micro, fused in ((0, False), (0, True), (4, True)):
        learner, exp, p, sampling = _learner_and_experience(micro_model, micro_data, tmp_path,
                                                            micro_batch_size=micro, loss_aggregation=aggregation)
        assert learner.micro_batches == (4 if micro else 1)
        if fused:
            exp["sampling_logp"] = sampling
        else:
            exp["old_logp"] = learner.score(exp, p)["old_logp"] * exp["mask"]
        seen = learner.update(exp, p, [torch.arange(16)], kl_coef=0.1, step=1)
        results.append((seen, {k: v.clone() for k, v in learner.policy.state_dict().items()}))
    (seen0, w0), (seen1, w1), (seen2, w2) = results
    start = load_file(str(micro_model / "model.safetensors"))
    assert any(not torch.equal(w0[k], start[k]) for k in start if k in w0)  # the update moved the weights
    # Adam's first step moves a weight by about lr * g / |g|: where a gradient element is near zero, its
    # float rounding (which differs between one pass and four micro-batches) moves the step by up to a
    # few thousandths of lr (3.9e-6 seen on one CPU), so the tolerance is a hundredth of lr.
    for w in (w1, w2):
        for k in w0:
            torch.testing.assert_close(w[k], w0[k], atol=3e-3 * 1e-2, rtol=1e-5)
    for seen in (seen1, seen2):
        for key in ("policy_loss", "kl_loss", "clip_frac", "approx_kl", "entropy"):
            assert seen[key] == pytest.approx(seen0[key], abs=1e-5)
        assert seen["logprob_mismatch"][0] < 1e-4  # the HF engine sampled from these very weights
        assert math.isfinite(seen["seq_kl"][0]) and seen["seq_kl"][0] >= 0


def test_one_update_per_batch_skips_the_old_logprob_forward(micro_model, micro_data, tmp_path, length_reward,
                                                            monkeypatch):
    """mini_batch_size = every row and one epoch: train_rl never calls PolicyLearner.score, logs the same metrics."""
    from rlhf_core.trainers.rl_roles import PolicyLearner

    calls = []
    original = PolicyLearner.score
    monkeypatch.setattr(PolicyLearner, "score", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, **{"algorithm.mini_batch_size": 16},
               micro_batch_size=8,
               save_every=0)
    train_rl(cfg, sink, show_progress=False)
    assert calls == []
    for key in ("train/kl", "rollout/logprob_mismatch", "train/policy_loss", "train/entropy"):
        assert len(sink.series(key)) == 2 and all(math.isfinite(v) for v in sink.series(key))
    assert max(sink.series("rollout/logprob_mismatch")) < 1e-4
    cfg = _cfg(micro_model, micro_data, tmp_path / "two", length_reward, **{"algorithm.mini_batch_size": 8},
               save_every=0)
    train_rl(cfg, Recorder(), show_progress=False)
    assert len(calls) == 2  # two mini-batches per batch: pi_old must be computed before the first step


def test_chunked_trimmed_logprobs_equal_one_full_pass(micro_model, micro_data, tmp_path):
    """No-grad passes group rows by length and drop all-padding columns per chunk: same log-probs as one
    untrimmed pass over the whole batch, in the original row order."""
    from rlhf_core.trainers.rl_forward import token_logprobs, trim_padding
    from rlhf_core.trainers.rl_roles import ReferenceScorer

    learner, exp, p, _ = _learner_and_experience(micro_model, micro_data, tmp_path, batch_size=3)
    mask = exp.pop("mask")
    for k in ("ref_logp", "advantages"):
        exp.pop(k)
    lengths = exp["attention_mask"].sum(-1)
    assert lengths.min() < lengths.max()  # rows of different lengths: chunks really get trimmed
    trimmed, width = trim_padding({k: v[lengths.argsort()[:3]] for k, v in exp.items()}, p)
    assert trimmed["input_ids"].shape[1] < exp["input_ids"].shape[1] and width <= p
    scorer = ReferenceScorer(learner.cfg, torch.device("cpu"))
    chunked = scorer.logprobs(exp, p)
    with torch.no_grad():
        full, _ = token_logprobs(scorer.model, exp, p, learner.cfg.rollout.temperature)
    torch.testing.assert_close(chunked * mask, full * mask, atol=1e-5, rtol=0)


@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_prompts_shared_across_a_group_give_the_same_logprobs_and_gradients(micro_model, micro_data, tmp_path,
                                                                            checkpointing):
    """Each distinct prompt run once, its responses after it in one prefix-tree row (rows shuffled, groups of
    4, responses of several lengths): the same log-probs and parameter gradients as one full pass, with
    gradient checkpointing too (no KV cache involved)."""
    from rlhf_core.distributed.parallel import train_mode
    from rlhf_core.trainers.rl_forward import prefix_tree, token_logprobs

    learner, exp, p, _ = _learner_and_experience(micro_model, micro_data, tmp_path,
                                                 gradient_checkpointing=checkpointing)
    assert learner.share_prompts and learner.checkpointing == (checkpointing == "on")  # one process
    for row in range(len(exp["mask"])):  # responses of 4-6 tokens (the untrained model never stops early)
        cut = exp["mask"].shape[1] - row % 3
        for key, offset in (("attention_mask", p), ("input_ids", p), ("mask", 0), ("response_ids", 0)):
            exp[key][row, offset + cut:] = 0
    mask = exp["mask"]
    assert mask.sum(-1).min() < mask.sum(-1).max()  # tree rows of several lengths, padding in the tree
    shuffled = torch.randperm(len(mask), generator=torch.Generator().manual_seed(0))
    exp = {k: v[shuffled] for k, v in exp.items()}
    mask = mask[shuffled]
    assert prefix_tree(exp, p).input_ids.shape[0] == 4
    model = learner.policy
    results = []
    for share in (False, True):
        model.zero_grad()
        with train_mode(model) if learner.checkpointing else nullcontext():
            logp, _ = token_logprobs(model, exp, p, 0.7, share_prompts=share)
            (logp * mask).sum().backward()
        results.append((logp.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}))
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp1 * mask, lp0 * mask, atol=1e-5, rtol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in g0.values())


# --------------------------------------------------------------------------------------
# On-policy distillation (estimator distill): a frozen teacher scores the policy's samples
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_teacher(micro_model, micro_data, tmp_path_factory) -> Path:
    """The micro model after a few SFT steps: peaked where the untrained student is near uniform."""
    from rlhf_core.config import SFTConfig
    from rlhf_core.trainers.sft import train_sft

    root = tmp_path_factory.mktemp("sft_teacher")
    cfg = SFTConfig(model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
                    output_dir=str(root / "sft"), checkpoint_dir=str(root / "ckpt"), max_steps=30, batch_size=16,
                    lr=3e-3, warmup_steps=1, eval_every=0, eval_items=8, save_every=0, num_threads=1)
    return train_sft(cfg, show_progress=False).output_dir


def test_on_policy_distillation_lowers_the_reverse_kl_to_the_teacher(micro_model, sft_teacher, micro_data,
                                                                     tmp_path, length_reward):
    """Student: the untrained micro model; teacher: the same model after 30 SFT steps (same tokenizer).
    Each token's advantage is -(log pi - log pi_teacher) of the sampled token (no KL to the reference,
    no sequence reward), so the policy moves and rollout/teacher_reverse_kl (mean per token) falls
    over 30 iterations (about a second)."""
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, **{"algorithm.estimator": "distill"},
               **{"distill.teacher_model_path": str(sft_teacher), "kl.coef": 0.0}, max_steps=30, save_every=0,
               log_rollouts_every=0)
    result = train_rl(cfg, sink, show_progress=False)

    assert _changed(load_file(str(micro_model / "model.safetensors")),
                    load_file(str(result.output_dir / "model.safetensors")))
    kl = sink.series("rollout/teacher_reverse_kl")
    assert sink.steps("rollout/teacher_reverse_kl") == list(range(1, 31))
    assert all(math.isfinite(v) for v in kl), kl
    # 16 rows of <= 6 tokens per step make one step's estimate noisy: compare the first and last 5 steps
    # (measured: 0.397 -> 0.194 nats per token)
    assert sum(kl[-5:]) / 5 < 0.7 * sum(kl[:5]) / 5, kl
    assert sink.series("train/adv_std")[0] > 0
    assert all(math.isfinite(v) for v in sink.series("rollout/reward_mean"))  # the reward is still logged


def test_on_policy_distillation_mixed_with_the_sequence_reward_and_a_kl_in_reward(micro_model, sft_teacher,
                                                                                  micro_data, tmp_path, length_reward):
    """distill_reward_coef 1 and -beta * k1 to the reference folded into the token rewards: both add to the
    teacher's per-token reward; two iterations run with finite metrics and move the policy."""
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, **{"algorithm.estimator": "distill"},
               **{"distill.teacher_model_path": str(sft_teacher), "distill.reward_coef": 1.0, "kl.in_reward": True,
                  "kl.estimator": "k1"},
               save_every=0, log_rollouts_every=0)
    result = train_rl(cfg, sink, show_progress=False)
    assert _changed(load_file(str(micro_model / "model.safetensors")),
                    load_file(str(result.output_dir / "model.safetensors")))
    for name in ("rollout/teacher_reverse_kl", "rollout/reward_mean", "train/adv_mean", "train/kl"):
        assert len(sink.series(name)) == 2 and all(math.isfinite(v) for v in sink.series(name)), name
    # the distillation term alone averages minus the reverse KL (-0.37 per token at step 1); the length
    # reward (len / 10, on every token) lifts the mean advantage above zero (measured: 0.20)
    assert sink.series("train/adv_mean")[0] > 0, sink.series("train/adv_mean")


def test_on_policy_distillation_refuses_a_teacher_with_another_tokenizer(micro_model, micro_data, tmp_path,
                                                                         length_reward):
    """A teacher whose tokenizer has one extra token: a ConfigError naming teacher_model_path, before any
    model is loaded or iteration runs (nothing logged, no output directory)."""
    import shutil

    from rlhf_core.models.loading import load_tokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(micro_model, teacher)
    tok = load_tokenizer(teacher)
    tok.add_tokens(["<extra-token>"])
    tok.save_pretrained(teacher)
    sink = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, **{"algorithm.estimator": "distill",
                                                                    "distill.teacher_model_path": str(teacher)})
    with pytest.raises(ConfigError, match=r"rl.distill.teacher_model_path: the teacher.s tokenizer .* differs from the "
                                          r"policy's .* share one tokenizer"):
        train_rl(cfg, sink, show_progress=False)
    assert not sink.rows and not Path(cfg.output_dir).exists()


@pytest.fixture
def secret_registry():
    """The process-wide secret registry, restored after the test (it only grows otherwise)."""
    saved = set(redact._registered)
    yield saved
    redact._registered.clear()
    redact._registered.update(saved)


def test_rollout_table_redacts_a_secret_in_a_completion(micro_model, micro_data, tmp_path, tmp_path_factory,
                                                        secret_registry):
    """A completion that holds a registered secret is logged as ``***``: the reward function below
    registers the longest completion of the first batch as a secret, as a server echoing a token would
    make one appear in generated text."""
    path = tmp_path_factory.mktemp("rewards") / "registering_reward.py"
    path.write_text("from rlhf_core.common.redact import register_secret\nSEEN = []\n"
                    "def reward(prompts, completions, labels):\n"
                    "    if not SEEN:\n"
                    "        SEEN.append(max(completions, key=len))\n"
                    "        register_secret(SEEN[0])\n"
                    "    return [len(c) / 10 for c in completions]\n")
    sink = Recorder()
    result = train_rl(_cfg(micro_model, micro_data, tmp_path, f"{path}:reward", max_steps=1, save_every=0,
                           **{"rollout.max_new_tokens": 12}), sink, show_progress=False)
    secrets = redact._registered - secret_registry
    assert secrets, "the reward function registered no completion (shorter than MIN_SECRET_LEN?)"
    logged = json.dumps([rows for _, rows in sink.tables]) + json.dumps(result.rollout_table)
    assert not any(secret in logged for secret in secrets)
    assert any(r["completion"] == redact.REDACTED or redact.REDACTED in r["completion"] for r in result.rollout_table)
