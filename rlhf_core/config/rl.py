"""Online RL's section (``rl``, ``tool_rl``): rollouts, rewards, advantage estimator, policy objective, KL,
placement under Ray; checked in one named step per concern."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlhf_core.common.redact import redact_secrets
from rlhf_core.config.base import _check
from rlhf_core.config.choices import (AdvantageEstimator, KLEstimator, LossAggregation, PolicyObjective, RewardKind,
                                      ToolMessages, WeightSync)
from rlhf_core.config.rl_sections import (RENAMED, AlgorithmSection, DapoSection, DistillSection, DistributionSection,
                                          EnvironmentSection, KLSection, OffPolicySection, RewardSection,
                                          RolloutSection)
from rlhf_core.config.training import TrainerConfig


@dataclass
class RLConfig(TrainerConfig):
    """``rl``: online RL from sampled rollouts: PPO (GAE + critic), REINFORCE++, RLOO, GRPO, Dr.GRPO, DAPO options."""

    section: ClassVar[str] = "rl"
    renamed: ClassVar[dict[str, str]] = RENAMED

    model_path: str = "models/sft"
    """Policy to start from (usually the SFT model)."""
    ref_model_path: str = ""
    """Frozen reference model of the KL term; empty means the starting policy. With lora_rank > 0 that is the
    policy's own frozen base, scored with its adapters switched off: no reference model is loaded."""
    critic_model_path: str = ""
    """Critic backbone (estimator gae only), loaded with a scalar head via load_reward_model; empty
    means model_path (the policy's backbone, fresh zero-mean head). Name the reward model
    directory to start from it instead, as OpenRLHF does."""
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
    max_steps: int = 40
    """Rollout/update iterations (each samples prompts_per_step x group_size responses)."""
    num_threads: int = 1
    """torch intra-op threads on CPU: 1, since generation's small per-token kernels gain little from more and
    slow down badly when another process shares the cores."""
    batch_size: int = 256
    """Rows per forward pass when generating and when computing log-probs and values without gradient."""
    grad_accum: int = 1
    """Unused by rl (must stay 1): one mini-batch of mini_batch_size rows is one optimizer step."""
    max_length: int = 64
    """Longest prompt + response in tokens; a prompt with max_new_tokens that would exceed it stops the run at load."""
    micro_batch_size: int = 0
    """Rows per forward/backward of the policy update on each rank; gradients accumulate over a mini-batch's
    micro-batches (0: a rank's whole share of the mini-batch in one pass). Bounds activation memory."""
    lr: float = 3e-4
    """Peak learning rate of the policy's AdamW."""
    warmup_steps: int = 0
    """Linear warmup, in iterations (the schedule advances once per iteration; its first iteration runs at lr 0)."""
    eval_at_start: bool = True
    """Evaluate the starting policy before iteration 1 (the baseline of eval/accuracy)."""
    eval_items: int = 1000
    """Held-out items used for accuracy (greedy exact match)."""
    log_rollouts_every: int = 10
    """Iterations between rollout tables (step, prompt, completion, reward); 0 = never."""
    save_every: int = 20
    """Iterations between checkpoints (0: only the final model)."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """How rollouts are sampled: the engine, prompts and samples per step, sampling settings."""
    reward: RewardSection = field(default_factory=RewardSection)
    """Where rewards come from: a function, a reward model or a reward server, and the server's limits."""
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    """Multi-turn rollouts with a tool: the environment, its stop tokens and the trajectory limits."""
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    """The advantage estimator, the policy objective and its clipping, the critic and the returns."""
    kl: KLSection = field(default_factory=KLSection)
    """The KL penalty to the reference: its weight, estimator, where it applies and the adaptive controller."""
    dapo: DapoSection = field(default_factory=DapoSection)
    """DAPO's dynamic sampling and soft overlong penalty."""
    off_policy: OffPolicySection = field(default_factory=OffPolicySection)
    """Asynchrony and the corrections for samples not drawn from the policy being updated."""
    distribution: DistributionSection = field(default_factory=DistributionSection)
    """Where the roles run under Ray, the rollout replicas and how they get the weights."""
    distill: DistillSection = field(default_factory=DistillSection)
    """On-policy distillation (estimator distill): the teacher and the weight of the sequence reward."""

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

    def _value(self, name: str) -> Any:
        """The value of a field named as the checks name it: ``lr``, or ``kl.coef`` within a section."""
        value: Any = self
        for part in name.split("."):
            value = getattr(value, part)
        return value

    def _check_environment(self) -> None:
        """Multi-turn rollouts: the environment's spec, turn and token limits, where it can run."""
        s = self.section
        _check(self.environment.max_turns >= 1, s, "environment.max_turns",
               f"must be >= 1, got {self.environment.max_turns}")
        _check(self.environment.max_trajectory_tokens >= 1, s, "environment.max_trajectory_tokens",
               f"must be >= 1, got {self.environment.max_trajectory_tokens}")
        if not self.environment.spec:
            _check(not self.environment.stop_tokens, s, "environment.stop_tokens",
                   "is only used with an environment (environment.spec is empty)")
            _check(self.environment.tool_messages == "auto", s, "environment.tool_messages",
                   "is only used with an environment (environment.spec is empty)")
            return
        spec = self.environment.spec
        if spec.startswith(("http://", "https://")):
            _check(bool(self.environment.stop_tokens), s, "environment.stop_tokens",
                   "an HTTP environment needs the tokens that end a model turn, e.g. ['</calc>']")
        else:
            file_part, _, func = spec.rpartition(":")
            _check(file_part.endswith(".py") and func.isidentifier(), s, "environment.spec",
                   f"must be path/to/env.py:function or an http(s):// URL, got {spec!r}")
        _check(self.max_length >= self.environment.max_trajectory_tokens + 1, s, "environment.max_trajectory_tokens",
               f"must leave room for a prompt within max_length ({self.max_length}), got "
               f"{self.environment.max_trajectory_tokens}")
        _check(not self.dapo.overlong_max_len or self.dapo.overlong_max_len <= self.environment.max_trajectory_tokens,
               s, "dapo.overlong_max_len",
               f"must be <= environment.max_trajectory_tokens ({self.environment.max_trajectory_tokens}) with an "
               "environment")

    def _check_choices(self) -> tuple[AdvantageEstimator, RewardKind]:
        """Check the enum-valued fields; return the (AdvantageEstimator, RewardKind) they name."""
        s = self.section

        def one_of(name: str, enum: type) -> None:
            values = [e.value for e in enum]
            _check(self._value(name) in values, s, name, f"must be one of {values}, got {self._value(name)!r}")

        one_of("algorithm.estimator", AdvantageEstimator)
        one_of("reward.kind", RewardKind)
        one_of("kl.estimator", KLEstimator)
        one_of("algorithm.loss_aggregation", LossAggregation)
        one_of("algorithm.policy_objective", PolicyObjective)
        one_of("environment.tool_messages", ToolMessages)
        return AdvantageEstimator(self.algorithm.estimator), RewardKind(self.reward.kind)

    def _check_inputs(self) -> None:
        """Trainer fields rl does not use must keep their neutral values; prompts must be named."""
        s = self.section
        _check(self.train_file == "", s, "train_file", "rl reads its prompts from prompts_file; leave train_file empty")
        _check(self.grad_accum == 1, s, "grad_accum",
               "must be 1 (algorithm.mini_batch_size rows make one optimizer step)")
        _check(bool(self.prompts_file), s, "prompts_file", "must name the prompts file")

    def _check_reward(self, kind: RewardKind) -> None:
        """The reward source ``kind`` needs its own field; HTTP limits."""
        s = self.section
        if kind is RewardKind.FUNCTION:
            _check(":" in self.reward.function, s, "reward.function",
                   f"must be 'path/to/file.py:function_name', got {self.reward.function!r}")
        elif kind is RewardKind.MODEL:
            _check(bool(self.reward.model_path), s, "reward.model_path", "must name a reward model directory")
        else:
            _check(self.reward.url.startswith(("http://", "https://")), s, "reward.url",
                   f"must start with http:// or https:// for reward.kind http, got {redact_secrets(self.reward.url)!r}")
        _check(self.reward.timeout_s > 0, s, "reward.timeout_s", f"must be > 0, got {self.reward.timeout_s}")
        _check(self.reward.retries >= 0, s, "reward.retries", f"must be >= 0, got {self.reward.retries}")
        _check(self.reward.backoff_cap_s >= 0, s, "reward.backoff_cap_s",
               f"must be >= 0, got {self.reward.backoff_cap_s}")
        _check(self.reward.deadline_s > 0, s, "reward.deadline_s", f"must be > 0, got {self.reward.deadline_s}")
        _check(self.reward.max_response_bytes > 0, s, "reward.max_response_bytes",
               f"must be > 0, got {self.reward.max_response_bytes}")
        self._check_token_env(kind)

    def _check_token_env(self, kind: RewardKind) -> None:
        """reward.token_env must be a variable's name, set now (checked at load: fail before hours of training)."""
        name, s = self.reward.token_env, self.section
        if not name or kind is not RewardKind.HTTP:
            return
        # Never quote a value that is not a name: it may be the token itself, pasted in by mistake.
        _check(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None, s, "reward.token_env",
               "must be the NAME of an environment variable holding the token (letters, digits, _), not the token")
        _check(bool(os.environ.get(name)), s, "reward.token_env",
               f"environment variable {name} is not set (or is empty); export the reward server's token under it")
        _check("@" not in self.reward.url.split("/")[2], s, "reward.token_env",
               "is set, and reward.url also carries user:pass@ credentials; use one (only the token would be sent)")

    def _check_rollout(self) -> None:
        """Rollout engine, its off-policy correction, and where roles and workers run."""
        s = self.section
        _check(self.off_policy.tis_cap >= 0, s, "off_policy.tis_cap",
               f"must be >= 0 (0 = off), got {self.off_policy.tis_cap}")
        _check(self.off_policy.tis_cap == 0 or self.off_policy.recompute_old_logprobs, s, "off_policy.tis_cap",
               "needs off_policy.recompute_old_logprobs: true (without it pi_old is the engine's own log-prob)")
        self._check_async()
        _check(self.rollout.engine in ("hf", "static", "vllm"), s, "rollout.engine",
               f"must be hf, static or vllm, got {self.rollout.engine!r}")
        _check(0 < self.rollout.vllm_memory_fraction <= 1, s, "rollout.vllm_memory_fraction",
               f"must be in (0, 1], got {self.rollout.vllm_memory_fraction}")
        _check(self.rollout.lora_sync in ("adapters", "merged"), s, "rollout.lora_sync",
               f"must be adapters or merged, got {self.rollout.lora_sync!r}")
        _check(self.distribution.placement in ("none", "colocated", "disaggregated"), s, "distribution.placement",
               f"must be none, colocated or disaggregated, got {self.distribution.placement!r}")
        _check(self.distribution.rollout_workers >= 1, s, "distribution.rollout_workers",
               f"must be >= 1, got {self.distribution.rollout_workers}")
        _check(self.num_workers == 1 or self.distribution.placement != "none", s, "num_workers",
               f"{self.num_workers} policy workers need Ray: set placement to colocated or disaggregated")
        # without Ray the engine samples from this process's policy, whose weights ZeRO-3 holds as empty
        # placeholders outside a forward (the static engine would read them directly: a size-0 reshape)
        _check(self.parallel != "zero3" or self.distribution.placement != "none", s, "parallel",
               "zero3 partitions the policy's weights, and with placement none the rollout engine samples from them "
               "in this process; set placement colocated (Ray replicas take whole weights at each sync, also on one "
               "GPU) or parallel zero2")
        self._check_weight_sync()
        self._check_rollout_sleep()
        self._check_parity()
        self._check_fp8()

    def _check_fp8(self) -> None:
        """rl.rollout.fp8: an engine of ours on a whole-weight copy; TIS on unless a correction is chosen. Whether the
        device runs FP8 is checked where the engine is built (rl_parts.build_rollout_engine)."""
        s = self.section
        if not self.rollout.fp8:
            return
        _check(self.rollout.engine in ("static", "hf"), s, "rollout.fp8",
               f"needs rollout.engine static or hf (their sampling copy is what is quantized), got "
               f"{self.rollout.engine!r}")
        _check(not self.rollout.parity, s, "rollout.fp8",
               "and rollout.parity exclude each other (parity makes the engine's log-probs the trainer's bit for bit)")
        _check(not self.lora_rank, s, "rollout.fp8",
               "needs a policy without LoRA adapters (lora_rank 0): the engine quantizes whole weights")
        _check(self.off_policy.recompute_old_logprobs, s, "rollout.fp8",
               "needs off_policy.recompute_old_logprobs: true (the FP8 engine's log-probs are not the trainer's)")
        _check(self.rollout.sleep != "on", s, "rollout.fp8",
               "and rollout.sleep on exclude each other (the replica samples through a copy of its weights); use "
               "rollout.sleep auto or off")
        if not self.off_policy.tis_cap and not self.off_policy.mis_threshold:
            self.off_policy.tis_cap = 2.0

    def _check_parity(self) -> None:
        """rl.rollout.parity: one process, the HF or static engine sampling from the policy itself, padded rows, the
        model's own modules (fused_kernels and compile_layers off; auto resolves to off)."""
        s = self.section
        if not self.rollout.parity:
            return
        _check(self.rollout.engine in ("static", "hf"), s, "rollout.parity",
               f"needs rollout.engine static or hf (vLLM runs decode kernels of its own), got {self.rollout.engine!r}")
        _check(self.distribution.placement == "none", s, "rollout.parity",
               f"needs placement none (one process), got {self.distribution.placement!r}")
        _check(self.packing is not True, s, "rollout.parity", "needs packing auto or false (padded rows)")
        # the trainer's forward must run the modules the engine's decode runs: inductor's fused layers and liger's
        # kernels (whose RoPE the static engine does not use) are not checked batch-invariant
        for name in ("fused_kernels", "compile_layers"):
            _check(getattr(self, name) != "on", s, name,
                   "on and rollout.parity exclude each other (the trainer's forward would run kernels the engine's "
                   "decode does not); use auto or off")
            if getattr(self, name) == "auto":
                setattr(self, name, "off")

    def _check_rollout_sleep(self) -> None:
        """rl.rollout_sleep: on only where every rollout is followed by a sync of the whole weights."""
        s = self.section
        _check(self.rollout.sleep in ("auto", "on", "off"), s, "rollout.sleep",
               f"must be auto, on or off, got {self.rollout.sleep!r}")
        if self.rollout.sleep != "on":
            return
        _check(self.distribution.placement == "colocated", s, "rollout.sleep",
               f"on frees colocated Ray replicas' weights between phases; placement is {self.distribution.placement!r} "
               f"(set placement colocated, or rollout.sleep auto)")
        _check(self.rollout.engine in ("hf", "static"), s, "rollout.sleep",
               f"on needs the hf or static engine (vLLM has a sleep mode of its own), got {self.rollout.engine!r}")
        _check(not self.lora_rank, s, "rollout.sleep",
               "on needs a sync of the whole weights after each update, and a LoRA policy's replicas keep the "
               "frozen base and take the adapters alone; use rollout.sleep auto or off")

    def _check_weight_sync(self) -> None:
        """rl.weight_sync: a known path, and collective only where it can work."""
        s, values = self.section, [e.value for e in WeightSync]
        _check(self.distribution.weight_sync in values, s, "distribution.weight_sync",
               f"must be one of {values}, got {self.distribution.weight_sync!r}")
        if self.distribution.weight_sync != WeightSync.COLLECTIVE.value:
            return
        _check(self.distribution.placement != "none", s, "distribution.weight_sync",
               "collective broadcasts to Ray rollout replicas; with placement none the engine samples from the "
               "trained policy in this process (set placement disaggregated, or distribution.weight_sync auto)")
        _check(not self.lora_rank, s, "distribution.weight_sync",
               "collective broadcasts the policy's parameters, and a LoRA policy (lora_rank > 0) needs its adapters "
               "merged first; use distribution.weight_sync auto or object_store")

    def _check_async(self) -> None:
        """Asynchronous training and sequence-level masking: both compare pi_old with the engine's log-probs."""
        s = self.section
        _check(isinstance(self.off_policy.max_staleness, int) and self.off_policy.max_staleness >= 0, s,
               "off_policy.max_staleness",
               f"must be an integer >= 0 (0 = synchronous), got {self.off_policy.max_staleness!r}")
        _check(self.off_policy.mis_threshold == 0 or self.off_policy.mis_threshold > 1, s, "off_policy.mis_threshold",
               "must be 0 (off) or > 1 (the band is [1 / off_policy.mis_threshold, off_policy.mis_threshold]), got "
               f"{self.off_policy.mis_threshold}")
        _check(self.off_policy.mis_threshold == 0 or self.off_policy.recompute_old_logprobs, s,
               "off_policy.mis_threshold",
               "needs off_policy.recompute_old_logprobs: true (without it pi_old is the engine's own log-prob: the "
               "ratio is 1)")
        if self.off_policy.max_staleness:
            # pi_old must be the policy being updated (the proximal policy); the stale engine's log-probs are the
            # behaviour policy that TIS and MIS correct for, never the clipping anchor
            _check(self.off_policy.recompute_old_logprobs, s, "off_policy.max_staleness",
                   "needs off_policy.recompute_old_logprobs: true (a stale rollout's own log-probs cannot anchor the "
                   "PPO ratio)")
            _check(self.distribution.placement != "colocated", s, "off_policy.max_staleness",
                   "overlaps generation with the update, but colocated roles share each GPU and take turns; "
                   "use placement disaggregated (rollout replicas on their own GPUs) or none")

    def _check_batches(self, estimator: AdvantageEstimator) -> None:
        """Batch, group and mini-batch sizes fit together and suit ``estimator``."""
        s = self.section
        _check(self.algorithm.mini_batch_size >= self.num_workers, s, "algorithm.mini_batch_size",
               f"must be >= num_workers ({self.num_workers}) so every worker gets rows")
        _check(isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 0, s, "micro_batch_size",
               f"must be an integer >= 0 (0: no micro-batching), got {self.micro_batch_size!r}")
        for name in ("rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens", "algorithm.ppo_epochs",
                     "algorithm.mini_batch_size"):
            _check(self._value(name) >= 1, s, name, f"must be >= 1, got {self._value(name)}")
        _check(not estimator.needs_groups or self.rollout.group_size >= 2, s, "rollout.group_size",
               f"must be >= 2 for {estimator.value} (its baseline compares samples of one prompt), got "
               f"{self.rollout.group_size}")
        rows = self.rollout.prompts_per_step * self.rollout.group_size
        _check(self.algorithm.mini_batch_size <= rows, s, "algorithm.mini_batch_size",
               f"must be <= rollout.prompts_per_step x rollout.group_size = {rows}, got "
               f"{self.algorithm.mini_batch_size}")

    def _check_update(self) -> None:
        """Sampling, PPO clipping, critic and return parameters of the update."""
        s = self.section
        _check(self.rollout.temperature > 0, s, "rollout.temperature",
               f"must be > 0 (rollouts are sampled), got {self.rollout.temperature}")
        _check(0 < self.rollout.top_p <= 1, s, "rollout.top_p", f"must be in (0, 1], got {self.rollout.top_p}")
        _check(self.algorithm.critic_lr > 0, s, "algorithm.critic_lr", f"must be > 0, got {self.algorithm.critic_lr}")
        _check(0.0 <= self.algorithm.clip_low < 1.0, s, "algorithm.clip_low",
               f"must be in [0, 1), got {self.algorithm.clip_low}")
        _check(self.algorithm.clip_high >= 0, s, "algorithm.clip_high", f"must be >= 0, got {self.algorithm.clip_high}")
        _check(self.algorithm.dual_clip == 0 or self.algorithm.dual_clip > 1, s, "algorithm.dual_clip",
               f"must be 0 (off) or > 1, got {self.algorithm.dual_clip}")
        _check(0.0 <= self.algorithm.gspo_clip_low < 1.0, s, "algorithm.gspo_clip_low",
               f"must be in [0, 1), got {self.algorithm.gspo_clip_low}")
        _check(self.algorithm.gspo_clip_high >= 0, s, "algorithm.gspo_clip_high",
               f"must be >= 0, got {self.algorithm.gspo_clip_high}")
        _check(self.algorithm.dual_clip == 0 or PolicyObjective(self.algorithm.policy_objective).supports_dual_clip,
               s, "algorithm.dual_clip",
               f"must be 0 with algorithm.policy_objective {self.algorithm.policy_objective}: its clipped weight has "
               "no unclipped branch "
               "to bound")
        _check(self.algorithm.value_clip >= 0, s, "algorithm.value_clip",
               f"must be >= 0 (0 = off), got {self.algorithm.value_clip}")
        _check(self.algorithm.vf_coef > 0, s, "algorithm.vf_coef", f"must be > 0, got {self.algorithm.vf_coef}")
        for name in ("algorithm.gamma", "algorithm.lam"):
            _check(0.0 <= self._value(name) <= 1.0, s, name, f"must be in [0, 1], got {self._value(name)}")

    def _check_kl(self, estimator: AdvantageEstimator) -> None:
        """KL penalty: coefficient, where it applies for ``estimator``, adaptive controller."""
        s = self.section
        _check(self.kl.coef >= 0, s, "kl.coef", f"must be >= 0, got {self.kl.coef}")
        _check(self.kl.k3_cap >= 0, s, "kl.k3_cap",
               f"must be >= 0 (an upper bound on each token's k3 value; 0 disables the cap), got {self.kl.k3_cap}")
        _check(not self.kl.in_reward or estimator.takes_token_rewards, s, "kl.in_reward",
               f"{estimator.value} scores whole sequences and takes no token rewards; set kl.in_reward false "
               "(KL as a loss term)")
        if self.kl.adaptive:
            _check(self.kl.coef > 0, s, "kl.coef", "must be > 0 with kl.adaptive (the controller scales it)")
            _check(self.kl.target > 0, s, "kl.target", f"must be > 0, got {self.kl.target}")
            _check(self.kl.horizon >= 1, s, "kl.horizon", f"must be >= 1, got {self.kl.horizon}")

    def _check_dapo(self) -> None:
        """Entropy bonus, DAPO dynamic sampling and overlong penalty, rollout logging."""
        s = self.section
        _check(self.algorithm.entropy_coef >= 0, s, "algorithm.entropy_coef",
               f"must be >= 0, got {self.algorithm.entropy_coef}")
        _check(not self.dapo.dynamic_sampling or self.rollout.group_size >= 2, s, "dapo.dynamic_sampling",
               "needs rollout.group_size >= 2 (it drops groups whose samples all scored the same), got "
               f"{self.rollout.group_size}")
        _check(self.dapo.dynamic_sampling_max_rounds >= 0, s, "dapo.dynamic_sampling_max_rounds",
               f"must be >= 0, got {self.dapo.dynamic_sampling_max_rounds}")
        if self.dapo.overlong_max_len or self.dapo.overlong_cache_len:
            _check(0 < self.dapo.overlong_cache_len <= self.dapo.overlong_max_len <= self.rollout.max_new_tokens, s,
                   "dapo.overlong_cache_len",
                   "need 0 < dapo.overlong_cache_len <= dapo.overlong_max_len <= rollout.max_new_tokens "
                   f"({self.rollout.max_new_tokens}), "
                   f"got {self.dapo.overlong_cache_len} and {self.dapo.overlong_max_len}")
        _check(self.log_rollouts_every >= 0, s, "log_rollouts_every", f"must be >= 0, got {self.log_rollouts_every}")

    def _check_distill(self, estimator: AdvantageEstimator) -> None:
        """On-policy distillation (estimator distill) needs its teacher; the teacher's fields need distill."""
        s = self.section
        if not estimator.needs_teacher:
            _check(not self.distill.teacher_model_path, s, "distill.teacher_model_path",
                   f"is only used by estimator distill (on-policy distillation), got estimator {estimator.value}")
            _check(self.distill.reward_coef == 0, s, "distill.reward_coef",
                   f"is only used by estimator distill, got estimator {estimator.value}")
            return
        _check(bool(self.distill.teacher_model_path), s, "distill.teacher_model_path",
               "must name the teacher's model directory for estimator distill")
        _check(self.distill.reward_coef >= 0, s, "distill.reward_coef", f"must be >= 0, got {self.distill.reward_coef}")
        _check(not self.dapo.dynamic_sampling, s, "dapo.dynamic_sampling",
               "drops groups whose sequence rewards tie, but distill learns from the teacher on every token; "
               "set it false")
