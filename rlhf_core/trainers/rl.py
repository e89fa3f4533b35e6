"""Online RL from sampled rollouts: PPO (GAE + critic), REINFORCE++, RLOO, GRPO and Dr.GRPO, with DAPO's options,
and on-policy distillation from a teacher (``estimator: distill``).

Reads top to bottom like cleanrl's ``ppo.py``: :meth:`RLTrainer.train_step` is one iteration (one
``step``) as named phases over a batch, each a short method below it:

1. ``generate``: ``prompts_per_step`` prompts x ``group_size`` samples from the policy (a ``RolloutEngine``),
   each scored by a ``RewardSource`` (rule file, reward model or HTTP), label passed through; with
   ``environment`` set, multi-turn trajectories instead (:func:`rlhf_core.rollout.environments.rollout_with_environment`:
   the policy's turns, a tool's observations between them, ``action_mask`` marking the policy's tokens,
   the only ones the loss, the KL and the advantages cover);
2. DAPO dynamic sampling (in ``generate``): drop groups whose samples all scored the same and top up
   from more prompts; ``shape_rewards``: the overlong penalty;
3. ``score_logprobs``: old (the policy, no grad), reference, values (the critic, ``gae`` only) and the
   teacher's (``distill`` only);
4. ``estimate_advantages``: :func:`rlhf_core.algorithms.rl_math.compute_advantages`, the KL folded into token
   rewards when ``kl_in_reward`` (PPO, REINFORCE++), else added to the loss (GRPO); for ``distill`` each
   token's reward is the teacher's :func:`rlhf_core.algorithms.rl_math.reverse_kl_token_rewards`;
5. ``update``: ``ppo_epochs`` passes of mini-batches: clipped policy loss (+ KL, - entropy bonus), and
   the critic's clipped value loss with its own optimizer;
6. ``sync_weights``: the rollout engine samples from the new weights;
7. ``iteration_metrics``: the KL controller and the iteration's metrics.

Asynchronous training (``max_staleness: k >= 1``; 0, the default, is the synchronous loop above): step ``s``
takes batch ``s``, generated during step ``s - 1``, then launches the generation of batch ``s + 1`` on a
rollout thread (``launch``) and runs phases 3-5 beside it. Under Ray's disaggregated placement the thread only
waits on the rollout replicas, so generation and update run on separate devices; in one process the engine
samples from a copy of the policy of its own. Weights are pushed to the engine only when the batch being
launched would otherwise come from a policy more than ``k`` updates older than the one it updates.
Which log-prob is which under staleness (the decoupled PPO objective, Hilton et al. 2021; AReaL):
``old_logp`` (pi_old, the PPO ratio's anchor) is always recomputed from the policy *being updated*, before its
update (``recompute_old_logprobs`` is required); ``sampling_logp`` is the engine's, i.e. the behaviour policy
``k`` versions back (plus any engine numerics). Their ratio pi_old / pi_engine is what ``tis_cap`` truncates
per token and ``mis_threshold`` masks per sequence, and it is logged as ``async/is_weight_mean``.
Checkpoints: a checkpoint waits for the batch in flight and stores it (samples, rewards, the policy version
it came from), and the next launch after a checkpoint (or a resume) pushes weights first, so a resumed run
continues bit-identically (``tests/model/test_rl_async.py``).

Resume, SIGTERM, periodic eval and checkpoints, and the final save are the one checkpointed loop's
(:func:`rlhf_core.trainers.loop.run_checkpointed`), the same loop the offline trainers run in.

Every formula lives in :mod:`rlhf_core.algorithms.rl_math`; the engine and the reward sit behind their Protocols
(:mod:`rlhf_core.rollout.engine`, :mod:`rlhf_core.rewards.sources`), so a vLLM engine or a remote reward changes nothing
here. Only torch and transformers are imported: the same file runs on a GPU box without MLflow or Prefect.

Run: ``alignflow rl`` (config: ``params.yaml`` section ``rl``), or ``train_rl(RLConfig(...))``.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import RLConfig, config_to_dict
from rlhf_core.rollout.environments import (environment_factory, evaluate_with_environment, rollout_with_environment,
                                    trajectory_rows)
from rlhf_core.rollout.evaluate import eval_options, evaluate_exact_match
from rlhf_core.models.loading import load_tokenizer, merged_model, pick_device
from rlhf_core.models.precision import Precision
from rlhf_core.common.redact import redact_secrets
from rlhf_core.rewards.sources import RewardKind, RewardSource, load_function
from rlhf_core.algorithms.advantages import (compute_advantages, dynamic_sampling_keep, overlong_penalty,
                                             reverse_kl_token_rewards)
from rlhf_core.algorithms.kl import AdaptiveKLController, FixedKLController, KLController, kl_penalty
from rlhf_core.algorithms.masked import masked_mean, masked_whiten
from rlhf_core.algorithms.policy import explained_variance, sequence_is_mask, truncated_is_weights
from rlhf_core.config.choices import AdvantageEstimator
from rlhf_core.rollout.engine import ReleasesWeights, RolloutBatch, RolloutEngine, SamplingParams
from rlhf_core.tracking.checkpoint import Checkpoint, Checkpointer, read_weights, run_fingerprint
from rlhf_core.trainers.batches import EpochSampler
from rlhf_core.trainers.loop import (
    LoopClock, LoopPlan, MetricSink, NullSink, StorageNeeds, Timer, estimate_state_bytes, run_checkpointed,
    save_hf_dir)
from rlhf_core.trainers.step import seed_everything
from rlhf_core.trainers.rl_parts import (Experience, GeneratorState, PhaseTimes, RLResult, Rollout, Sampled,
                                         concat_batches, mean_or_nan, rendered_rollout_rows,
                                         sampling_parts, take_rows, training_prompts)
from rlhf_core.trainers.rl_roles import KL_CLAMP as _KL_CLAMP
from rlhf_core.trainers.rl_roles import build_roles
from rlhf_core.trainers.rl_dashboard import DashboardRecorder

# Rollout tables show whole groups, so a reader sees what the group baseline compared.
_TABLE_GROUPS = 4
_EVAL_SAMPLES = 8

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# The trainer: train_rl runs RLTrainer's iteration inside the one checkpointed loop
# --------------------------------------------------------------------------------------


def train_rl(cfg: RLConfig, sink: MetricSink | None = None, show_progress: bool = True, *,
             engine: RolloutEngine | None = None, reward_source: RewardSource | None = None,
             learner: Any = None, reference: Any = None, teacher: Any = None) -> RLResult:
    """Optimise ``cfg.model_path`` online against a reward and save an HF directory at ``cfg.output_dir``.

    ``engine`` and ``reward_source`` default to the engine ``cfg.rollout.engine`` names on the
    policy and the source ``cfg.reward.kind`` names; ``learner`` and ``reference`` default to an
    in-process :class:`PolicyLearner` and :class:`ReferenceScorer` (:mod:`rlhf_core.trainers.rl_roles`);
    ``teacher`` (``estimator: distill`` only) to a :class:`ReferenceScorer` of ``cfg.distill.teacher_model_path``.
    The Ray launcher passes proxies of actor groups with the same methods (``alignflow rl --set
    placement=colocated``). With ``cfg.resume`` an interrupted run of the same config and inputs
    continues from its newest checkpoint in ``cfg.checkpoint_dir``
    (:func:`rlhf_core.trainers.loop.run_checkpointed`, :mod:`rlhf_core.tracking.checkpoint`).
    """
    sink = sink or NullSink()
    seed_everything(cfg.seed, cfg.num_threads)
    trainer = RLTrainer(cfg, sink, engine=engine, reward_source=reward_source, learner=learner, reference=reference,
                        teacher=teacher)
    plan = LoopPlan("rl", cfg.max_steps, cfg.eval_every, cfg.save_every, cfg.resume, eval_at_start=cfg.eval_at_start)
    checkpointer = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg), cfg.keep_checkpoints)
    # the last iteration's metrics and the start-of-run eval: recorded with the output, so a stage retried
    # after the final save (loop.run_checkpointed reuses it) reports them without training again
    try:
        outcome = run_checkpointed(plan, checkpointer, trainer, sink=sink, show_progress=show_progress,
                                   result_metrics=lambda _: {**trainer.step_metrics, **trainer.summary})
    finally:
        trainer.close()  # the rollout thread (max_staleness >= 1): it finishes the batch in flight, if any
    if engine is None and hasattr(trainer.engine, "close"):
        trainer.engine.close()  # a vLLM engine's worker processes (on an exception, vLLM's own exit hooks do it)
    metrics = {**outcome.result_metrics, **outcome.eval_metrics,
               "perf/train_seconds": outcome.train_seconds, "perf/total_seconds": outcome.total_seconds}
    return RLResult(Path(cfg.output_dir), metrics, outcome.eval_samples, trainer.rollout_table,
                    trainer.rendered_examples, outcome.eval_answers,
                    trainer.dashboard.write_page(f"rl: {cfg.output_dir}"))


class RLTrainer:
    """One RL iteration as named phases, and the run's state (a :class:`rlhf_core.trainers.loop.TrainingBody`)."""

    def __init__(self, cfg: RLConfig, sink: MetricSink, *, engine: RolloutEngine | None = None,
                 reward_source: RewardSource | None = None, learner: Any = None, reference: Any = None,
                 teacher: Any = None):
        self.cfg, self.sink = cfg, sink
        self.device = pick_device()
        autocast_dtype = Precision.resolve(cfg.precision, self.device).compute_dtype
        self.estimator = AdvantageEstimator(cfg.algorithm.estimator)
        self.tokenizer = load_tokenizer(cfg.model_path)
        # before any model loads: a mismatched teacher or a prompt too long fails in seconds
        self.prompts, self.labels, self.conversations = training_prompts(cfg, self.tokenizer)
        self.learner, self.reference, self.teacher = build_roles(cfg, self.device, learner, reference, teacher)
        self.kind = RewardKind(cfg.reward.kind)
        self.reward_source, self.engine = sampling_parts(cfg, self.learner, self.tokenizer, self.device,
                                                         autocast_dtype, engine, reward_source)
        # A LoRA policy's engine needs merged weights; the HF engine that holds the policy needs nothing.
        self.engine_weights = getattr(self.learner, "engine_weights", None)
        # multi-turn rollouts: a fresh environment per trajectory (rlhf_core/rollout/environments.py); None: single-turn
        self.make_env = (environment_factory(cfg.environment.spec, stop_tokens=cfg.environment.stop_tokens,
                                             timeout_s=cfg.reward.timeout_s, retries=cfg.reward.retries,
                                             backoff_cap_s=cfg.reward.backoff_cap_s, deadline_s=cfg.reward.deadline_s,
                                             token_env=cfg.environment.token_env,
                                             max_response_bytes=cfg.reward.max_response_bytes)
                         if cfg.environment.spec else None)
        self.sampler = EpochSampler(len(self.prompts), cfg.rollout.prompts_per_step, cfg.seed)
        # the KL controller; the learner owns the optimisers (its schedule advances once per iteration)
        self.kl_ctl: KLController = (AdaptiveKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
                                     if cfg.kl.adaptive else FixedKLController(cfg.kl.coef))
        self.update_gen = torch.Generator().manual_seed(cfg.seed)
        self.resumables = {"sampler": self.sampler, "kl_controller": self.kl_ctl,
                           "update_generator": GeneratorState(self.update_gen)}
        self.summary: dict[str, float] = {}
        self.step_metrics: dict[str, float] = {}
        self.rollout_table: list[dict[str, Any]] = []
        self.rendered_examples: list[dict[str, Any]] = []
        self.dashboard = DashboardRecorder(cfg, self.tokenizer, self.device)  # the run dashboard's per-step lines
        # Asynchronous training: the batch in flight, the policy version the engine samples from, and whether
        # the next launch must push weights whatever the gap (after a checkpoint: a resume does too)
        self.pending: Future | None = None
        self.in_flight: Rollout | None = None  # what the pending future fills in (its timestamps, read for overlap)
        self.engine_version, self.sync_due = 0, False
        self.rollout_thread = (ThreadPoolExecutor(1, thread_name_prefix="rl-rollout") if cfg.off_policy.max_staleness
                               else None)

    # ---- one iteration: the algorithm ----------------------------------------------------------

    def train_step(self, step: int, clock: LoopClock) -> dict[str, float]:
        """generate -> score -> old/reference log-probs (values) -> advantages -> update -> sync weights.

        Asynchronous (``max_staleness >= 1``): this step's batch was generated during the previous step;
        the next batch's generation is launched before this step's update and runs beside it."""
        del clock
        step_timer, perf = Timer(), PhaseTimes()
        rollout = self.take_rollout(step, perf)
        sampled = rollout.sampled
        if not self.cfg.off_policy.max_staleness and isinstance(self.engine, ReleasesWeights):
            self.engine.release_weights()  # colocated replicas' weights: freed until this step's sync refills them
        if self.cfg.off_policy.max_staleness and step < self.cfg.max_steps:
            self.launch(step + 1, perf)
        if not self.rendered_examples:  # the first iteration's samples, for a reviewer (RLResult)
            self.rendered_examples = rendered_rollout_rows(self.tokenizer, sampled.batch, sampled.rewards)
        learn_start = time.time()
        scores = self.shape_rewards(sampled)
        exp = perf.time("perf/logprob_s", self.score_logprobs, sampled.batch)
        self.dashboard.before_update(sampled, exp)
        self.estimate_advantages(exp, scores)
        update_start = time.time()
        seen, lr_used = perf.time("perf/update_s", self.update, exp, step)
        update_end = time.time()
        if not self.cfg.off_policy.max_staleness:  # asynchronous: weights move at the next launch, when needed
            perf.time("perf/weight_sync_s", self.sync_weights, perf)
        metrics = self.iteration_metrics(sampled, exp, seen, lr_used)
        metrics.update(perf.seconds)
        metrics.update(perf.tallies)
        metrics.update(self.timeline(rollout, learn_start, update_start, update_end))
        metrics["perf/step_s"] = step_timer.total()
        self.step_metrics = metrics
        self.dashboard.record(step, rollout, exp, metrics, perf)
        self.log_rollouts(step, sampled)
        return metrics

    # ---- 0 (asynchronous): the batch in flight -------------------------------------------------

    def take_rollout(self, step: int, perf: PhaseTimes) -> Rollout:
        """Batch ``step``: the one in flight (waited for, ``perf/rollout_wait_s``), else generated now."""
        if self.pending is None:  # synchronous, the first step, or the step after a restart
            rollout = self._generate_rollout(Rollout(step, self.engine_version))
        else:
            waited = Timer()
            rollout, self.pending = self.pending.result(), None
            perf.seconds["perf/rollout_wait_s"] = waited.total()
        if rollout.step != step:
            raise RuntimeError(f"rl: iteration {step} got the rollout of iteration {rollout.step}")
        for name, seconds in rollout.seconds.items():
            perf.seconds[name] = perf.seconds.get(name, 0.0) + seconds
        return rollout

    def launch(self, step: int, perf: PhaseTimes) -> None:
        """Start generating batch ``step`` on the rollout thread. The policy that will learn from it is version
        ``step - 1`` (updates done); the engine's weights may be at most ``max_staleness`` versions older, so
        when they would be, the learner's current weights (version ``step - 2``) are pushed first."""
        if self.sync_due or (step - 1) - self.engine_version > self.cfg.off_policy.max_staleness:
            perf.time("perf/weight_sync_s", self.sync_weights, perf)
            self.engine_version, self.sync_due = step - 2, False
        # The thread draws prompts from the sampler and samples with a per-step seed (a private RNG stream in
        # the static and vLLM engines, a forked one in HF's); nothing else touches the sampler until the batch
        # is taken, or a checkpoint waits for it.
        self.in_flight = Rollout(step, self.engine_version)
        self.pending = self.rollout_thread.submit(self._generate_rollout, self.in_flight)

    def _generate_rollout(self, rollout: Rollout) -> Rollout:
        perf = PhaseTimes()
        rollout.start = time.time()
        rollout.sampled = self.generate(rollout.step, perf)
        rollout.seconds, rollout.spans, rollout.end = perf.seconds, perf.spans, time.time()
        return rollout

    def timeline(self, rollout: Rollout, learn_start: float, update_start: float,
                 update_end: float) -> dict[str, float]:
        """Wall-clock timestamps (``time.time()``) of this batch's generation and of this step's update, and
        ``perf/overlap_s``: seconds the next batch's generation ran beside this step's log-prob, advantage and
        update phases (0 when synchronous). Asynchronous runs add ``async/staleness``: updates between the
        policy that generated this batch and the one it updates."""
        out = {"perf/rollout_start_ts": rollout.start, "perf/rollout_end_ts": rollout.end,
               "perf/update_start_ts": update_start, "perf/update_end_ts": update_end, "perf/overlap_s": 0.0}
        if self.cfg.off_policy.max_staleness:
            out["async/staleness"] = float(rollout.step - 1 - rollout.version)
        running = self.in_flight if self.pending is not None else None
        if running is not None and running.start is not None:  # the thread's own timestamps
            end = running.end if running.end is not None else update_end
            out["perf/overlap_s"] = max(0.0, min(end, update_end) - max(running.start, learn_start))
        return out

    # ---- 1-3: rollout, reward, DAPO dynamic sampling -------------------------------------------

    def generate(self, step: int, perf: PhaseTimes) -> Sampled:
        """``prompts_per_step`` prompts x ``group_size`` samples, scored; with DAPO's dynamic sampling,
        groups whose samples all scored the same are dropped and more prompts drawn (up to
        ``dynamic_sampling_max_rounds`` top-ups) until the batch is full."""
        cfg, n = self.cfg, self.cfg.rollout.group_size
        want = cfg.rollout.prompts_per_step * n
        kept: list[RolloutBatch] = []
        kept_rewards: list[torch.Tensor] = []
        all_rewards: list[torch.Tensor] = []
        all_lengths: list[torch.Tensor] = []
        sampled_groups = kept_groups = 0
        for round_ in range(1 + (cfg.dapo.dynamic_sampling_max_rounds if cfg.dapo.dynamic_sampling else 0)):
            batch, rewards, n_prompts = self._sample_round(step, round_, perf)
            all_rewards.append(rewards)
            all_lengths.append(batch.response_lengths().float())
            keep = dynamic_sampling_keep(rewards, n) if n >= 2 else torch.ones(len(batch), dtype=torch.bool)
            sampled_groups += n_prompts
            kept_groups += int(keep.view(-1, n)[:, 0].sum())
            if cfg.dapo.dynamic_sampling:
                if not keep.any():
                    continue
                rows = keep.nonzero().squeeze(-1)
                batch, rewards = take_rows(batch, rows), rewards[rows]
            kept.append(batch)
            kept_rewards.append(rewards)
            if sum(len(b) for b in kept) >= want:
                break
        if not kept:  # every group of every round was uninformative: learn from nothing this step
            kept, kept_rewards = [batch], [rewards]
        batch = concat_batches(kept, self.tokenizer.pad_token_id)
        if len(batch) > want:
            batch = take_rows(batch, torch.arange(want))
        return Sampled(batch, torch.cat(kept_rewards)[:want], torch.cat(all_rewards), torch.cat(all_lengths),
                       sampled_groups, kept_groups)

    def _sample_round(self, step: int, round_: int, perf: PhaseTimes) -> tuple[RolloutBatch, torch.Tensor, int]:
        """One draw of prompts from the sampler, sampled by the engine and scored by the reward source."""
        cfg, n = self.cfg, self.cfg.rollout.group_size
        idx = self.sampler.next()
        params = SamplingParams(n=n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_new_tokens=cfg.rollout.max_new_tokens,
                                seed=cfg.seed * 1_000_003 + step * 101 + round_)
        row_labels = [self.labels[i] for i in idx for _ in range(n)]
        if self.make_env is not None:  # multi-turn: engine turns and environment steps, then the reward source
            conversations = None if self.conversations is None else [self.conversations[i] for i in idx]
            batch, env_rewards = perf.time("perf/rollout_s", lambda: rollout_with_environment(
                self.engine, self.tokenizer, [self.prompts[i] for i in idx], [self.labels[i] for i in idx], params,
                self.make_env, max_turns=cfg.environment.max_turns,
                max_trajectory_tokens=cfg.environment.max_trajectory_tokens,
                conversations=conversations))
            rewards = perf.time("perf/reward_s", self.reward_source, batch.prompts, batch.completions, row_labels)
            return batch, torch.tensor(rewards, dtype=torch.float32) + env_rewards, len(idx)
        batch = perf.time("perf/rollout_s", self.engine.generate, [self.prompts[i] for i in idx], params)
        rewards = perf.time("perf/reward_s", self.reward_source, batch.prompts, batch.completions, row_labels)
        return batch, torch.tensor(rewards, dtype=torch.float32), len(idx)

    def shape_rewards(self, sampled: Sampled) -> torch.Tensor:
        """Each kept sample's score: its reward, plus DAPO's soft overlong penalty when configured."""
        cfg = self.cfg
        scores = sampled.rewards.clone()
        if cfg.dapo.overlong_max_len:
            lengths = sampled.batch.response_lengths()
            scores = scores + overlong_penalty(lengths, cfg.dapo.overlong_max_len, cfg.dapo.overlong_cache_len)
        return scores

    # ---- 4: old / reference log-probs and values (no grad) -------------------------------------

    def score_logprobs(self, batch: RolloutBatch) -> Experience:
        """pi_old (unless fused into the update), the reference's log-probs, the critic's values and the teacher's
        log-probs."""
        cfg, device = self.cfg, self.device
        prompt_width = batch.prompt_ids.shape[1]
        tensors = {k: v.to(device) for k, v in batch.learner_inputs().items()}
        mask = batch.loss_mask().to(device).float()  # the policy's tokens: observations carry no loss, no advantage
        sampling_logp = batch.sampling_logprobs.to(device)
        has_critic = self.estimator.needs_critic
        # One update per batch: pi_old is the update's own detached log-prob (PolicyLearner.update),
        # so the no-grad policy forward is skipped; not where the advantages themselves need pi_old.
        # Nor where pi_old / pi_engine is needed here (TIS, MIS, the asynchronous IS weights).
        fused_old = (cfg.off_policy.recompute_old_logprobs and cfg.algorithm.ppo_epochs == 1
                     and cfg.algorithm.mini_batch_size >= len(batch)
                     and not has_critic and not cfg.kl.in_reward and cfg.off_policy.tis_cap == 0
                     and not self.estimator.needs_teacher and cfg.off_policy.mis_threshold == 0
                     and cfg.off_policy.max_staleness == 0)
        recompute = cfg.off_policy.recompute_old_logprobs and not fused_old
        scored = self.learner.score(tensors, prompt_width) if recompute or has_critic else {}
        old_logp = scored["old_logp"].to(device) if recompute else sampling_logp
        ref_logp = self.reference.logprobs(tensors, prompt_width).to(device)
        old_values = scored["old_values"].to(device) if has_critic else None
        teacher_logp = None
        if self.teacher is not None:
            teacher_logp = self.teacher.logprobs(tensors, prompt_width).to(device) * mask
        return Experience(tensors, prompt_width, mask, sampling_logp, old_logp * mask, ref_logp * mask, old_values,
                          fused_old, teacher_logp)

    # ---- 5: advantages (KL to the reference folded into token rewards when kl_in_reward; distill: the teacher's)

    def estimate_advantages(self, exp: Experience, scores: torch.Tensor) -> None:
        """Advantages and returns into ``exp``, weighted by truncated IS when ``tis_cap`` is set, responses
        outside the ``mis_threshold`` band masked out of the loss."""
        cfg, mask = self.cfg, exp.mask
        kl_tokens = kl_penalty(exp.old_logp, exp.ref_logp, cfg.kl.estimator, clamp=_KL_CLAMP,
                               k3_cap=cfg.kl.k3_cap or None) * mask
        token_rewards = -self.kl_ctl.value * kl_tokens if cfg.kl.in_reward else None
        if exp.teacher_logp is not None:  # on-policy distillation: r_t = -(log pi_old - log pi_teacher)(y_t)
            distill = reverse_kl_token_rewards(exp.old_logp, exp.teacher_logp, mask, clamp=_KL_CLAMP)
            token_rewards = distill if token_rewards is None else token_rewards + distill
        exp.scores = scores.to(self.device)
        advantages, returns = compute_advantages(self.estimator, scores=exp.scores, mask=mask,
                                                 group_size=cfg.rollout.group_size,
                                                 values=exp.old_values, token_rewards=token_rewards,
                                                 gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                                                 distill_reward_coef=cfg.distill.reward_coef)
        if self.estimator is AdvantageEstimator.GAE:
            advantages = masked_whiten(advantages, mask)  # PPO's batch-level normalisation
        if cfg.off_policy.tis_cap > 0:  # engine/trainer mismatch: weight each token by min(pi_old / pi_engine, C)
            weights = truncated_is_weights(exp.old_logp, exp.sampling_logp * mask, mask, cfg.off_policy.tis_cap)
            exp.tis = {"train/tis_weight_mean": float(masked_mean(weights, mask)),
                       "train/tis_capped_frac": float(masked_mean((weights >= cfg.off_policy.tis_cap).float(), mask))}
            advantages = advantages * weights
        loss_mask = self.off_policy_mask(exp)
        exp.advantages, exp.returns = advantages, returns
        exp.tensors.update(mask=loss_mask, ref_logp=exp.ref_logp, advantages=advantages * loss_mask)
        exp.tensors.update({"sampling_logp": exp.sampling_logp * mask} if exp.fused_old else {"old_logp": exp.old_logp})
        if exp.old_values is not None:
            exp.tensors.update(old_values=exp.old_values * mask, returns=returns)

    def off_policy_mask(self, exp: Experience) -> torch.Tensor:
        """The update's token mask: ``exp.mask`` less the responses Seq-MIS drops (``mis_threshold``), and the
        diagnostics of pi_old / pi_engine (the stale or mismatched engine) into ``exp.tis``."""
        cfg, mask = self.cfg, exp.mask
        if not cfg.off_policy.mis_threshold and not cfg.off_policy.max_staleness:
            return mask
        log_ratio = (exp.old_logp - exp.sampling_logp * mask).clamp(-_KL_CLAMP, _KL_CLAMP)
        exp.tis["async/is_weight_mean"] = float(masked_mean(torch.exp(log_ratio), mask))
        keep = torch.ones(len(mask), dtype=mask.dtype, device=mask.device)
        if cfg.off_policy.mis_threshold:
            keep, _ = sequence_is_mask(exp.old_logp, exp.sampling_logp * mask, mask, cfg.off_policy.mis_threshold)
        exp.tis["async/mis_masked_frac"] = float(1.0 - keep.mean())
        return mask * keep.unsqueeze(-1)

    # ---- 6-7: update (ppo_epochs x mini-batches of the policy and critic), sync the engine ------

    def update(self, exp: Experience, step: int) -> tuple[dict[str, list[float]], float]:
        """The learner's optimizer steps; returns their diagnostics and the learning rate used."""
        orders = [torch.randperm(len(exp.mask), generator=self.update_gen)
                  for _ in range(self.cfg.algorithm.ppo_epochs)]
        seen = self.learner.update(exp.tensors, exp.prompt_width, orders, self.kl_ctl.value, step)
        return seen, self.learner.end_iteration()

    def sync_weights(self, perf: PhaseTimes | None = None) -> None:
        """Hand the updated weights to the rollout engine (a no-op for the HF engine that holds the policy); the
        bytes it took in go to ``perf`` as ``perf/weight_sync_bytes`` (beside the sync's ``perf/weight_sync_s``)."""
        moved = self.engine.update_weights(self.engine_weights(self.engine))
        if perf is not None:
            perf.tally("perf/weight_sync_bytes", moved or 0)

    # ---- KL controller and logging -------------------------------------------------------------

    def iteration_metrics(self, sampled: Sampled, exp: Experience, seen: dict[str, list[float]],
                          lr_used: float) -> dict[str, float]:
        """The iteration's rollout/ and train/ metrics; advances the KL controller."""
        mask, advantages = exp.mask, exp.advantages
        # train/kl: mean over sequences of the summed per-token k3 estimate of KL(pi_old || pi_ref),
        # whatever kl_estimator the penalty uses, so runs with different penalties compare.
        if exp.fused_old:  # measured by the learner against pi_old, as below
            mean_seq_kl, mismatch = mean_or_nan(seen["seq_kl"]), mean_or_nan(seen["logprob_mismatch"])
        else:
            mean_seq_kl = float((kl_penalty(exp.old_logp, exp.ref_logp, "k3", clamp=_KL_CLAMP) * mask).sum(-1).mean())
            mismatch = float(masked_mean((exp.sampling_logp - exp.old_logp).abs(), mask))
        kl_coef_used = self.kl_ctl.value
        self.kl_ctl.update(mean_seq_kl, len(mask))
        rewards = sampled.all_rewards
        metrics = {
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "rollout/response_length": float(sampled.all_lengths.mean()),
            "rollout/kept_groups_frac": sampled.kept_groups / max(sampled.sampled_groups, 1),
            "rollout/sampled_groups": float(sampled.sampled_groups),
            "rollout/score_mean": float(exp.scores.mean()),
            "rollout/logprob_mismatch": mismatch,
            "train/policy_loss": mean_or_nan(seen["policy_loss"]),
            "train/kl": mean_seq_kl,
            "train/entropy": mean_or_nan(seen["entropy"]),
            "train/clip_frac": mean_or_nan(seen["clip_frac"]),
            "train/approx_kl": mean_or_nan(seen["approx_kl"]),
            "train/adv_mean": float(masked_mean(advantages, mask)),
            "train/adv_std": float(masked_mean((advantages - masked_mean(advantages, mask)) ** 2, mask).sqrt()),
            "train/kl_coef": kl_coef_used,
            "train/grad_norm": mean_or_nan(seen["grad_norm"]),
            "train/lr": lr_used,
        }
        if seen["kl_loss"]:
            metrics["train/kl_loss"] = mean_or_nan(seen["kl_loss"])
        if exp.teacher_logp is not None:  # mean per response token of the k1 estimate of KL(pi_old || pi_teacher)
            metrics["rollout/teacher_reverse_kl"] = float(masked_mean(exp.old_logp - exp.teacher_logp, mask))
        if exp.old_values is not None:
            metrics.update({"train/value_loss": mean_or_nan(seen["value_loss"]),
                            "train/value_clip_frac": mean_or_nan(seen["value_clip_frac"]),
                            "train/explained_variance": float(explained_variance(exp.tensors["old_values"],
                                                                                 exp.returns, mask))})
        metrics.update(exp.tis)
        if sampled.batch.tool_calls is not None:  # multi-turn rollouts only: single-turn metrics stay as they were
            calls = sampled.batch.tool_calls.float()
            metrics.update({"rollout/tool_call_rate": float((calls > 0).float().mean()),
                            "rollout/tool_calls_mean": float(calls.mean()),
                            "rollout/observation_tokens": float((sampled.batch.response_mask
                                                                 - sampled.batch.loss_mask()).sum(-1).float().mean())})
        return metrics

    def log_rollouts(self, step: int, sampled: Sampled) -> None:
        """Every ``log_rollouts_every`` iterations (and the first), the first groups' samples as a table."""
        cfg = self.cfg
        if not cfg.log_rollouts_every or (step % cfg.log_rollouts_every != 0 and step != 1):
            return
        batch = sampled.batch
        rows = [{"step": step, "prompt": batch.prompts[i], "completion": batch.completions[i],
                 "reward": float(sampled.rewards[i])} for i in range(min(len(batch),
                                                                         _TABLE_GROUPS * cfg.rollout.group_size))]
        if batch.action_mask is not None:  # trajectories: their text, which tokens were the policy's, tool calls
            for row, traj in zip(rows, trajectory_rows(self.tokenizer, batch, sampled.rewards, len(rows))):
                row.update(text=traj["text"], action_mask=traj["action_mask"], tool_calls=traj["tool_calls"],
                           segments=json.dumps(traj["segments"]))
        rows = redact_secrets(rows)  # a completion can echo a secret from its prompt like any other text
        self.rollout_table += rows
        if hasattr(self.sink, "log_table"):
            self.sink.log_table(rows, "rollouts.json")

    def progress(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['rollout/reward_mean']:.3f}", "kl": f"{metrics['train/kl']:.3f}"}

    # ---- evaluation: greedy exact match (+ the reward model's score of the greedy answers) ------

    def evaluate(self, step: int) -> tuple[Any, ...]:
        started = time.perf_counter()
        metrics, samples, answers = self._evaluate(step)
        log.info("rl: evaluation at iteration %d took %.1f s", step, time.perf_counter() - started)
        return metrics, samples, answers

    def _evaluate(self, step: int) -> tuple[Any, ...]:
        cfg = self.cfg
        result = evaluate_exact_match(self.learner.view(), self.tokenizer, cfg.eval_file, **eval_options(cfg),
                                      max_items=cfg.eval_items,
                                      max_new_tokens=cfg.rollout.max_new_tokens, n_samples=cfg.eval_items)
        metrics = result.metrics("eval")
        samples = result.samples[:_EVAL_SAMPLES]
        if self.make_env is not None:  # greedy multi-turn answers with the environment's tool
            reward_fn = (load_function(cfg.reward.function)[2] if self.kind is RewardKind.FUNCTION
                         else self.reward_source)
            tool_metrics, trajectories = evaluate_with_environment(
                self.learner.view(), self.tokenizer, cfg.eval_file, self.make_env, reward_fn,
                max_items=cfg.eval_items, max_turns=cfg.environment.max_turns,
                max_trajectory_tokens=cfg.environment.max_trajectory_tokens,
                max_new_tokens=cfg.rollout.max_new_tokens, prompt_field=cfg.prompt_field, label_field=cfg.label_field,
                tool_messages=cfg.environment.tool_messages)
            metrics.update({k: v for k, v in tool_metrics.items() if k != "eval/n_items"})
            samples = [{k: str(v) for k, v in t.items()} for t in trajectories]
        if self.kind is RewardKind.MODEL:
            # how much the reward model likes the policy's answers: rises with reward hacking as well
            # as with real progress, so read it next to eval/accuracy
            rm = self.reward_source([s["prompt"] for s in result.samples], [s["completion"] for s in result.samples],
                                    [s.get("label") for s in result.samples])  # None: unlabelled eval items
            metrics["eval/reward_model_score"] = mean_or_nan(rm)
        if step == 0:  # the eval before training: the run's starting point
            self.summary.update({f"{k}_start": v for k, v in metrics.items()
                                 if k in ("eval/accuracy", "eval/accuracy_stderr", "eval/reward_model_score")
                                 or k.endswith(("_tool", "_tool_stderr")) or k.startswith("eval/tool_call")})
        # every single-turn greedy answer too: the stage's guard probe reuses them
        return metrics, samples, None if result.answers is None else result.answers.to_dict()

    # ---- checkpoints: the policy as an HF directory, everything else in trainer_state.pt --------

    def checkpoint(self) -> tuple[Any, Any, dict[str, Any]]:
        """Asynchronous: the batch in flight is waited for and stored (the sampler's state then includes its
        prompts), and the next launch pushes weights: a resume (whose engine restarts from these weights)
        then samples every later batch from the same weights as the uninterrupted run."""
        pending = {}
        if self.pending is not None:
            pending["rollout"] = self.pending.result().state_dict()
            self.sync_due = True
        return self.learner.view(), self.tokenizer, {
            **self.learner.state_dict(),
            "objects": {key: obj.state_dict() for key, obj in self.resumables.items()},
            "loop": {"summary": self.summary, "step_metrics": self.step_metrics, "rollout_table": self.rollout_table,
                     "rendered_examples": self.rendered_examples},
            **({"async": pending} if pending else {})}

    def restore(self, ckpt: Checkpoint) -> None:
        """The learner (policy, optimizers, schedules, critic), sampler, KL controller and update order."""
        self.learner.load_state_dict(ckpt.state, read_weights(ckpt.path))
        for key, obj in self.resumables.items():
            if key not in ckpt.state["objects"]:
                raise ValueError(f"{ckpt.path}: checkpoint has no {key} state")
            obj.load_state_dict(ckpt.state["objects"][key])
        self.sync_weights()  # an engine of its own (vLLM, asynchronous) samples from the restored weights
        self.engine_version, self.sync_due = ckpt.step, bool(self.cfg.off_policy.max_staleness)
        if "rollout" in ckpt.state.get("async", {}):  # the batch that was in flight, as it was generated
            self.pending = Future()
            self.pending.set_result(Rollout.from_state(ckpt.state["async"]["rollout"]))
        loop_state = ckpt.state["loop"]
        self.summary, self.step_metrics = dict(loop_state["summary"]), dict(loop_state["step_metrics"])
        self.rollout_table = list(loop_state["rollout_table"])
        self.rendered_examples = list(loop_state.get("rendered_examples", []))  # absent from older checkpoints

    def storage_needs(self) -> Any:
        """The loop's disk preflight: the policy's size (and a critic of its shape in each checkpoint)."""
        masters = Precision.resolve(self.cfg.precision, self.device).keeps_masters(self.cfg.parallel)
        checkpoint, output = estimate_state_bytes(self.learner.view(), masters=masters)
        return StorageNeeds(Path(self.cfg.output_dir), checkpoint * (2 if self.estimator.needs_critic else 1), output)

    def close(self) -> None:
        """Stop the rollout thread (after the batch in flight, if any)."""
        if self.rollout_thread is not None:
            self.rollout_thread.shutdown(wait=True)

    def save_final(self) -> None:
        # under mixed precision the fp32 masters are the trained weights: they are what is saved
        started = time.perf_counter()
        self.learner.masters_into_model()
        save_hf_dir(merged_model(self.learner.view()), self.tokenizer, self.cfg.output_dir,
                    extra={"stage": "rl", "config": redact_secrets(config_to_dict(self.cfg)),
                           "base_model": str(self.cfg.model_path)})
        log.info("rl: final model saved in %.1f s", time.perf_counter() - started)
