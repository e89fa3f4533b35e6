"""Online RL's section (``rl``, ``tool_rl``): rollouts, rewards, advantage estimator, policy objective, KL,
placement under Ray; checked in one named step per concern."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import ClassVar

from rlhf_core.common.redact import redact_secrets
from rlhf_core.config.base import _check
from rlhf_core.config.choices import (AdvantageEstimator, KLEstimator, LossAggregation, PolicyObjective, RewardKind,
                                      ToolMessages, WeightSync)
from rlhf_core.config.training import TrainerConfig


@dataclass
class RLConfig(TrainerConfig):
    """``rl``: online RL from sampled rollouts: PPO (GAE + critic), REINFORCE++, RLOO, GRPO, Dr.GRPO, DAPO options."""

    section: ClassVar[str] = "rl"

    model_path: str = "models/sft"
    """Policy to start from (usually the SFT model)."""
    ref_model_path: str = ""
    """Frozen reference model of the KL term; empty means the starting policy. With lora_rank > 0 that is the
    policy's own frozen base, scored with its adapters switched off: no reference model is loaded."""
    critic_model_path: str = ""
    """Critic backbone (estimator gae only), loaded with a scalar head via load_reward_model; empty
    means model_path (the policy's backbone, fresh zero-mean head). Name the reward model
    directory to start from it instead, as OpenRLHF does."""
    teacher_model_path: str = ""
    """Frozen teacher of on-policy distillation (estimator distill, required there, unused otherwise): it scores
    the policy's sampled tokens and each token's reward is -(log pi - log pi_teacher). Same tokenizer as the
    policy (checked at load); loaded like the reference (policy's compute dtype, no gradients)."""
    distill_reward_coef: float = 0.0
    """estimator distill: weight of the sequence reward (reward_kind's) added to every token's advantage;
    0 = pure distillation (the reward is still computed and logged)."""
    train_file: str = ""
    """Unused by rl (prompts come from prompts_file); must stay empty."""
    prompts_file: str = "data/embedded/prompts.jsonl"
    """Prompts to sample from, with a label per prompt when the reward needs one."""
    packing: str | bool = "auto"
    """auto, true or false: each update micro-batch and each no-grad log-prob chunk runs as one padding-free row
    (in place of prompt sharing; its rows stay micro_batch_size rows, so micro_batch_tokens is refused). auto
    packs where the model attends with the variable-length flash kernel (a CUDA device, rlhf_core.models.attention;
    faster GRPO steps, BENCHMARKS.md "RL packing on a GPU") and pads elsewhere (a
    CPU's packed row takes a dense block-diagonal mask and is slower)."""
    output_dir: str = "models/rl"
    """Where the final policy's HF model directory is written."""
    checkpoint_dir: str = "checkpoints/rl"
    """Where periodic checkpoints (policy, critic, optimizers, KL controller, RNG) go."""
    estimator: str = "grpo"
    """Advantage estimator: gae (PPO, trains a critic), reinforce++, reinforce++-baseline, rloo, grpo, dr-grpo, or
    distill (on-policy distillation from teacher_model_path: per-token reverse-KL rewards, discount 0)."""
    reward_kind: str = "function"
    """Where rewards come from: function (a .py file), model (a reward model directory) or http."""
    reward_function: str = "rlhf_core/embedded/reward.py:reward"
    """``file.py:function`` returning one reward per (prompt, completion, label), for reward_kind function."""
    reward_model_path: str = "models/reward"
    """Reward model directory, for reward_kind model."""
    reward_url: str = ""
    """Reward server URL (e.g. from ``alignflow serve-rm``), for reward_kind http."""
    reward_timeout_s: float = 30.0
    """Seconds one request to the reward or environment server may take, connect to last byte (then retried)."""
    reward_retries: int = 3
    """Retries of a reward request that timed out or failed with a 5xx, for reward_kind http."""
    reward_backoff_cap_s: float = 30.0
    """Longest wait between reward-server retries (full-jitter exponential backoff from 1 s), for reward_kind http."""
    reward_deadline_s: float = 300.0
    """Seconds one reward call may take, all retries and waits (429 Retry-After included), for reward_kind http."""
    reward_max_response_bytes: int = 4 * 1024 * 1024
    """Largest reply body the reward or environment server may send; a larger one is refused unread."""
    reward_token_env: str = ""
    """NAME of the environment variable holding the reward server's token (sent as Authorization: Bearer); never
    the token itself, so configs, Prefect parameters and MLflow hold the name only. Empty: no token."""
    environment: str = ""
    """Multi-turn rollouts with a tool (rlhf_core/rollout/environments.py): path/to/env.py:make_env (a function returning a
    fresh environment) or an http(s):// environment server (the reward_* timeout, retry, backoff and deadline
    settings apply to it too); empty: single-turn rollouts, as without this field."""
    environment_stop_tokens: list[str] = field(default_factory=list)
    """An HTTP environment's tokens that end a model turn (e.g. a tool call's closing tag); a file environment
    names its own."""
    environment_token_env: str = ""
    """NAME of the environment variable holding the environment server's token (Authorization: Bearer)."""
    max_turns: int = 2
    """With an environment: model turns per trajectory (tool calls + the answer)."""
    max_trajectory_tokens: int = 32
    """With an environment: response tokens per trajectory, model turns and observations together
    (each turn is also capped at max_new_tokens)."""
    tool_messages: str = "auto"
    """With an environment: how an observation joins a trajectory (environments.ToolMessages): chat (a chat-template
    tool message, then the next assistant turn's generation prompt; a turn ending at eos is a step too), text (its
    text appended inside the model's turn) or auto (chat where prompts_file holds conversations and the tokenizer
    has a chat template of its own that renders tool turns, else text)."""
    rollout_engine: str = "static"
    """static (our decode loop, rlhf_core/rollout/static.py: static KV cache, prompts prefilled once per group,
    CUDA graphs on a GPU; Llama-family models, falls back to hf with a warning otherwise), hf (transformers
    generate on the policy itself) or vllm (a vLLM engine whose weights are synced after every update; falls
    back to hf, with a warning, when vLLM cannot be imported)."""
    vllm_memory_fraction: float = 0.1
    """rollout_engine vllm: fraction of GPU memory (of RAM on CPU) vLLM reserves for its KV cache."""
    placement: str = "none"
    """none (every role in this process) or, through Ray, colocated (policy, reference, reward model and
    rollout engine share each worker's bundle) or disaggregated (each role its own bundles)."""
    rollout_workers: int = 1
    """Rollout engine replicas under Ray (prompts are split across them); ignored with placement none."""
    weight_sync: str = "auto"
    """How Ray rollout replicas get the learner's weights after an update (rlhf_core/distributed/weight_sync.py): object_store
    (rank 0's weights as one Ray object to every replica; works anywhere), collective (policy rank 0 and the
    replicas in a torch.distributed group of their own, weights broadcast in 1 GiB buckets: NCCL on GPUs,
    gloo on CPUs; replicas must not share rank 0's GPU) or auto (GPUs: CUDA IPC for colocated replicas,
    collective for replicas on GPUs of their own with the hf/static engines; CPUs: object_store)."""
    shard_reference: bool = True
    """parallel zero3 on Ray: the reference (and distillation teacher) ranks partition the frozen weights as the
    policy's are, a DeepSpeed ZeRO-3 engine without an optimizer, so a GPU holds 1/num_workers of them and gathers
    each layer for its forward (a 7B reference: 3.8 GB a GPU on four instead of 15.2); false: each reference rank
    holds the whole model (no gathers, more memory)."""
    rollout_sleep: str = "auto"
    """Colocated Ray replicas free their weights' memory once a rollout is done, and the weight sync after the
    update allocates and fills them again (vLLM's sleep mode, level 2, for our engines): the reference, old
    log-prob and update phases run without the replica's copy of the policy on the GPU. on, off or auto (on with
    GPUs where it can work: colocated, synchronous, hf or static engine, whole-weight syncs, i.e. no LoRA)."""
    max_steps: int = 40
    """Rollout/update iterations (each samples prompts_per_step x group_size responses)."""
    num_threads: int = 1
    """torch intra-op threads on CPU: 1, since generation's small per-token kernels gain little from more and
    slow down badly when another process shares the cores."""
    prompts_per_step: int = 32
    """Prompts sampled per iteration (after DAPO filtering: groups kept per iteration)."""
    group_size: int = 8
    """Samples per prompt (n); group estimators (grpo, rloo, dr-grpo, reinforce++-baseline) need >= 2."""
    temperature: float = 1.0
    """Sampling temperature of rollouts; log-probs for the loss use the same logits / temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass of rollouts, in (0, 1]."""
    max_new_tokens: int = 12
    """Generation budget per response in tokens, eos included."""
    batch_size: int = 256
    """Rows per forward pass when generating and when computing log-probs and values without gradient."""
    grad_accum: int = 1
    """Unused by rl (must stay 1): one mini-batch of mini_batch_size rows is one optimizer step."""
    max_length: int = 64
    """Longest prompt + response in tokens; a prompt with max_new_tokens that would exceed it stops the run at load."""
    ppo_epochs: int = 1
    """Passes over each iteration's rollouts (PPO's K epochs)."""
    mini_batch_size: int = 128
    """Rollout rows per optimizer step (policy and critic); with prompts_per_step x group_size rows and one
    PPO epoch, one update per batch (pi_old is then the update's own detached log-prob: no extra forward)."""
    micro_batch_size: int = 0
    """Rows per forward/backward of the policy update on each rank; gradients accumulate over a mini-batch's
    micro-batches (0: a rank's whole share of the mini-batch in one pass). Bounds activation memory."""
    lr: float = 3e-4
    """Peak learning rate of the policy's AdamW."""
    critic_lr: float = 1e-3
    """Peak learning rate of the critic's AdamW (estimator gae only)."""
    warmup_steps: int = 0
    """Linear warmup, in iterations (the schedule advances once per iteration; its first iteration runs at lr 0)."""
    policy_objective: str = "ppo_clip"
    """Policy-gradient surrogate (rl_math.PolicyObjective): ppo_clip (PPO's min over token ratios clipped to
    [1 - clip_low, 1 + clip_high]), gspo (GSPO-token, Zheng et al. 2025: one length-normalised ratio per
    response, clipped to [1 - gspo_clip_low, 1 + gspo_clip_high]) or cispo (MiniMax-M1: REINFORCE weighted by
    the detached token ratio capped at 1 + clip_high, no lower bound, no token's gradient dropped)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1 (ratio >= 1 - clip_low), in [0, 1); ppo_clip only (cispo has no lower bound)."""
    clip_high: float = 0.28
    """PPO clip epsilon above 1 (ratio <= 1 + clip_high); above clip_low is DAPO's clip-higher. cispo caps its
    importance weight at 1 + clip_high (a token ratio too, so the same scale)."""
    gspo_clip_low: float = 0.0003
    """gspo: clip epsilon below 1 of the sequence ratio, in [0, 1); the paper's 3e-4. Own fields, not clip_low:
    a geometric mean over the response moves ~1000x less than a token ratio, and 0.2 would never bind."""
    gspo_clip_high: float = 0.0004
    """gspo: clip epsilon above 1 of the sequence ratio, >= 0; the paper's 4e-4."""
    dual_clip: float = 0.0
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens (Ye et al. 2020); 0 = off. Not with cispo."""
    value_clip: float = 0.2
    """Clip range of the critic's value update around its rollout-time values; 0 = plain squared error."""
    vf_coef: float = 1.0
    """Scale of the value loss (the critic has its own optimizer, so this acts through gradient clipping)."""
    gamma: float = 1.0
    """Discount of token-level returns (gae, reinforce++ variants), in [0, 1]."""
    lam: float = 0.95
    """GAE lambda, in [0, 1] (1: Monte-Carlo returns minus V)."""
    kl_coef: float = 0.1
    """beta: weight of the KL to the reference (initial value when adaptive_kl); 0 = no KL term."""
    kl_estimator: str = "k3"
    """Per-token KL estimator of the penalty: k1, k2 or k3 (k1 is the usual choice inside the reward)."""
    kl_k3_cap: float = 10.0
    """Upper bound on each token's k3 value in the penalty (verl, OpenRLHF: 10); 0 disables. Where it binds
    the token's KL gradient is zero (rl_math.kl_penalty); train/kl is logged uncapped."""
    kl_in_reward: bool = False
    """Fold -beta * KL into token rewards (PPO, REINFORCE++) instead of adding beta * KL to the loss (GRPO);
    only for gae and the reinforce++ variants."""
    adaptive_kl: bool = False
    """Adapt beta towards kl_target (Ziegler et al. 2019) instead of keeping it fixed."""
    kl_target: float = 0.1
    """Target mean per-sequence KL (nats) of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (in samples) of the adaptive controller: beta moves by at most 20% x samples / horizon per step."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus subtracted from the policy loss; 0 = off (entropy is logged either way)."""
    loss_aggregation: str = "token_mean"
    """How token losses are reduced: token_mean (DAPO), seq_mean_token_mean (GRPO) or seq_mean_token_sum_norm (Dr.GRPO)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose samples all scored the same, top up with more prompts."""
    dynamic_sampling_max_rounds: int = 3
    """Extra rollout rounds allowed per iteration to top up the kept groups (dynamic_sampling only)."""
    overlong_max_len: int = 0
    """DAPO soft overlong penalty: L_max in tokens (at most max_new_tokens); 0 = off."""
    overlong_cache_len: int = 0
    """Width in tokens of the overlong penalty's ramp from 0 to -1 (0 < cache <= overlong_max_len when on)."""
    recompute_old_logprobs: bool = True
    """Recompute old log-probs with one no-grad policy forward; false uses the engine's sampling log-probs
    (exact only when the engine samples from the trained weights with the same numerics)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (Yao et al. 2025): weight each token's policy-gradient term by
    min(pi_old / pi_engine, tis_cap) to correct for an engine (vLLM) that samples slightly off the
    trainer's policy; 0 = off, 2 is the paper's choice. Needs recompute_old_logprobs."""
    mis_threshold: float = 0.0
    """Sequence-level masked importance sampling (Seq-MIS, rl_math.sequence_is_mask): a response whose ratio
    pi_old(y) / pi_engine(y) leaves [1 / mis_threshold, mis_threshold] is masked out of the loss, whether the
    engine's numerics or its staleness (max_staleness) caused the gap; 0 = off, else > 1 (e.g. 2)."""
    max_staleness: int = 0
    """Asynchronous training: 0 = synchronous (each batch sampled from the policy it updates); k >= 1 = the next
    batch is generated while the current one updates, from a policy at most k updates old (weights are pushed
    to the engine only when the gap would exceed k). Needs recompute_old_logprobs; not with placement colocated;
    under disaggregated placement the reference runs on the policy ranks' bundles, the reward model on the replicas'."""
    eval_at_start: bool = True
    """Evaluate the starting policy before iteration 1 (the baseline of eval/accuracy)."""
    eval_items: int = 1000
    """Held-out items used for accuracy (greedy exact match)."""
    log_rollouts_every: int = 10
    """Iterations between rollout tables (step, prompt, completion, reward); 0 = never."""
    save_every: int = 20
    """Iterations between checkpoints (0: only the final model)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        estimator, kind = self._check_choices()
        self._check_inputs()
        self._check_reward(kind)
        self._check_rollout()
        # packing: each micro-batch (and no-grad chunk) runs as one padding-free row; its rows stay
        # micro_batch_size rows, so a token budget has no meaning here
        _check(self.packing in (True, False, "auto"), self.section, "packing",
               f"must be auto, true or false, got {self.packing!r}")
        _check(self.micro_batch_tokens == 0, self.section, "micro_batch_tokens",
               "not for rl: its micro-batches are micro_batch_size rows (packed into one row with packing: true)")
        self._check_batches(estimator)
        self._check_update()
        self._check_kl(estimator)
        self._check_dapo()
        self._check_distill(estimator)
        self._check_environment()

    def _check_environment(self) -> None:
        """Multi-turn rollouts: the environment's spec, turn and token limits, where it can run."""
        s = self.section
        _check(self.max_turns >= 1, s, "max_turns", f"must be >= 1, got {self.max_turns}")
        _check(self.max_trajectory_tokens >= 1, s, "max_trajectory_tokens",
               f"must be >= 1, got {self.max_trajectory_tokens}")
        if not self.environment:
            _check(not self.environment_stop_tokens, s, "environment_stop_tokens",
                   "is only used with an environment (rl.environment is empty)")
            _check(self.tool_messages == "auto", s, "tool_messages",
                   "is only used with an environment (rl.environment is empty)")
            return
        spec = self.environment
        if spec.startswith(("http://", "https://")):
            _check(bool(self.environment_stop_tokens), s, "environment_stop_tokens",
                   "an HTTP environment needs the tokens that end a model turn, e.g. ['</calc>']")
        else:
            file_part, _, func = spec.rpartition(":")
            _check(file_part.endswith(".py") and func.isidentifier(), s, "environment",
                   f"must be path/to/env.py:function or an http(s):// URL, got {spec!r}")
        _check(self.max_length >= self.max_trajectory_tokens + 1, s, "max_trajectory_tokens",
               f"must leave room for a prompt within max_length ({self.max_length}), got {self.max_trajectory_tokens}")
        _check(not self.overlong_max_len or self.overlong_max_len <= self.max_trajectory_tokens, s, "overlong_max_len",
               f"must be <= max_trajectory_tokens ({self.max_trajectory_tokens}) with an environment")

    def _check_choices(self) -> tuple[AdvantageEstimator, RewardKind]:
        """Check the enum-valued fields; return the (AdvantageEstimator, RewardKind) they name."""
        s = self.section

        def one_of(name: str, enum: type) -> None:
            values = [e.value for e in enum]
            _check(getattr(self, name) in values, s, name, f"must be one of {values}, got {getattr(self, name)!r}")

        one_of("estimator", AdvantageEstimator)
        one_of("reward_kind", RewardKind)
        one_of("kl_estimator", KLEstimator)
        one_of("loss_aggregation", LossAggregation)
        one_of("policy_objective", PolicyObjective)
        one_of("tool_messages", ToolMessages)
        return AdvantageEstimator(self.estimator), RewardKind(self.reward_kind)

    def _check_inputs(self) -> None:
        """Trainer fields rl does not use must keep their neutral values; prompts must be named."""
        s = self.section
        _check(self.train_file == "", s, "train_file", "rl reads its prompts from prompts_file; leave train_file empty")
        _check(self.grad_accum == 1, s, "grad_accum", "must be 1 (mini_batch_size rows make one optimizer step)")
        _check(bool(self.prompts_file), s, "prompts_file", "must name the prompts file")

    def _check_reward(self, kind: RewardKind) -> None:
        """The reward source ``kind`` needs its own field; HTTP limits."""
        s = self.section
        if kind is RewardKind.FUNCTION:
            _check(":" in self.reward_function, s, "reward_function",
                   f"must be 'path/to/file.py:function_name', got {self.reward_function!r}")
        elif kind is RewardKind.MODEL:
            _check(bool(self.reward_model_path), s, "reward_model_path", "must name a reward model directory")
        else:
            _check(self.reward_url.startswith(("http://", "https://")), s, "reward_url",
                   f"must start with http:// or https:// for reward_kind http, got {redact_secrets(self.reward_url)!r}")
        _check(self.reward_timeout_s > 0, s, "reward_timeout_s", f"must be > 0, got {self.reward_timeout_s}")
        _check(self.reward_retries >= 0, s, "reward_retries", f"must be >= 0, got {self.reward_retries}")
        _check(self.reward_backoff_cap_s >= 0, s, "reward_backoff_cap_s", f"must be >= 0, got {self.reward_backoff_cap_s}")
        _check(self.reward_deadline_s > 0, s, "reward_deadline_s", f"must be > 0, got {self.reward_deadline_s}")
        _check(self.reward_max_response_bytes > 0, s, "reward_max_response_bytes",
               f"must be > 0, got {self.reward_max_response_bytes}")
        self._check_token_env(kind)

    def _check_token_env(self, kind: RewardKind) -> None:
        """reward_token_env must be a variable's name, set now (checked at load: fail before hours of training)."""
        name, s = self.reward_token_env, self.section
        if not name or kind is not RewardKind.HTTP:
            return
        # Never quote a value that is not a name: it may be the token itself, pasted in by mistake.
        _check(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None, s, "reward_token_env",
               "must be the NAME of an environment variable holding the token (letters, digits, _), not the token")
        _check(bool(os.environ.get(name)), s, "reward_token_env",
               f"environment variable {name} is not set (or is empty); export the reward server's token under it")
        _check("@" not in self.reward_url.split("/")[2], s, "reward_token_env",
               "is set, and reward_url also carries user:pass@ credentials; use one (only the token would be sent)")

    def _check_rollout(self) -> None:
        """Rollout engine, its off-policy correction, and where roles and workers run."""
        s = self.section
        _check(self.tis_cap >= 0, s, "tis_cap", f"must be >= 0 (0 = off), got {self.tis_cap}")
        _check(self.tis_cap == 0 or self.recompute_old_logprobs, s, "tis_cap",
               "needs recompute_old_logprobs: true (without it pi_old is the engine's own log-prob)")
        self._check_async()
        _check(self.rollout_engine in ("hf", "static", "vllm"), s, "rollout_engine",
               f"must be hf, static or vllm, got {self.rollout_engine!r}")
        _check(0 < self.vllm_memory_fraction <= 1, s, "vllm_memory_fraction",
               f"must be in (0, 1], got {self.vllm_memory_fraction}")
        _check(self.placement in ("none", "colocated", "disaggregated"), s, "placement",
               f"must be none, colocated or disaggregated, got {self.placement!r}")
        _check(self.rollout_workers >= 1, s, "rollout_workers", f"must be >= 1, got {self.rollout_workers}")
        _check(self.num_workers == 1 or self.placement != "none", s, "num_workers",
               f"{self.num_workers} policy workers need Ray: set placement to colocated or disaggregated")
        # without Ray the engine samples from this process's policy, whose weights ZeRO-3 holds as empty
        # placeholders outside a forward (the static engine would read them directly: a size-0 reshape)
        _check(self.parallel != "zero3" or self.placement != "none", s, "parallel",
               "zero3 partitions the policy's weights, and with placement none the rollout engine samples from them "
               "in this process; set placement colocated (Ray replicas take whole weights at each sync, also on one "
               "GPU) or parallel zero2")
        self._check_weight_sync()
        self._check_rollout_sleep()

    def _check_rollout_sleep(self) -> None:
        """rl.rollout_sleep: on only where every rollout is followed by a sync of the whole weights."""
        s = self.section
        _check(self.rollout_sleep in ("auto", "on", "off"), s, "rollout_sleep",
               f"must be auto, on or off, got {self.rollout_sleep!r}")
        if self.rollout_sleep != "on":
            return
        _check(self.placement == "colocated", s, "rollout_sleep",
               f"on frees colocated Ray replicas' weights between phases; placement is {self.placement!r} "
               f"(set placement colocated, or rollout_sleep auto)")
        _check(self.rollout_engine in ("hf", "static"), s, "rollout_sleep",
               f"on needs the hf or static engine (vLLM has a sleep mode of its own), got {self.rollout_engine!r}")
        _check(not self.lora_rank, s, "rollout_sleep",
               "on needs a sync of the whole weights after each update, and a LoRA policy's replicas keep the "
               "frozen base and take the adapters alone; use rollout_sleep auto or off")

    def _check_weight_sync(self) -> None:
        """rl.weight_sync: a known path, and collective only where it can work."""
        s, values = self.section, [e.value for e in WeightSync]
        _check(self.weight_sync in values, s, "weight_sync", f"must be one of {values}, got {self.weight_sync!r}")
        if self.weight_sync != WeightSync.COLLECTIVE.value:
            return
        _check(self.placement != "none", s, "weight_sync",
               "collective broadcasts to Ray rollout replicas; with placement none the engine samples from the "
               "trained policy in this process (set placement disaggregated, or weight_sync auto)")
        _check(not self.lora_rank, s, "weight_sync",
               "collective broadcasts the policy's parameters, and a LoRA policy (lora_rank > 0) needs its adapters "
               "merged first; use weight_sync auto or object_store")

    def _check_async(self) -> None:
        """Asynchronous training and sequence-level masking: both compare pi_old with the engine's log-probs."""
        s = self.section
        _check(isinstance(self.max_staleness, int) and self.max_staleness >= 0, s, "max_staleness",
               f"must be an integer >= 0 (0 = synchronous), got {self.max_staleness!r}")
        _check(self.mis_threshold == 0 or self.mis_threshold > 1, s, "mis_threshold",
               f"must be 0 (off) or > 1 (the band is [1 / mis_threshold, mis_threshold]), got {self.mis_threshold}")
        _check(self.mis_threshold == 0 or self.recompute_old_logprobs, s, "mis_threshold",
               "needs recompute_old_logprobs: true (without it pi_old is the engine's own log-prob: the ratio is 1)")
        if self.max_staleness:
            # pi_old must be the policy being updated (the proximal policy); the stale engine's log-probs are the
            # behaviour policy that TIS and MIS correct for, never the clipping anchor
            _check(self.recompute_old_logprobs, s, "max_staleness",
                   "needs recompute_old_logprobs: true (a stale rollout's own log-probs cannot anchor the PPO ratio)")
            _check(self.placement != "colocated", s, "max_staleness",
                   "overlaps generation with the update, but colocated roles share each GPU and take turns; "
                   "use placement disaggregated (rollout replicas on their own GPUs) or none")

    def _check_batches(self, estimator: AdvantageEstimator) -> None:
        """Batch, group and mini-batch sizes fit together and suit ``estimator``."""
        s = self.section
        _check(self.mini_batch_size >= self.num_workers, s, "mini_batch_size",
               f"must be >= num_workers ({self.num_workers}) so every worker gets rows")
        _check(isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 0, s, "micro_batch_size",
               f"must be an integer >= 0 (0: no micro-batching), got {self.micro_batch_size!r}")
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "ppo_epochs", "mini_batch_size"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _check(not estimator.needs_groups or self.group_size >= 2, s, "group_size",
               f"must be >= 2 for {estimator.value} (its baseline compares samples of one prompt), got {self.group_size}")
        rows = self.prompts_per_step * self.group_size
        _check(self.mini_batch_size <= rows, s, "mini_batch_size",
               f"must be <= prompts_per_step x group_size = {rows}, got {self.mini_batch_size}")

    def _check_update(self) -> None:
        """Sampling, PPO clipping, critic and return parameters of the update."""
        s = self.section
        _check(self.temperature > 0, s, "temperature", f"must be > 0 (rollouts are sampled), got {self.temperature}")
        _check(0 < self.top_p <= 1, s, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.critic_lr > 0, s, "critic_lr", f"must be > 0, got {self.critic_lr}")
        _check(0.0 <= self.clip_low < 1.0, s, "clip_low", f"must be in [0, 1), got {self.clip_low}")
        _check(self.clip_high >= 0, s, "clip_high", f"must be >= 0, got {self.clip_high}")
        _check(self.dual_clip == 0 or self.dual_clip > 1, s, "dual_clip", f"must be 0 (off) or > 1, got {self.dual_clip}")
        _check(0.0 <= self.gspo_clip_low < 1.0, s, "gspo_clip_low", f"must be in [0, 1), got {self.gspo_clip_low}")
        _check(self.gspo_clip_high >= 0, s, "gspo_clip_high", f"must be >= 0, got {self.gspo_clip_high}")
        _check(self.dual_clip == 0 or PolicyObjective(self.policy_objective).supports_dual_clip, s, "dual_clip",
               f"must be 0 with policy_objective {self.policy_objective}: its clipped weight has no unclipped branch "
               "to bound")
        _check(self.value_clip >= 0, s, "value_clip", f"must be >= 0 (0 = off), got {self.value_clip}")
        _check(self.vf_coef > 0, s, "vf_coef", f"must be > 0, got {self.vf_coef}")
        for name in ("gamma", "lam"):
            _check(0.0 <= getattr(self, name) <= 1.0, s, name, f"must be in [0, 1], got {getattr(self, name)}")

    def _check_kl(self, estimator: AdvantageEstimator) -> None:
        """KL penalty: coefficient, where it applies for ``estimator``, adaptive controller."""
        s = self.section
        _check(self.kl_coef >= 0, s, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(self.kl_k3_cap >= 0, s, "kl_k3_cap",
               f"must be >= 0 (an upper bound on each token's k3 value; 0 disables the cap), got {self.kl_k3_cap}")
        _check(not self.kl_in_reward or estimator.takes_token_rewards, s, "kl_in_reward",
               f"{estimator.value} scores whole sequences and takes no token rewards; set kl_in_reward false "
               "(KL as a loss term)")
        if self.adaptive_kl:
            _check(self.kl_coef > 0, s, "kl_coef", "must be > 0 with adaptive_kl (the controller scales it)")
            _check(self.kl_target > 0, s, "kl_target", f"must be > 0, got {self.kl_target}")
            _check(self.kl_horizon >= 1, s, "kl_horizon", f"must be >= 1, got {self.kl_horizon}")

    def _check_dapo(self) -> None:
        """Entropy bonus, DAPO dynamic sampling and overlong penalty, rollout logging."""
        s = self.section
        _check(self.entropy_coef >= 0, s, "entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        _check(not self.dynamic_sampling or self.group_size >= 2, s, "dynamic_sampling",
               f"needs group_size >= 2 (it drops groups whose samples all scored the same), got {self.group_size}")
        _check(self.dynamic_sampling_max_rounds >= 0, s, "dynamic_sampling_max_rounds",
               f"must be >= 0, got {self.dynamic_sampling_max_rounds}")
        if self.overlong_max_len or self.overlong_cache_len:
            _check(0 < self.overlong_cache_len <= self.overlong_max_len <= self.max_new_tokens, s, "overlong_cache_len",
                   f"need 0 < overlong_cache_len <= overlong_max_len <= max_new_tokens ({self.max_new_tokens}), "
                   f"got {self.overlong_cache_len} and {self.overlong_max_len}")
        _check(self.log_rollouts_every >= 0, s, "log_rollouts_every", f"must be >= 0, got {self.log_rollouts_every}")

    def _check_distill(self, estimator: AdvantageEstimator) -> None:
        """On-policy distillation (estimator distill) needs its teacher; the teacher's fields need distill."""
        s = self.section
        if not estimator.needs_teacher:
            _check(not self.teacher_model_path, s, "teacher_model_path",
                   f"is only used by estimator distill (on-policy distillation), got estimator {estimator.value}")
            _check(self.distill_reward_coef == 0, s, "distill_reward_coef",
                   f"is only used by estimator distill, got estimator {estimator.value}")
            return
        _check(bool(self.teacher_model_path), s, "teacher_model_path",
               "must name the teacher's model directory for estimator distill")
        _check(self.distill_reward_coef >= 0, s, "distill_reward_coef", f"must be >= 0, got {self.distill_reward_coef}")
        _check(not self.dynamic_sampling, s, "dynamic_sampling",
               "drops groups whose sequence rewards tie, but distill learns from the teacher on every token; "
               "set it false")
