"""The model-holding roles of online RL: the policy learner (policy + critic) and the reference scorer.

:func:`rlhf_core.trainers.rl.train_rl` is the single controller: it samples, scores and
computes advantages, and asks these roles for forward passes (:mod:`rlhf_core.trainers.rl_forward`) and
updates. In one process
the roles are plain objects; under Ray (:mod:`rlhf_core.trainers.ray_launcher`) each runs in actors,
the learner as N data-parallel ranks, and the controller talks to them through proxies with
the same methods (:mod:`rlhf_core.trainers.rl_on_ray`). Only torch and transformers here.

Data parallelism (Sec. "Global-batch semantics" of :mod:`rlhf_core.distributed.parallel`): every rank gets
the whole experience and the same shuffled row order, and takes rows ``rank::N`` of each
mini-batch. Its aggregated loss ``L_r`` over ``u_r`` units (tokens or sequences, see
:func:`rlhf_core.algorithms.rl_math.aggregation_units`) enters backward as ``L_r * u_r / sum_r u_r``, so the
summed gradient is the one-worker gradient of the whole mini-batch.
"""

from __future__ import annotations

import functools
import logging
from contextlib import nullcontext
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from rlhf_core.common.faults import inject_fault
from rlhf_core.config import RLConfig
from rlhf_core.models.lm_head import prepare_kernels
from rlhf_core.models.loading import adapter_parameters, adapters_off, export_state_dict, has_lora, load_causal_lm, \
    pick_device, prepare_for_training, resolve_checkpointing
from rlhf_core.distributed.parallel import (LocalStrategy, World, current_world, disable_dropout, resident_weight_bytes,
                                            train_mode)
from rlhf_core.distributed.strategies import build_strategy, shard_frozen
from rlhf_core.models.parity import make_batch_invariant
from rlhf_core.models.precision import Precision
from rlhf_core.algorithms.rl_math import (AdvantageEstimator, LossAggregation, PolicyObjective, aggregate_loss,
                               clipped_value_loss, kl_penalty, masked_mean, policy_loss)
from rlhf_core.rewards.model import load_reward_model
from rlhf_core.trainers.rl_forward import (Sharded, in_chunks, micro_batches, release_memory, resolve_packing, sharded,
                                           to, token_logprobs, token_values)
from rlhf_core.trainers.step import accumulate_and_step, build_optimizer, build_scheduler
from rlhf_core.distributed.weight_sync import Layout, SyncGroup, TensorSpec, flatten_bucket, plan_layout

log = logging.getLogger(__name__)

# Log-ratios to the reference are clamped before k3's exp (verl's bound): one token the policy
# has nearly abandoned must not turn the KL term into inf.
KL_CLAMP = 20.0
SEEN_KEYS = ("policy_loss", "clip_frac", "approx_kl", "entropy", "kl_loss", "value_loss", "value_clip_frac",
             "grad_norm")


# --------------------------------------------------------------------------------------
# Reference: frozen log-probs
# --------------------------------------------------------------------------------------


class ReferenceScorer:
    """A frozen model's log-probs of rows ``rank::N`` of an experience: the reference policy of the KL term or, given
    ``model_path`` (``cfg.distill.teacher_model_path``), the teacher of on-policy distillation."""

    def __init__(self, cfg: RLConfig, device: torch.device | None = None, world: World | None = None,
                 model_path: str | None = None):
        self.cfg, self.device, self.world = cfg, device or pick_device(), world or current_world()
        # frozen: held in the trained policy's compute dtype (bf16 under mixed and bf16), no masters
        dtype = Precision.resolve(cfg.precision, self.device).weight_dtype
        self.model = load_causal_lm(model_path or cfg.ref_model_path or cfg.model_path, self.device, dtype,
                                    cfg.attention)
        self.model.eval().requires_grad_(False)
        self.head = prepare_kernels(cfg, self.model)
        self.packing = resolve_packing(cfg.packing, self.model)
        whole = resident_weight_bytes(self.model)
        model = self.model
        if reference_sharded(cfg):  # a ZeRO-3 partition, as the policy's (the launcher formed this group's world)
            self.model = shard_frozen(model, cfg.parallel, self.world)
        self.sharded = self.model is not model  # one process: nothing to partition over
        log.info("rl: %s holds %.1f MB of its %.1f MB of weights on rank %d of %d", "teacher" if model_path else
                 "reference", resident_weight_bytes(self.model) / 2**20, whole / 2**20, self.world.rank, self.world.size)

    def resident_bytes(self) -> int:
        """Bytes of weights this rank holds (its partition under ZeRO-3)."""
        return resident_weight_bytes(self.model)

    def logprobs(self, exp: dict[str, torch.Tensor], prompt_width: int) -> torch.Tensor:
        """``(my_rows, R)`` log-probs of this rank's rows (``log_softmax(logits / T)``, as the policy's)."""
        exp = to(exp, self.device)
        shard = sharded(self.world, exp, prompt_width, self.cfg.batch_size, self.model, self.head)
        packed = self.packing
        out = in_chunks(lambda e, p: token_logprobs(self.model, e, p, self.cfg.rollout.temperature,
                                                    share_prompts=not packed,
                                                 head=self.head, packed=packed)[0],
                        exp, prompt_width, shard.rows.to(self.device), shard.n_chunks)
        if self.sharded:  # layers ZeRO-3's prefetcher gathered ahead stay whole until released: back before the update
            self.model.optimizer.empty_partition_cache()
        release_memory()
        return out.cpu()


