"""Online RL from sampled rollouts: PPO (GAE + critic), REINFORCE++, RLOO, GRPO and Dr.GRPO, with DAPO's options.

Reads top to bottom like cleanrl's ``ppo.py``. Each iteration (one ``step``):

1. rollout: ``prompts_per_step`` prompts x ``group_size`` samples from the policy (a ``RolloutEngine``);
2. reward: one score per sample from a ``RewardSource`` (rule file, reward model or HTTP), label passed through;
3. DAPO: drop groups whose samples all scored the same and top up from more prompts; overlong penalty;
4. log-probs: old (the policy, no grad), reference, and values (the critic, ``gae`` only);
5. advantages: :func:`rlhf_core.rl_math.compute_advantages`, the KL folded into token rewards when
   ``kl_in_reward`` (PPO, REINFORCE++), else added to the loss (GRPO);
6. update: ``ppo_epochs`` passes of mini-batches: clipped policy loss (+ KL, - entropy bonus), and the
   critic's clipped value loss with its own optimizer;
7. KL controller, logging, periodic eval and checkpoints.

Every formula lives in :mod:`rlhf_core.rl_math`; the engine and the reward sit behind their Protocols
(:mod:`rlhf_core.rollout`, :mod:`rlhf_core.rewards`), so a vLLM engine or a remote reward changes nothing
here. Only torch and transformers are imported: the same file runs on a GPU box without MLflow or Prefect.

Run: ``alignflow rl`` (config: ``params.yaml`` section ``rl``), or ``train_rl(RLConfig(...))``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from rlhf_core.config import ConfigError, RLConfig, config_to_dict, redact_secrets
from rlhf_core.data.io import DataError, read_records, require_str
from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.evaluate import evaluate_exact_match
from rlhf_core.models import load_tokenizer, merged_model, pick_device, resolve_precision
from rlhf_core.rewards import RewardKind, RewardSource, build_reward_source
from rlhf_core.rl_math import (AdaptiveKLController, AdvantageEstimator, FixedKLController, KLController,
                               compute_advantages, dynamic_sampling_keep, explained_variance, kl_penalty, masked_mean,
                               masked_whiten, overlong_penalty, truncated_is_weights)
from rlhf_core.rollout import HFGenerateEngine, RolloutBatch, RolloutEngine, SamplingParams
from rlhf_core.checkpoint import (Checkpoint, Checkpointer, TrainingInterrupted, load_weights, run_fingerprint,
                                  set_rng_state, sigterm_checkpoints)
from rlhf_core.trainers.loop import (EpochSampler, MetricSink, NullSink, Timer, inject_fault, save_hf_dir,
                                     seed_everything)
from rlhf_core.trainers.rl_roles import KL_CLAMP as _KL_CLAMP
from rlhf_core.trainers.rl_roles import PolicyLearner, ReferenceScorer, token_logprobs, token_values  # noqa: F401
# Rollout tables show whole groups, so a reader sees what the group baseline compared.
_TABLE_GROUPS = 4
_EVAL_SAMPLES = 8

log = logging.getLogger(__name__)


@dataclass
class RLResult:
    """The trained policy's directory, final metrics, greedy eval answers and the logged rollout rows."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)
    rollout_table: list[dict[str, Any]] = field(default_factory=list)


def read_prompts(cfg: RLConfig) -> tuple[list[str], list[str | None]]:
    """Prompts and labels (``None`` where a record has none) of ``cfg.prompts_file``."""
    records = read_records(cfg.prompts_file)
    if not records:
        raise DataError(cfg.prompts_file, 0, "no prompts")
    prompts = [require_str(r, cfg.prompt_field, cfg.prompts_file) for r in records]
    labels = [None if r.get(cfg.label_field) is None else str(r.get(cfg.label_field)) for r in records]
    return prompts, labels


# --------------------------------------------------------------------------------------
# Rollout batches: select groups, join top-up rounds
# --------------------------------------------------------------------------------------


def _pad(t: torch.Tensor, width: int, value: float, *, left: bool) -> torch.Tensor:
    fill = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def _concat(batches: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch of several rollout rounds (prompts re-left-padded, responses re-right-padded)."""
    if len(batches) == 1:
        return batches[0]
    p = max(b.prompt_ids.shape[1] for b in batches)
    r = max(b.response_ids.shape[1] for b in batches)
    return RolloutBatch(
        prompts=[x for b in batches for x in b.prompts], completions=[x for b in batches for x in b.completions],
        prompt_ids=torch.cat([_pad(b.prompt_ids, p, pad_id, left=True) for b in batches]),
        prompt_mask=torch.cat([_pad(b.prompt_mask, p, 0, left=True) for b in batches]),
        response_ids=torch.cat([_pad(b.response_ids, r, pad_id, left=False) for b in batches]),
        response_mask=torch.cat([_pad(b.response_mask, r, 0, left=False) for b in batches]),
        sampling_logprobs=torch.cat([_pad(b.sampling_logprobs, r, 0.0, left=False) for b in batches]),
        group_size=batches[0].group_size)


def _take(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """The rows ``rows`` (whole groups, in order) of ``batch``."""
    idx = rows.tolist()
    return RolloutBatch(prompts=[batch.prompts[i] for i in idx], completions=[batch.completions[i] for i in idx],
                        prompt_ids=batch.prompt_ids[rows], prompt_mask=batch.prompt_mask[rows],
                        response_ids=batch.response_ids[rows], response_mask=batch.response_mask[rows],
                        sampling_logprobs=batch.sampling_logprobs[rows], group_size=batch.group_size)


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


# --------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------


def train_rl(cfg: RLConfig, sink: MetricSink | None = None, show_progress: bool = True, *,
             engine: RolloutEngine | None = None, reward_source: RewardSource | None = None,
             learner: Any = None, reference: Any = None) -> RLResult:
    """Optimise ``cfg.model_path`` online against a reward and save an HF directory at ``cfg.output_dir``.

    This function is the single controller. ``engine`` and ``reward_source`` default to
    :class:`HFGenerateEngine` on the policy and the source ``cfg.reward_kind`` names; ``learner``
    and ``reference`` default to an in-process :class:`PolicyLearner` and :class:`ReferenceScorer`
    (:mod:`rlhf_core.trainers.rl_roles`). The Ray launcher passes proxies of actor groups with
    the same methods (``alignflow rl --set placement=colocated``). The trainer calls
    ``engine.update_weights(...)`` after every update. With ``cfg.resume`` an interrupted run of the
    same config and inputs continues from its newest checkpoint in ``cfg.checkpoint_dir`` (see
    :mod:`rlhf_core.checkpoint`).
    """
    sink = sink or NullSink()
    seed_everything(cfg.seed, cfg.num_threads)
    device = pick_device()
    autocast_dtype = resolve_precision(cfg.precision, device)
    estimator = AdvantageEstimator(cfg.estimator)
    n, temp = cfg.group_size, cfg.temperature
    timer = Timer()

    # ---- load: policy learner (+ critic), frozen reference, reward, engine, prompts ----------
    tokenizer = load_tokenizer(cfg.model_path)
    pad_id = tokenizer.pad_token_id
    checkpointer = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg), cfg.keep_checkpoints)
    learner = learner or PolicyLearner(cfg, device)
    reference = reference or ReferenceScorer(cfg, device)
    policy = learner.policy  # in-process: the trained model; under Ray: a view refreshed from rank 0 on demand
    has_critic = estimator.needs_critic
    kind = RewardKind(cfg.reward_kind)
    if reward_source is None:
        reward_source = build_reward_source(
            kind, path=cfg.reward_model_path if kind is RewardKind.MODEL else cfg.reward_function,
            url=cfg.reward_url, device=device, batch_size=cfg.batch_size, timeout_s=cfg.reward_timeout_s,
            retries=cfg.reward_retries)
    owns_engine = engine is None
    engine = engine or build_rollout_engine(cfg, policy, tokenizer, autocast_dtype)
    # A LoRA policy's engine needs merged weights; the HF engine that holds the policy needs nothing.
    sync_weights = getattr(learner, "engine_weights", None)
    prompts, labels = read_prompts(cfg)
    longest = max(len(encode_prompt(tokenizer, p)) for p in prompts)
    if longest + cfg.max_new_tokens > cfg.max_length:
        raise ConfigError(f"rl.max_length: the longest prompt of {cfg.prompts_file} has {longest} tokens; with "
                          f"max_new_tokens {cfg.max_new_tokens} that exceeds max_length {cfg.max_length}")
    sampler = EpochSampler(len(prompts), cfg.prompts_per_step, cfg.seed)

    # ---- the KL controller; the learner owns the optimisers (its schedule advances once per iteration)
    kl_ctl: KLController = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl
                            else FixedKLController(cfg.kl_coef))
    update_gen = torch.Generator().manual_seed(cfg.seed)
    with checkpointer.hold("rl"):
        ckpt = checkpointer.latest() if cfg.resume else None
        resumables = {"sampler": sampler, "kl_controller": kl_ctl, "update_generator": _GeneratorState(update_gen)}

        # ---- evaluation: greedy exact match (+ the reward model's score of the greedy answers) -
        def evaluate(step: int) -> tuple[dict[str, float], list[dict[str, str]]]:
            model = learner.view()
            result = evaluate_exact_match(model, tokenizer, cfg.eval_file, prompt_field=cfg.prompt_field,
                                          label_field=cfg.label_field, max_items=cfg.eval_items,
                                          max_new_tokens=cfg.max_new_tokens, n_samples=cfg.eval_items)
            metrics = result.metrics("eval")
            if kind is RewardKind.MODEL:
                # how much the reward model likes the policy's answers: rises with reward hacking as well
                # as with real progress, so read it next to eval/accuracy
                rm = reward_source([s["prompt"] for s in result.samples], [s["completion"] for s in result.samples],
                                   [s["label"] for s in result.samples])
                metrics["eval/reward_model_score"] = _mean(rm)
            sink.log_metrics(metrics, step)
            return metrics, result.samples[:_EVAL_SAMPLES]

        summary: dict[str, float] = {}
        eval_metrics: dict[str, float] = {}
        eval_samples: list[dict[str, str]] = []
        eval_seconds = 0.0
        rollout_table: list[dict[str, Any]] = []
        step_metrics: dict[str, float] = {}
        start_step = 1
        if ckpt is not None:
            start_step = _restore(ckpt, learner, resumables) + 1
            engine.update_weights(sync_weights(engine))  # an engine of its own (vLLM) samples from the restored weights
            loop_state = ckpt.state["loop"]
            summary, step_metrics = dict(loop_state["summary"]), dict(loop_state["step_metrics"])
            eval_metrics, rollout_table = dict(loop_state["eval_metrics"]), list(loop_state["rollout_table"])
            log.warning("rl: resuming from %s (iteration %d of %d)", ckpt.path, ckpt.step, cfg.max_steps)
            sink.log_metrics({"checkpoint/resumed_from_step": float(ckpt.step)}, ckpt.step)
        if cfg.eval_at_start and ckpt is None:
            started = Timer()
            eval_metrics, eval_samples = evaluate(0)
            summary.update({f"{k}_start": v for k, v in eval_metrics.items()
                            if k in ("eval/accuracy", "eval/accuracy_stderr", "eval/reward_model_score")})
            eval_seconds += started.total()

        bar = tqdm(range(start_step, cfg.max_steps + 1), desc="rl", disable=not show_progress, mininterval=2.0)
        with sigterm_checkpoints() as stop:
            for step in bar:
                step_timer, lap = Timer(), Timer()
                perf = {"perf/rollout_s": 0.0, "perf/reward_s": 0.0}

                # ---- rollout + reward (+ DAPO dynamic sampling: top up with informative groups) ---
                kept_batches: list[RolloutBatch] = []
                kept_scores: list[torch.Tensor] = []
                all_rewards: list[torch.Tensor] = []
                all_lengths: list[torch.Tensor] = []
                sampled_groups = kept_groups = 0
                for round_ in range(1 + (cfg.dynamic_sampling_max_rounds if cfg.dynamic_sampling else 0)):
                    idx = sampler.next()
                    params = SamplingParams(n=n, temperature=temp, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                            seed=cfg.seed * 1_000_003 + step * 101 + round_)
                    lap.lap()
                    batch = engine.generate([prompts[i] for i in idx], params)
                    perf["perf/rollout_s"] += lap.lap()
                    row_labels = [labels[i] for i in idx for _ in range(n)]
                    rewards = torch.tensor(reward_source(batch.prompts, batch.completions, row_labels), dtype=torch.float32)
                    perf["perf/reward_s"] += lap.lap()
                    all_rewards.append(rewards)
                    all_lengths.append(batch.response_lengths().float())
                    keep = dynamic_sampling_keep(rewards, n) if n >= 2 else torch.ones(len(batch), dtype=torch.bool)
                    sampled_groups += len(idx)
                    kept_groups += int(keep.view(-1, n)[:, 0].sum())
                    if cfg.dynamic_sampling:
                        if not keep.any():
                            continue
                        rows = keep.nonzero().squeeze(-1)
                        batch, rewards = _take(batch, rows), rewards[rows]
                    kept_batches.append(batch)
                    kept_scores.append(rewards)
                    if sum(len(b) for b in kept_batches) >= cfg.prompts_per_step * n:
                        break
                if not kept_batches:  # every group of every round was uninformative: learn from nothing this step
                    kept_batches, kept_scores = [batch], [rewards]
                batch = _concat(kept_batches, pad_id)
                rewards = torch.cat(kept_scores)[:cfg.prompts_per_step * n]
                if len(batch) > cfg.prompts_per_step * n:
                    batch = _take(batch, torch.arange(cfg.prompts_per_step * n))

                # ---- reward shaping: DAPO soft overlong penalty -------------------------------------
                lengths = batch.response_lengths()
                scores = rewards.clone()
                if cfg.overlong_max_len:
                    scores = scores + overlong_penalty(lengths, cfg.overlong_max_len, cfg.overlong_cache_len)

                # ---- old / reference log-probs and values (no grad) ---------------------------------
                lap.lap()
                ids, attention = batch.sequences()
                prompt_width = batch.prompt_ids.shape[1]
                exp = {"input_ids": ids, "attention_mask": attention, "position_ids": batch.position_ids(),
                       "response_ids": batch.response_ids}
                exp = {k: v.to(device) for k, v in exp.items()}
                mask = batch.response_mask.to(device).float()
                sampling_logp = batch.sampling_logprobs.to(device)
                # One update per batch: pi_old is the update's own detached log-prob (PolicyLearner.update),
                # so the no-grad policy forward is skipped.
                fused_old = (cfg.recompute_old_logprobs and cfg.ppo_epochs == 1 and cfg.mini_batch_size >= len(batch)
                             and not has_critic and not cfg.kl_in_reward and cfg.tis_cap == 0)
                recompute = cfg.recompute_old_logprobs and not fused_old
                scored = learner.score(exp, prompt_width) if recompute or has_critic else {}
                old_logp = scored["old_logp"].to(device) if recompute else sampling_logp
                ref_logp = reference.logprobs(exp, prompt_width).to(device)
                old_values = scored["old_values"].to(device) if has_critic else None
                old_logp, ref_logp = old_logp * mask, ref_logp * mask
                perf["perf/logprob_s"] = lap.lap()

                # ---- advantages (KL to the reference folded into token rewards when kl_in_reward) ----
                kl_tokens = kl_penalty(old_logp, ref_logp, cfg.kl_estimator, clamp=_KL_CLAMP) * mask
                token_rewards = -kl_ctl.value * kl_tokens if cfg.kl_in_reward else None
                scores = scores.to(device)
                advantages, returns = compute_advantages(estimator, scores=scores, mask=mask, group_size=n,
                                                         values=old_values, token_rewards=token_rewards,
                                                         gamma=cfg.gamma, lam=cfg.lam)
                if estimator is AdvantageEstimator.GAE:
                    advantages = masked_whiten(advantages, mask)  # PPO's batch-level normalisation
                tis = {}
                if cfg.tis_cap > 0:  # engine/trainer mismatch: weight each token by min(pi_old / pi_engine, C)
                    weights = truncated_is_weights(old_logp, sampling_logp * mask, mask, cfg.tis_cap)
                    tis = {"train/tis_weight_mean": float(masked_mean(weights, mask)),
                           "train/tis_capped_frac": float(masked_mean((weights >= cfg.tis_cap).float(), mask))}
                    advantages = advantages * weights
                exp.update(mask=mask, ref_logp=ref_logp, advantages=advantages)
                exp.update({"sampling_logp": sampling_logp * mask} if fused_old else {"old_logp": old_logp})
                if has_critic:
                    exp.update(old_values=old_values * mask, returns=returns)

                # ---- update: ppo_epochs x mini-batches of the policy (and critic) ------------------
                rows = len(batch)
                orders = [torch.randperm(rows, generator=update_gen) for _ in range(cfg.ppo_epochs)]
                seen = learner.update(exp, prompt_width, orders, kl_ctl.value, step)
                lr_used = learner.end_iteration()
                perf["perf/update_s"] = lap.lap()
                engine.update_weights(sync_weights(engine))  # a no-op for the HF engine that holds the policy itself
                perf["perf/weight_sync_s"] = lap.lap()

                # ---- KL controller and logging -------------------------------------------------------
                # train/kl: mean over sequences of the summed per-token k3 estimate of KL(pi_old || pi_ref),
                # whatever kl_estimator the penalty uses, so runs with different penalties compare.
                if fused_old:  # measured by the learner against pi_old, as below
                    mean_seq_kl, mismatch = _mean(seen["seq_kl"]), _mean(seen["logprob_mismatch"])
                else:
                    mean_seq_kl = float((kl_penalty(old_logp, ref_logp, "k3", clamp=_KL_CLAMP) * mask).sum(-1).mean())
                    mismatch = float(masked_mean((sampling_logp - old_logp).abs(), mask))
                kl_coef_used = kl_ctl.value
                kl_ctl.update(mean_seq_kl, rows)
                sampled_rewards = torch.cat(all_rewards)
                step_metrics = {
                    "rollout/reward_mean": float(sampled_rewards.mean()),
                    "rollout/reward_std": float(sampled_rewards.std()) if sampled_rewards.numel() > 1 else 0.0,
                    "rollout/response_length": float(torch.cat(all_lengths).mean()),
                    "rollout/kept_groups_frac": kept_groups / max(sampled_groups, 1),
                    "rollout/sampled_groups": float(sampled_groups),
                    "rollout/score_mean": float(scores.mean()),
                    "rollout/logprob_mismatch": mismatch,
                    "train/policy_loss": _mean(seen["policy_loss"]),
                    "train/kl": mean_seq_kl,
                    "train/entropy": _mean(seen["entropy"]),
                    "train/clip_frac": _mean(seen["clip_frac"]),
                    "train/approx_kl": _mean(seen["approx_kl"]),
                    "train/adv_mean": float(masked_mean(advantages, mask)),
                    "train/adv_std": float(masked_mean((advantages - masked_mean(advantages, mask)) ** 2, mask).sqrt()),
                    "train/kl_coef": kl_coef_used,
                    "train/grad_norm": _mean(seen["grad_norm"]),
                    "train/lr": lr_used,
                }
                if seen["kl_loss"]:
                    step_metrics["train/kl_loss"] = _mean(seen["kl_loss"])
                if has_critic:
                    step_metrics.update({"train/value_loss": _mean(seen["value_loss"]),
                                         "train/value_clip_frac": _mean(seen["value_clip_frac"]),
                                         "train/explained_variance": float(explained_variance(exp["old_values"], returns,
                                                                                              mask))})
                step_metrics.update(tis)
                step_metrics.update(perf)
                step_metrics["perf/step_s"] = step_timer.total()
                sink.log_metrics(step_metrics, step)
                bar.set_postfix(reward=f"{step_metrics['rollout/reward_mean']:.3f}", kl=f"{step_metrics['train/kl']:.3f}")

                if cfg.log_rollouts_every and (step % cfg.log_rollouts_every == 0 or step == 1):
                    rows_now = [{"step": step, "prompt": batch.prompts[i], "completion": batch.completions[i],
                                 "reward": float(rewards[i])} for i in range(min(len(batch), _TABLE_GROUPS * n))]
                    rollout_table += rows_now
                    if hasattr(sink, "log_table"):
                        sink.log_table(rows_now, "rollouts.json")

                # ---- periodic eval and checkpoints --------------------------------------------------
                if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.max_steps:
                    started = Timer()
                    eval_metrics, eval_samples = evaluate(step)
                    eval_seconds += started.total()
                if (cfg.save_every and step % cfg.save_every == 0) or stop.requested:
                    path = checkpointer.save(step, learner.view(), tokenizer, {
                        **learner.state_dict(),
                        "objects": {key: obj.state_dict() for key, obj in resumables.items()},
                        "loop": {"summary": summary, "step_metrics": step_metrics, "eval_metrics": eval_metrics,
                                 "rollout_table": rollout_table}})
                if stop.requested:
                    raise TrainingInterrupted(f"rl: stopped by SIGTERM after iteration {step}; resume from {path}")
                inject_fault("rl", step)
        train_seconds = timer.total() - eval_seconds

        # ---- final eval, then save ---------------------------------------------------------------
        eval_metrics, eval_samples = evaluate(cfg.max_steps)
        sink.log_metrics({"perf/train_seconds": train_seconds, "perf/total_seconds": timer.total()}, cfg.max_steps)
        final = learner.view()
        save_hf_dir(merged_model(final), tokenizer, cfg.output_dir,
                    extra={"stage": "rl", "config": redact_secrets(config_to_dict(cfg)),
                           "base_model": str(cfg.model_path)})
        checkpointer.clear()
    if owns_engine and hasattr(engine, "close"):
        engine.close()  # a vLLM engine's worker processes (on an exception, vLLM's own exit hooks do it)
    metrics = {**step_metrics, **eval_metrics, **summary, "perf/train_seconds": train_seconds,
               "perf/total_seconds": timer.total()}
    return RLResult(Path(cfg.output_dir), metrics, eval_samples, rollout_table)


# --------------------------------------------------------------------------------------
# Checkpoints: the policy as an HF directory, everything else in trainer_state.pt
# --------------------------------------------------------------------------------------


class _GeneratorState:
    """A torch.Generator seen as a checkpointable object."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["state"])


def build_rollout_engine(cfg: RLConfig, policy: Any, tokenizer: Any,
                         autocast_dtype: torch.dtype | None = None) -> RolloutEngine:
    """The engine ``cfg.rollout_engine`` names; vLLM falls back to HF generate, with a warning, when absent."""
    if cfg.rollout_engine == "vllm":
        from rlhf_core.rollout_vllm import VLLMEngine, vllm_available

        if vllm_available():
            return VLLMEngine(cfg.model_path, tokenizer, seed=cfg.seed, memory_fraction=cfg.vllm_memory_fraction)
        log.warning("rl: rollout_engine is vllm but vLLM cannot be imported here; using the HF engine instead")
    if cfg.rollout_engine == "static":
        from rlhf_core.rollout_static import StaticCacheEngine, supports

        reason = supports(policy)
        if reason is None:
            return StaticCacheEngine(policy, tokenizer, batch_size=cfg.batch_size, autocast_dtype=autocast_dtype)
        log.warning("rl: rollout_engine static cannot run this policy (%s); using the HF engine instead", reason)
    return HFGenerateEngine(policy, tokenizer, batch_size=cfg.batch_size, autocast_dtype=autocast_dtype)


def _restore(ckpt: Checkpoint, learner: Any, resumables: dict[str, Any]) -> int:
    """Load a checkpoint into the learner (policy, optimizers, schedules, critic), RNG and ``resumables``."""
    load_weights(learner.view(), ckpt.path)  # the policy itself, or the controller's view of rank 0's
    learner.load_state_dict(ckpt.state)
    for key, obj in resumables.items():
        if key not in ckpt.state["objects"]:
            raise ValueError(f"{ckpt.path}: checkpoint has no {key} state")
        obj.load_state_dict(ckpt.state["objects"][key])
    set_rng_state(ckpt.state["rng"])
    return ckpt.step