def reference_sharded(cfg: RLConfig) -> bool:
    """Whether the reference and teacher ranks partition their frozen weights (``rl.distribution.shard_reference``): Ray
    ranks under ZeRO-3, more than one. Their actors then form a torch.distributed world of their own."""
    return (cfg.distribution.shard_reference and cfg.parallel == "zero3" and cfg.distribution.placement != "none"
            and cfg.num_workers > 1)


def base_is_reference(cfg: RLConfig) -> bool:
    """Whether the reference is the LoRA policy's own base: adapters on every linear layer of ``model_path``,
    which stays frozen, and no other reference named. Then :class:`BaseReference` scores with the adapters
    switched off and no reference model is loaded (a whole model's memory on each rank: 65 GB at 32B)."""
    return cfg.lora_rank > 0 and cfg.ref_model_path in ("", cfg.model_path)


class BaseReference:
    """The reference of a LoRA run that starts from ``model_path`` (:func:`base_is_reference`): the learner's
    (or, under Ray, the learner ranks') :meth:`PolicyLearner.reference_logprobs`, with the
    :class:`ReferenceScorer` method the controller calls."""

    def __init__(self, learner: Any):
        self.learner = learner

    def logprobs(self, exp: dict[str, torch.Tensor], prompt_width: int) -> torch.Tensor:
        return self.learner.reference_logprobs(exp, prompt_width)


# --------------------------------------------------------------------------------------
# Policy learner: policy (+ critic for gae), optimizers, schedules, the PPO update
# --------------------------------------------------------------------------------------


def _step_diagnostics(share: float, weighted: tuple[torch.Tensor, ...], m: dict[str, torch.Tensor],
                      fused_old_logp: torch.Tensor | None, n_seq: float, n_tok: float) -> torch.Tensor:
    """``(8,)`` float64, on the device: one micro-batch's share of the update's diagnostics (``weighted``: loss,
    pg, kl_loss, clip_frac, approx_kl, entropy, each times ``share``), then, where pi_old is the update's own
    log-prob (``fused_old_logp``), what the controller logs from pi_old when it computes it itself: the
    per-sequence k3 KL to the reference (summed over the mini-batch's ``n_seq`` rows) and the mean engine/learner
    log-prob mismatch over its ``n_tok`` tokens. No value is read on the host here.

    train/kl is uncapped (no kl_k3_cap), as the controller's: it measures the drift, including the tokens the
    cap stops pulling back, the same whatever the penalty's settings, and the adaptive KL controller must see
    it whole."""
    values = [v.detach().to(torch.float64).reshape(()) * share for v in weighted]
    device = values[0].device
    if fused_old_logp is None:
        values += [torch.zeros((), dtype=torch.float64, device=device)] * 2
    else:
        seq_kl = (kl_penalty(fused_old_logp, m["ref_logp"], "k3", clamp=KL_CLAMP) * m["mask"]).sum(-1)
        mismatch = ((m["sampling_logp"] - fused_old_logp).abs() * m["mask"]).sum()
        values += [seq_kl.sum().to(torch.float64) / n_seq, mismatch.to(torch.float64) / max(n_tok, 1.0)]
    return torch.stack([v.to(device) for v in values])


class PolicyLearner:
    """The trained policy (and the critic, for ``gae``) with their optimizers; one data-parallel rank."""

    def __init__(self, cfg: RLConfig, device: torch.device | None = None, world: World | None = None):
        self.cfg, self.device, self.world = cfg, device or pick_device(), world or current_world()
        self.precision = Precision.resolve(cfg.precision, self.device)
        self.aggregation = LossAggregation(cfg.algorithm.loss_aggregation)
        self.objective = PolicyObjective(cfg.algorithm.policy_objective)
        # Each objective's own bounds: GSPO's sequence ratio has its own (paper-scale) pair; CISPO caps its
        # weight at 1 + clip_high with no lower bound (MiniMax-M1 Sec. 3.1).
        self.clip = {PolicyObjective.PPO_CLIP: (cfg.algorithm.clip_low, cfg.algorithm.clip_high),
                     PolicyObjective.GSPO: (cfg.algorithm.gspo_clip_low, cfg.algorithm.gspo_clip_high),
                     PolicyObjective.CISPO: (None, cfg.algorithm.clip_high)}[self.objective]
        # Dropout stays off (and eval mode, gradients still flow): the update must score tokens
        # with the same function that sampled them, or the importance ratios are noise.
        self.policy = load_causal_lm(cfg.model_path, self.device, self.precision.load_dtype, cfg.attention).eval()
        disable_dropout(self.policy)
        self.head = prepare_kernels(cfg, self.policy)
        self.packing = resolve_packing(cfg.packing, self.policy)
        log.info("rl: packing %s%s", "on" if self.packing else "off",
                 " (auto: varlen attention)" if cfg.packing == "auto" and self.packing else
                 " (auto: no varlen attention here)" if cfg.packing == "auto" else "")
        # gradient_checkpointing auto: from the update's largest micro-batch (rows x max_length)
        rows = cfg.micro_batch_size or -(-cfg.algorithm.mini_batch_size // self.world.size)
        self.checkpointing, why = resolve_checkpointing(cfg.gradient_checkpointing, self.policy,
                                                        rows * cfg.max_length,
                                                        self.precision.value)
        log.info("rl: %s", why)
        prepare_for_training(self.policy, gradient_checkpointing=self.checkpointing, lora_rank=cfg.lora_rank,
                             lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout)
        if cfg.rollout.parity:  # after the adapters exist: they are linear layers too
            make_batch_invariant(self.policy, cfg.max_length)
            self.packing = False
        # under mixed/bf16 this casts the policy to bf16 (after taking the fp32 masters from it)
        self.optimizer = build_optimizer(self.policy, cfg.lr, cfg.weight_decay, self.precision, parallel=cfg.parallel,
                                         distributed=self.world.distributed)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        # Micro-batches per mini-batch on each rank (the same count on every rank and mini-batch: DeepSpeed
        # counts accumulation steps itself).
        share = -(-cfg.algorithm.mini_batch_size // self.world.size)
        self.micro_batches = -(-share // cfg.micro_batch_size) if cfg.micro_batch_size else 1
        # The schedule is stepped here once per iteration (end_iteration), not by DeepSpeed per optimizer step.
        self.strategy = build_strategy(cfg.parallel, self.policy, self.optimizer, None, self.world,
                                       grad_accum=self.micro_batches, max_grad_norm=cfg.max_grad_norm,
                                       offload_optimizer=cfg.offload_optimizer, precision=self.precision)
        # Prompts shared across a group (token_logprobs' prefix tree) on a plain model. Under DDP or DeepSpeed
        # it would also be one forward call a chunk on every rank (a tree, or the padded rows where no prompt
        # repeats), but it has not run there: those keep the padded rows. It needs no KV cache, so gradient
        # checkpointing keeps it.
        local = type(self.strategy) is LocalStrategy  # DDPStrategy subclasses it
        self.share_prompts = local and not cfg.rollout.parity  # parity: the padded rows, as the engine saw them
        self.critic = self.critic_opt = self.critic_sched = self.critic_strategy = None
        if AdvantageEstimator(cfg.algorithm.estimator).needs_critic:
            self.critic = load_reward_model(cfg.critic_model_path or cfg.model_path, self.device,
                                            self.precision.load_dtype, cfg.attention).eval()
            disable_dropout(self.critic)
            prepare_for_training(self.critic, gradient_checkpointing=self.checkpointing)
            # the critic's gradients are summed by hand after backward (below): no fp32 hooks when distributed
            self.critic_opt = build_optimizer(self.critic, cfg.algorithm.critic_lr, cfg.weight_decay, self.precision,
                                              distributed=self.world.distributed)
            self.critic_sched = build_scheduler(self.critic_opt, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
            # The critic is called through its submodules (backbone, then the score head on every
            # position), which DDP's forward hook would miss: it stays a plain replica on each rank
            # and its gradients are summed by hand. Its schedule, like the policy's, advances in end_iteration.
            self.critic_strategy = build_strategy("ddp", self.critic, self.critic_opt, None, World())

    # ---- old log-probs and values (no grad) --------------------------------------------------

    def score(self, exp: dict[str, torch.Tensor], prompt_width: int) -> dict[str, torch.Tensor]:
        """``old_logp`` (and ``old_values`` with a critic) of this rank's rows, each ``(my_rows, R)``."""
        exp = to(exp, self.device)
        shard = sharded(self.world, exp, prompt_width, self.cfg.batch_size, self.policy, self.head)
        rows = shard.rows.to(self.device)
        out = {"old_logp": self._chunked_logprobs(exp, prompt_width, shard).cpu()}
        if self.critic is not None:
            out["old_values"] = in_chunks(lambda e, p: token_values(self.critic, e, p), exp, prompt_width, rows,
                                          shard.n_chunks).cpu()
        release_memory()
        return out

    def reference_logprobs(self, exp: dict[str, torch.Tensor], prompt_width: int) -> torch.Tensor:
        """``(my_rows, R)`` log-probs of this rank's rows under the policy's frozen base, its LoRA adapters
        switched off: the reference of a LoRA run whose reference is its starting model (:func:`base_is_reference`),
        with no second copy of the weights. Every rank takes part (ZeRO-3 gathers in each forward)."""
        exp = to(exp, self.device)
        shard = sharded(self.world, exp, prompt_width, self.cfg.batch_size, self.policy, self.head)
        with adapters_off(self.policy):  # the object the strategy wraps
            out = self._chunked_logprobs(exp, prompt_width, shard)
        release_memory()
        return out.cpu()

    def _chunked_logprobs(self, exp: dict[str, torch.Tensor], prompt_width: int, shard: Sharded) -> torch.Tensor:
        """``(my_rows, R)`` the policy's log-probs of this rank's rows, no gradient, in ``shard``'s chunks."""
        return in_chunks(
            lambda e, p: token_logprobs(self.strategy.module, e, p, self.cfg.rollout.temperature, head=self.head,
                                        share_prompts=self.share_prompts, packed=self.packing,
                                        parity=self.cfg.rollout.parity)[0],
            exp, prompt_width, shard.rows.to(self.device), shard.n_chunks)

    # ---- update: ppo_epochs x mini-batches of the policy (and critic) ------------------------

    def update(self, exp: dict[str, torch.Tensor], prompt_width: int, orders: list[torch.Tensor], kl_coef: float,
               step: int) -> dict[str, list[float]]:
        """One pass per tensor in ``orders`` (a row permutation per PPO epoch) of mini-batch updates.

        ``exp`` holds every row's ``input_ids``, ``attention_mask``, ``position_ids``, ``response_ids``,
        ``mask``, ``old_logp``, ``ref_logp``, ``advantages`` (and ``old_values``, ``returns`` with a
        critic), each ``(rows, ...)``. Returns per-optimizer-step diagnostics, identical on every rank.

        Without ``old_logp`` (one update per batch: the controller skipped :meth:`score`), pi_old is
        the update's own log-prob, detached: the weights have not moved since sampling, so it is the
        same quantity without a second forward pass (TRL does the same with ``num_iterations=1``).
        ``exp`` then carries ``sampling_logp``, and the diagnostics add ``seq_kl`` (per-sequence k3
        KL(pi_old || pi_ref)) and ``logprob_mismatch`` that the controller would have computed.
        """
        inject_fault("rl-learner", step, rank=lambda: current_world().rank)  # test hook: a learner rank dies as iteration ``step`` updates
        cfg, world = self.cfg, self.world
        exp = to(exp, self.device)
        seen: dict[str, list[float]] = {k: [] for k in SEEN_KEYS}
        checkpointing = train_mode(self.policy) if self.checkpointing else nullcontext()
        with checkpointing:
            for order in orders:
                for start in range(0, len(order), cfg.algorithm.mini_batch_size):
                    mb_rows = order[start:start + cfg.algorithm.mini_batch_size]
                    index = mb_rows[world.rows(len(mb_rows))]  # one copy, not one a key; pinned: no wait
                    index = (index.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda"
                             else index.to(self.device))
                    mb = {k: v[index] for k, v in exp.items()}
                    self._policy_step(mb, prompt_width, kl_coef, step, seen)
                    if self.critic is not None:
                        self._critic_step(mb, prompt_width, step, seen)
        release_memory()
        return seen

    def _policy_step(self, mb: dict[str, torch.Tensor], prompt_width: int, kl_coef: float, step: int,
                     seen: dict[str, list[float]]) -> None:
        cfg = self.cfg
        # Each micro-batch's loss L_m over u_m units enters backward as L_m * u_m / U, U the units of the
        # whole mini-batch over all ranks: the accumulated gradient is the one-pass gradient.
        micro, packed, units, n_tok = micro_batches(self.strategy.module, mb, prompt_width, self.micro_batches,
                                                    self.aggregation, self.packing)
        total_units, n_seq, n_tok = self.world.all_reduce_sum([sum(units), float(len(mb["mask"])), n_tok])
        # loss, pg, kl_loss, clip_frac, approx_kl, entropy, seq_kl, mismatch: summed on the device and read once
        # with the losses and the norm, after the last micro-batch, so no micro-batch waits for the device
        loss_fn = functools.partial(self._policy_loss, kl_coef=kl_coef, total_units=max(total_units, 1.0),
                                    n_seq=n_seq, n_tok=n_tok)
        # the strategy has no schedule: it advances once per iteration (end_iteration)
        stats = accumulate_and_step(self.strategy, list(zip(micro, packed, units)), loss_fn,
                                    max_grad_norm=cfg.max_grad_norm, units_fn=None, world=self.world,
                                    where=f"rl: iteration {step}", names=("policy loss", "policy gradient norm"))
        sums = stats.diagnostics
        seen["grad_norm"].append(stats.grad_norm)
        seen["policy_loss"].append(sums[1])
        if not cfg.kl.in_reward and kl_coef > 0:
            seen["kl_loss"].append(sums[2])
        seen["clip_frac"].append(sums[3])
        seen["approx_kl"].append(sums[4])
        seen["entropy"].append(sums[5])
        if "old_logp" not in mb:
            seen.setdefault("seq_kl", []).append(sums[6])
            seen.setdefault("logprob_mismatch", []).append(sums[7])

    def _policy_loss(self, model: Any, part: tuple[tuple[dict[str, torch.Tensor], int], Any, float], *, kl_coef: float,
                     total_units: float, n_seq: float, n_tok: float) -> tuple[torch.Tensor, float, torch.Tensor]:
        """One micro-batch ``part`` (rows, prompt width, packing, units): its loss times its share of the
        mini-batch's units over all ranks, the units, and its share of the diagnostics (:func:`_step_diagnostics`)."""
        cfg, agg = self.cfg, self.aggregation
        (m, width), packed, units = part
        fused_old = "old_logp" not in m
        logp, entropy = token_logprobs(model, m, width, cfg.rollout.temperature, with_entropy=True,
                                       entropy_grad=cfg.algorithm.entropy_coef != 0, share_prompts=self.share_prompts,
                                       head=self.head, packed=packed, parity=cfg.rollout.parity)
        old_logp = logp.detach() * m["mask"] if fused_old else m["old_logp"]
        pg_loss, stats = policy_loss(self.objective, logp, old_logp, m["advantages"], m["mask"],
                                     clip_low=self.clip[0], clip_high=self.clip[1], dual_clip=cfg.algorithm.dual_clip
                                     or None,
                                     aggregation=agg, max_len=cfg.rollout.max_new_tokens)
        loss = pg_loss
        if cfg.algorithm.entropy_coef:
            loss = loss - cfg.algorithm.entropy_coef * aggregate_loss(entropy, m["mask"], agg,
                                                                      cfg.rollout.max_new_tokens)
        kl_loss = torch.zeros(())
        if not cfg.kl.in_reward and kl_coef > 0:  # GRPO, Eq. 3: + beta * KL(pi || pi_ref)
            kl_loss = aggregate_loss(kl_penalty(logp, m["ref_logp"], cfg.kl.estimator, clamp=KL_CLAMP,
                                                k3_cap=cfg.kl.k3_cap or None),
                                     m["mask"], agg, cfg.rollout.max_new_tokens)
            loss = loss + kl_coef * kl_loss
        share = units / total_units
        diagnostics = _step_diagnostics(share, (loss, pg_loss, kl_loss, stats.clip_frac, stats.approx_kl,
                                                masked_mean(entropy.detach(), m["mask"])),
                                        m, old_logp if fused_old else None, n_seq, n_tok)
        return loss * share, units, diagnostics

    def _critic_step(self, mb: dict[str, torch.Tensor], prompt_width: int, step: int,
                     seen: dict[str, list[float]]) -> None:
        # The norm is taken even with clipping off (max_grad_norm 0 clips at inf, grads times 1.0): a finite
        # loss can still give an inf/NaN gradient (e.g. returns near 1e19: squares overflow fp32), and the
        # check comes before the step, so the critic's weights stay as they were.
        stats = accumulate_and_step(self.critic_strategy, [mb], functools.partial(self._critic_loss,
                                                                                 prompt_width=prompt_width),
                                    max_grad_norm=self.cfg.max_grad_norm, units_fn=None, world=self.world,
                                    before_clip=lambda: self.world.all_reduce_grads(self.critic),
                                    where=f"rl: iteration {step}", names=("value loss", "critic gradient norm"))
        seen["value_loss"].append(stats.diagnostics[0])
        seen["value_clip_frac"].append(stats.diagnostics[1])

    def _critic_loss(self, model: Any, mb: dict[str, torch.Tensor],
                     prompt_width: int) -> tuple[torch.Tensor, float, torch.Tensor]:
        """The mini-batch's value loss (times ``vf_coef``) times this rank's share of its tokens over all ranks,
        the tokens, and the share of the value loss and clip fraction."""
        cfg = self.cfg
        values = token_values(model, mb, prompt_width)
        value_loss, value_clip_frac = clipped_value_loss(values, mb["old_values"], mb["returns"], mb["mask"],
                                                         clip_eps=cfg.algorithm.value_clip or None)
        units = float(mb["mask"].sum())  # the value loss is a token mean
        share = units / max(self.world.all_reduce_sum([units])[0], 1.0)
        diagnostics = torch.stack([value_loss.detach().to(torch.float64) * share,
                                   value_clip_frac.detach().to(torch.float64) * share])
        return cfg.algorithm.vf_coef * value_loss * share, units, diagnostics

    def end_iteration(self) -> float:
        """Advance the schedules once (one per iteration); returns the policy lr the iteration used."""
        lr_used = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if self.critic_sched is not None:
            self.critic_sched.step()
        return lr_used

    # ---- weights and checkpoints -------------------------------------------------------------

    def engine_weights(self, engine: Any = None, dtype: torch.dtype | None = None, adapters_only: bool = False) -> Any:
        """What a rollout engine's ``update_weights`` takes: the policy itself, or its (merged LoRA) weights
        on the CPU, cast to ``dtype`` when given; ``adapters_only`` (a LoRA policy, for replicas that hold the
        same frozen base with adapters of their own): the adapter tensors alone, in their own dtype, a few MB
        where the merged weights are the whole model (a 32B policy: ~0.3 GB of r-16 adapters against 65.5 GB). An
        engine that serves adapters itself (``takes_adapters``: vLLM started with the policy's LoRA rank) gets them
        alone too."""
        if engine is not None and getattr(engine, "model", None) is self.policy:
            return self.policy  # the HF engine holds this very model (adapters and all)
        adapters_only = adapters_only or bool(getattr(engine, "takes_adapters", False))
        adapters = adapter_parameters(self.policy) if adapters_only else None
        if adapters_only and not adapters:
            raise ValueError("engine_weights: adapters_only, but the policy carries no LoRA adapters")
        # every rank takes part (ZeRO-3 gathers: everything, or the adapters alone); rank 0 answers
        with self.strategy.gathered(list(adapters.values()) if adapters else None):
            if not self.world.is_main:
                return None
            on_cpu = next(self.policy.parameters()).device.type == "cpu"
            if adapters:  # in their own dtype
                return {k: _cpu_copy(v.detach(), on_cpu) for k, v in adapters.items()}
            weights = export_state_dict(self.policy) if has_lora(self.policy) else self.policy.state_dict()
            return {k: _cpu_copy(v.detach().to(dtype or v.dtype), on_cpu) for k, v in weights.items()}

    def base_dtype(self) -> str:
        """The dtype of the policy's frozen (non-adapter) weights, e.g. ``"bfloat16"``: what the controller's copy
        of a LoRA policy's base is held in (:class:`rlhf_core.trainers.rl_on_ray.RemoteLearner`)."""
        frozen = next((p for n, p in self.policy.named_parameters() if "lora_" not in n), None)
        return str((frozen if frozen is not None else next(self.policy.parameters())).dtype).removeprefix("torch.")

    def share_weights(self, dtype: torch.dtype | None = None) -> dict[str, Any] | None:
        """This rank's policy weights in one flat GPU buffer, as a CUDA IPC handle; ``None`` where that cannot work.

        For a rollout engine on the *same GPU* in another process (colocated Ray placement): it
        maps the buffer once and copies from it on each sync, GPU to GPU, instead of the weights
        travelling through host memory and Ray's object store (measured 2.9-3.7 s per sync for
        0.4B weights on H100s; bench/results/h100x2/*/gpu_grpo_h100x2_*). Needs whole weights on this
        rank (DDP or ZeRO-2, not ZeRO-3) and no LoRA adapters (those need merging first). The
        buffer is refilled in place, so the handle stays valid for the whole run.
        """
        if self.device.type != "cuda" or has_lora(self.policy) or getattr(self.strategy, "stage", 0) == 3:
            return None

        state = self.policy.state_dict()
        if getattr(self, "_shared", None) is None:
            layout, offsets, total = [], {}, 0
            for name, t in state.items():
                key = t.data_ptr()
                if key not in offsets:  # tied weights share one slot
                    offsets[key] = total
                    total += t.numel()
                layout.append((name, tuple(t.shape), offsets[key]))
            flat = torch.empty(total, dtype=dtype or next(iter(state.values())).dtype, device=self.device)
            self._shared = (flat, layout)
        flat, layout = self._shared
        with torch.no_grad():
            for name, shape, offset in layout:
                n = state[name].numel()
                flat[offset:offset + n].copy_(state[name].reshape(-1))
        torch.cuda.synchronize(self.device)  # the reader copies after this call returns
        return {"cuda_ipc": reduce_tensor(flat), "layout": layout}

    # ---- ZeRO-3 weights to colocated rollout replicas, one bucket at a time --------------------------
    #
    # ZeRO-3 holds a quarter of each weight on each of 4 ranks, so :meth:`share_weights` cannot hand out
    # whole weights, and the fallback (rank 0 gathers everything, the weights travel as one Ray object to
    # every replica) took 92.8 s a sync for a 7B policy on 4 H100s and held a second 15 GB copy on rank 0
    # (bench/results/h100x4/*/side_by_side_h100x4_7b_grpo_diag_before_buckets.json). Instead, bucket by bucket, every
    # rank gathers
    # the bucket (NCCL, GPU to GPU) and copies it into a staging buffer on its GPU that the replica beside it
    # maps once through CUDA IPC and copies from: only one bucket is ever whole on a rank. The same scheme
    # as OpenRLHF's and verl's colocated weight updates; written here because it runs inside our two
    # actors (learner rank, replica) and the controller between them.

    def weight_buckets(self, max_bytes: int, dtype: torch.dtype | None = None) -> int:
        """Plan the buckets (parameters in order, at most ``max_bytes`` each in ``dtype``); returns their count."""
        params = dict(self.policy.named_parameters())
        layout = plan_layout([(n, tuple(getattr(p, "ds_shape", p.shape)), p.dtype) for n, p in params.items()],
                             max_bytes, dtype)  # the collective sync's planning (rlhf_core.distributed.weight_sync)
        self._buckets = [(bucket, [params[spec.name] for spec in bucket]) for bucket in layout]
        self._staging = None
        self._staging_numel = max(sum(spec.numel for spec in bucket) for bucket in layout)
        return len(self._buckets)

    def share_bucket(self, index: int, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Every rank: bucket ``index`` whole (gathered under ZeRO-3) copied into this rank's staging buffer;
        returns the buffer's CUDA IPC handle (the replica maps it once) and the bucket's layout."""
        bucket, params = self._buckets[index]
        if self._staging is None:
            self._staging = torch.empty(self._staging_numel, dtype=dtype or params[0].dtype, device=self.device)
        staged = [TensorSpec(spec.name, spec.shape, self._staging.dtype) for spec in bucket]  # one buffer, one dtype
        with torch.no_grad(), self.strategy.gathered(params):
            flatten_bucket([p.data for p in params], staged, {self._staging.dtype: self._staging})
        layout, offset = [], 0
        for spec in staged:
            layout.append((spec.name, spec.shape, offset))
            offset += spec.numel
        torch.cuda.synchronize(self.device)  # the replica copies after this call returns
        return {"cuda_ipc": reduce_tensor(self._staging), "layout": layout, "last": index == len(self._buckets) - 1}

    # ---- rl.distribution.weight_sync collective: rank 0 broadcasts to replicas on other GPUs (distributed.weight_sync)

    def sync_layout(self, max_bytes: int, dtype: torch.dtype | None = None) -> Layout:
        """Every rank: plan the collective sync's buckets (parameters in order, at most ``max_bytes`` each in
        ``dtype``, the replicas' dtype); returns the layout, the same on every rank."""
        named = list(self.policy.named_parameters())
        self._sync_params = [p for _, p in named]
        self._sync_layout = plan_layout([(n, tuple(getattr(p, "ds_shape", p.shape)), p.dtype) for n, p in named],
                                        max_bytes, dtype)
        return self._sync_layout

    def join_weight_sync(self, addr: str, port: int, size: int, timeout_s: float) -> None:
        """Rank 0 only: rank 0 of the weight-sync group (it hosts the group's store at ``addr:port``)."""
        self._sync_group = SyncGroup(addr, port, 0, size, timeout_s, self.device)
        self._sync_group.allocate(self._sync_layout)

    def broadcast_weights(self) -> None:
        """Every rank: each bucket whole (gathered under ZeRO-3, where every rank takes part), flattened into one
        buffer per dtype and broadcast by rank 0 to the replicas; the other ranks only help gather."""
        start = 0
        for bucket in self._sync_layout:
            params = self._sync_params[start:start + len(bucket)]
            start += len(bucket)
            with torch.no_grad(), self.strategy.gathered(params):
                if self.world.is_main:
                    group = self._sync_group
                    group.broadcast(flatten_bucket([p.data for p in params], bucket, group.buffers))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sync's time is its real end

    def leave_weight_sync(self) -> None:
        """Close this rank's side of the weight-sync group (once; the replicas close theirs at the same time)."""
        group, self._sync_group = getattr(self, "_sync_group", None), None
        if group is not None:
            group.close()

    def close(self) -> None:
        self.leave_weight_sync()

    def masters_into_model(self) -> None:
        """End of training: the policy holds its fp32 master weights (mixed precision) for the final save;
        every rank calls it (ZeRO gathers)."""
        self.strategy.masters_into_model()

    def state_dict(self) -> dict[str, Any] | None:
        """Optimizer, schedules and the critic (policy weights are saved beside, as safetensors); every
        rank calls it (ZeRO gathers), rank 0 answers and the others return None."""
        optimizer = self.strategy.optimizer_state()
        if not self.world.is_main:
            return None
        state = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            state.update(critic=self.critic.state_dict(), critic_optimizer=self.critic_opt.state_dict(),
                         critic_scheduler=self.critic_sched.state_dict())
        return state

    def view(self) -> Any:
        """The policy model as the controller sees it (in-process: the trained model itself)."""
        return self.policy

    def load_state_dict(self, state: dict[str, Any], policy_weights: dict[str, torch.Tensor] | None = None) -> None:
        """Optimizers, schedules and critic of a checkpoint, and the policy's weights when given (every
        rank calls it: under ZeRO the weights and optimizer state are scattered into this world's
        partitions, whatever world size wrote them)."""
        if policy_weights is not None:
            self.strategy.load_weights(policy_weights, "rl checkpoint")
        self.scheduler.load_state_dict(state["scheduler"])
        self.strategy.load_optimizer_state(state["optimizer"])
        if self.critic is not None:
            for key in ("critic", "critic_optimizer", "critic_scheduler"):
                if key not in state:
                    raise ValueError(f"checkpoint has no {key} state")
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_optimizer"])
            self.critic_sched.load_state_dict(state["critic_scheduler"])


def _cpu_copy(t: torch.Tensor, on_cpu: bool) -> torch.Tensor:
    # .cpu() of a GPU tensor is already a copy; on the CPU it would alias the live weights
    return t.clone() if on_cpu else t.cpu()


def build_roles(cfg: RLConfig, device: torch.device, learner: Any = None, reference: Any = None,
                teacher: Any = None) -> tuple[Any, Any, Any]:
    """The policy learner, its reference and (on-policy distillation) its teacher, each built unless given. A LoRA
    policy's frozen base is its reference when it started from it: no second model (:class:`BaseReference`). The
    teacher is the reference's machinery (frozen, compute dtype, same placement); ``None`` for other estimators."""
    learner = learner or PolicyLearner(cfg, device)
    reference = reference or (BaseReference(learner) if base_is_reference(cfg) else ReferenceScorer(cfg, device))
    if AdvantageEstimator(cfg.algorithm.estimator).needs_teacher:
        teacher = teacher or ReferenceScorer(cfg, device, model_path=cfg.distill.teacher_model_path)
    else:
        teacher = None
    return learner, reference, teacher
