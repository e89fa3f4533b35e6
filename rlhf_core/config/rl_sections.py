"""Online RL's sections within its section (``rl.rollout``, ``rl.kl`` ...): one small dataclass per concern, and
:data:`RENAMED`, the flat name each of their fields is also read under (``kl_coef`` for ``kl.coef``: from
``params.yaml`` and ``--set`` with a notice naming the dotted key, and mapped by ``alignflow diff`` when it compares
runs logged under either name). The checks across them are RLConfig's (:mod:`rlhf_core.config.rl`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RolloutSection:
    """``rl.rollout``: how rollouts are sampled: the engine, prompts and samples per step, sampling settings."""

    engine: str = "static"
    """static (our decode loop, rlhf_core/rollout/static.py: static KV cache, prompts prefilled once per group, CUDA
    graphs on a GPU; Llama-family models, falls back to hf with a warning otherwise), hf (transformers generate on the
    policy itself) or vllm (a vLLM engine whose weights are synced after every update; falls back to hf, with a warning,
    when vLLM cannot be imported)."""
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
    parity: bool = False
    """The engine and the trainer compute log-probs with the same batch-invariant forward
    (rlhf_core/models/parity.py), so the engine's log-prob of every sampled token equals the trainer's recomputation
    bit for bit and rollout/logprob_mismatch reads exactly 0: a divergence seen then is the algorithm's, not numerics'.
    Needs engine static or hf (the static engine then decodes eagerly, without CUDA graphs), placement none,
    packing off, and fused_kernels and compile_layers off (auto resolves to off). The forward's batch invariance is
    checked on a CPU in fp32 and on a GPU in bf16 (bench/parity_probe.py); what parity costs in each phase is in
    BENCHMARKS.md."""
    fp8: bool = False
    """The engine samples through a copy of the policy whose linear layers (all but the LM head) run in FP8: e4m3
    weights with a scale per output channel, inputs quantized with a scale per token, torch._scaled_mm
    (rlhf_core/models/fp8.py). Every weight sync quantizes the new weights again; the trainer keeps its own precision.
    Needs a CUDA GPU of compute capability >= 8.9 (refused on a CPU or an older GPU when the engine is built), engine
    static or hf, no LoRA, no parity. Turns truncated importance sampling on (off_policy.tis_cap 2) unless
    off_policy.tis_cap or off_policy.mis_threshold is set."""
    vllm_memory_fraction: float = 0.1
    """rollout.engine vllm: fraction of GPU memory (of RAM on CPU) vLLM reserves for its KV cache."""
    lora_sync: str = "adapters"
    """A LoRA policy's (lora_rank > 0) weight sync to an engine with weights of its own (vLLM, Ray rollout replicas):
    adapters (the engine keeps the frozen base and takes the adapter tensors alone: the static and HF engines hold
    them injected as the learner does, vLLM serves them as a LoRA adapter) or merged (the whole model with the
    adapters folded in, reloaded every step). Logged per step as perf/weight_sync_bytes and perf/weight_sync_s."""
    sleep: str = "auto"
    """Colocated Ray replicas free their weights' memory once a rollout is done, and the weight sync after the update
    allocates and fills them again (vLLM's sleep mode, level 2, for our engines): the reference, old log-prob and update
    phases run without the replica's copy of the policy on the GPU. on, off or auto (on with GPUs where it can work:
    colocated, synchronous, hf or static engine, whole-weight syncs, i.e. no LoRA)."""


@dataclass
class RewardSection:
    """``rl.reward``: where rewards come from (a function, a reward model or a reward server), the server's limits."""

    kind: str = "function"
    """Where rewards come from: function (a .py file), model (a reward model directory) or http."""
    function: str = "rlhf_core/embedded/reward.py:reward"
    """``file.py:function`` returning one reward per (prompt, completion, label), for reward.kind function."""
    model_path: str = "models/reward"
    """Reward model directory, for reward.kind model."""
    url: str = ""
    """Reward server URL (e.g. from ``alignflow serve-rm``), for reward.kind http."""
    timeout_s: float = 30.0
    """Seconds one request to the reward or environment server may take, connect to last byte (then retried)."""
    retries: int = 3
    """Retries of a reward request that timed out or failed with a 5xx, for reward.kind http."""
    backoff_cap_s: float = 30.0
    """Longest wait between reward-server retries (full-jitter exponential backoff from 1 s), for reward.kind http."""
    deadline_s: float = 300.0
    """Seconds one reward call may take, all retries and waits (429 Retry-After included), for reward.kind http."""
    max_response_bytes: int = 4 * 1024 * 1024
    """Largest reply body the reward or environment server may send; a larger one is refused unread."""
    token_env: str = ""
    """NAME of the environment variable holding the reward server's token (sent as Authorization: Bearer); never the
    token itself, so configs, Prefect parameters and MLflow hold the name only. Empty: no token."""


@dataclass
class EnvironmentSection:
    """``rl.environment``: multi-turn rollouts with a tool: the environment, its stop tokens, trajectory limits."""

    spec: str = ""
    """Multi-turn rollouts with a tool (rlhf_core/rollout/environments.py): path/to/env.py:make_env (a function
    returning a fresh environment) or an http(s):// environment server (the reward_* timeout, retry, backoff and
    deadline settings apply to it too); empty: single-turn rollouts, as without this field."""
    stop_tokens: list[str] = field(default_factory=list)
    """An HTTP environment's tokens that end a model turn (e.g. a tool call's closing tag); a file environment names its
    own."""
    token_env: str = ""
    """NAME of the environment variable holding the environment server's token (Authorization: Bearer)."""
    max_turns: int = 2
    """With an environment: model turns per trajectory (tool calls + the answer)."""
    max_trajectory_tokens: int = 32
    """With an environment: response tokens per trajectory, model turns and observations together (each turn is also
    capped at rollout.max_new_tokens)."""
    tool_messages: str = "auto"
    """With an environment: how an observation joins a trajectory (environments.ToolMessages): chat (a chat-template
    tool message, then the next assistant turn's generation prompt; a turn ending at eos is a step too), text (its text
    appended inside the model's turn) or auto (chat where prompts_file holds conversations and the tokenizer has a chat
    template of its own that renders tool turns, else text)."""


@dataclass
class AlgorithmSection:
    """``rl.algorithm``: the advantage estimator, the policy objective and its clipping, the critic and the returns."""

    estimator: str = "grpo"
    """Advantage estimator: gae (PPO, trains a critic), reinforce++, reinforce++-baseline, rloo, grpo, dr-grpo, or
    distill (on-policy distillation from distill.teacher_model_path: per-token reverse-KL rewards, discount 0)."""
    policy_objective: str = "ppo_clip"
    """Policy-gradient surrogate (rl_math.PolicyObjective): ppo_clip (PPO's min over token ratios clipped to [1 -
    algorithm.clip_low, 1 + algorithm.clip_high]), gspo (GSPO-token, Zheng et al. 2025: one length-normalised ratio per
    response, clipped to [1 - algorithm.gspo_clip_low, 1 + algorithm.gspo_clip_high]) or cispo (MiniMax-M1: REINFORCE
    weighted by the detached token ratio capped at 1 + algorithm.clip_high, no lower bound, no token's gradient
    dropped)."""
    ppo_epochs: int = 1
    """Passes over each iteration's rollouts (PPO's K epochs)."""
    mini_batch_size: int = 128
    """Rollout rows per optimizer step (policy and critic); with rollout.prompts_per_step x rollout.group_size rows and
    one PPO epoch, one update per batch (pi_old is then the update's own detached log-prob: no extra forward)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1 (ratio >= 1 - algorithm.clip_low), in [0, 1); ppo_clip only (cispo has no lower
    bound)."""
    clip_high: float = 0.28
    """PPO clip epsilon above 1 (ratio <= 1 + algorithm.clip_high); above algorithm.clip_low is DAPO's clip-higher.
    cispo caps its importance weight at 1 + algorithm.clip_high (a token ratio too, so the same scale)."""
    gspo_clip_low: float = 0.0003
    """gspo: clip epsilon below 1 of the sequence ratio, in [0, 1); the paper's 3e-4. Own fields, not
    algorithm.clip_low: a geometric mean over the response moves ~1000x less than a token ratio, and 0.2 would never
    bind."""
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
    entropy_coef: float = 0.0
    """Weight of an entropy bonus subtracted from the policy loss; 0 = off (entropy is logged either way)."""
    loss_aggregation: str = "token_mean"
    """How token losses are reduced: token_mean (DAPO), seq_mean_token_mean (GRPO) or seq_mean_token_sum_norm
    (Dr.GRPO)."""
    critic_lr: float = 1e-3
    """Peak learning rate of the critic's AdamW (estimator gae only)."""


@dataclass
class KLSection:
    """``rl.kl``: the KL penalty to the reference: its weight, estimator, where it applies, the adaptive controller."""

    coef: float = 0.1
    """beta: weight of the KL to the reference (initial value when kl.adaptive); 0 = no KL term."""
    estimator: str = "k3"
    """Per-token KL estimator of the penalty: k1, k2 or k3 (k1 is the usual choice inside the reward)."""
    k3_cap: float = 10.0
    """Upper bound on each token's k3 value in the penalty (verl, OpenRLHF: 10); 0 disables. Where it binds the token's
    KL gradient is zero (rl_math.kl_penalty); train/kl is logged uncapped."""
    in_reward: bool = False
    """Fold -beta * KL into token rewards (PPO, REINFORCE++) instead of adding beta * KL to the loss (GRPO); only for
    gae and the reinforce++ variants."""
    adaptive: bool = False
    """Adapt beta towards kl.target (Ziegler et al. 2019) instead of keeping it fixed."""
    target: float = 0.1
    """Target mean per-sequence KL (nats) of the adaptive controller."""
    horizon: int = 10000
    """Horizon (in samples) of the adaptive controller: beta moves by at most 20% x samples / horizon per step."""


@dataclass
class DapoSection:
    """``rl.dapo``: dAPO's dynamic sampling and soft overlong penalty."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose samples all scored the same, top up with more prompts."""
    dynamic_sampling_max_rounds: int = 3
    """Extra rollout rounds allowed per iteration to top up the kept groups (dapo.dynamic_sampling only)."""
    overlong_max_len: int = 0
    """DAPO soft overlong penalty: L_max in tokens (at most rollout.max_new_tokens); 0 = off."""
    overlong_cache_len: int = 0
    """Width in tokens of the overlong penalty's ramp from 0 to -1 (0 < cache <= dapo.overlong_max_len when on)."""


@dataclass
class OffPolicySection:
    """``rl.off_policy``: asynchrony and the corrections for samples not drawn from the policy being updated."""

    max_staleness: int = 0
    """Asynchronous training: 0 = synchronous (each batch sampled from the policy it updates); k >= 1 = the next batch
    is generated while the current one updates, from a policy at most k updates old (weights are pushed to the engine
    only when the gap would exceed k). Needs off_policy.recompute_old_logprobs; not with placement colocated; under
    disaggregated placement the reference runs on the policy ranks' bundles, the reward model on the replicas'."""
    recompute_old_logprobs: bool = True
    """Recompute old log-probs with one no-grad policy forward; false uses the engine's sampling log-probs (exact only
    when the engine samples from the trained weights with the same numerics)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (Yao et al. 2025): weight each token's policy-gradient term by min(pi_old /
    pi_engine, off_policy.tis_cap) to correct for an engine (vLLM) that samples slightly off the trainer's policy; 0 =
    off, 2 is the paper's choice. Needs off_policy.recompute_old_logprobs. With rollout.fp8 and neither this nor
    off_policy.mis_threshold set, 2."""
    mis_threshold: float = 0.0
    """Sequence-level masked importance sampling (Seq-MIS, rl_math.sequence_is_mask): a response whose ratio pi_old(y) /
    pi_engine(y) leaves [1 / off_policy.mis_threshold, off_policy.mis_threshold] is masked out of the loss, whether the
    engine's numerics or its staleness (off_policy.max_staleness) caused the gap; 0 = off, else > 1 (e.g. 2)."""


@dataclass
class DistributionSection:
    """``rl.distribution``: where the roles run under Ray, the rollout replicas and how they get the weights."""

    placement: str = "none"
    """none (every role in this process) or, through Ray, colocated (policy, reference, reward model and rollout engine
    share each worker's bundle) or disaggregated (each role its own bundles)."""
    rollout_workers: int = 1
    """Rollout engine replicas under Ray (prompts are split across them); ignored with placement none."""
    weight_sync: str = "auto"
    """How Ray rollout replicas get the learner's weights after an update
    (rlhf_core/distributed/distribution.weight_sync.py): object_store (rank 0's weights as one Ray object to every
    replica; works anywhere), collective (policy rank 0 and the replicas in a torch.distributed group of their own,
    weights broadcast in 1 GiB buckets: NCCL on GPUs, gloo on CPUs; replicas must not share rank 0's GPU) or auto (GPUs:
    CUDA IPC for colocated replicas, collective for replicas on GPUs of their own with the hf/static engines; CPUs:
    object_store)."""
    shard_reference: bool = True
    """parallel zero3 on Ray: the reference (and distillation teacher) ranks partition the frozen weights as the
    policy's are, a DeepSpeed ZeRO-3 engine without an optimizer, so a GPU holds 1/num_workers of them and gathers each
    layer for its forward (a 7B reference: 3.8 GB a GPU on four instead of 15.2); false: each reference rank holds the
    whole model (no gathers, more memory)."""


@dataclass
class DistillSection:
    """``rl.distill``: on-policy distillation (estimator distill): the teacher and the weight of the sequence reward."""

    teacher_model_path: str = ""
    """Frozen teacher of on-policy distillation (estimator distill, required there, unused otherwise): it scores the
    policy's sampled tokens and each token's reward is -(log pi - log pi_teacher). Same tokenizer as the policy (checked
    at load); loaded like the reference (policy's compute dtype, no gradients)."""
    reward_coef: float = 0.0
    """estimator distill: weight of the sequence reward (reward.kind's) added to every token's advantage; 0 = pure
    distillation (the reward is still computed and logged)."""


RENAMED: dict[str, str] = {
    "rollout_engine": "rollout.engine", "prompts_per_step": "rollout.prompts_per_step",
    "group_size": "rollout.group_size", "temperature": "rollout.temperature", "top_p": "rollout.top_p",
    "max_new_tokens": "rollout.max_new_tokens", "vllm_memory_fraction": "rollout.vllm_memory_fraction",
    "lora_sync": "rollout.lora_sync",
    "rollout_sleep": "rollout.sleep", "rollout_parity": "rollout.parity", "rollout_fp8": "rollout.fp8",
    "reward_kind": "reward.kind", "reward_function": "reward.function",
    "reward_model_path": "reward.model_path", "reward_url": "reward.url", "reward_timeout_s": "reward.timeout_s",
    "reward_retries": "reward.retries", "reward_backoff_cap_s": "reward.backoff_cap_s",
    "reward_deadline_s": "reward.deadline_s", "reward_max_response_bytes": "reward.max_response_bytes",
    "reward_token_env": "reward.token_env", "environment": "environment.spec",
    "environment_stop_tokens": "environment.stop_tokens", "environment_token_env": "environment.token_env",
    "max_turns": "environment.max_turns", "max_trajectory_tokens": "environment.max_trajectory_tokens",
    "tool_messages": "environment.tool_messages", "estimator": "algorithm.estimator",
    "policy_objective": "algorithm.policy_objective", "ppo_epochs": "algorithm.ppo_epochs",
    "mini_batch_size": "algorithm.mini_batch_size", "clip_low": "algorithm.clip_low",
    "clip_high": "algorithm.clip_high", "gspo_clip_low": "algorithm.gspo_clip_low",
    "gspo_clip_high": "algorithm.gspo_clip_high", "dual_clip": "algorithm.dual_clip",
    "value_clip": "algorithm.value_clip", "vf_coef": "algorithm.vf_coef", "gamma": "algorithm.gamma",
    "lam": "algorithm.lam", "entropy_coef": "algorithm.entropy_coef",
    "loss_aggregation": "algorithm.loss_aggregation", "critic_lr": "algorithm.critic_lr", "kl_coef": "kl.coef",
    "kl_estimator": "kl.estimator", "kl_k3_cap": "kl.k3_cap", "kl_in_reward": "kl.in_reward",
    "adaptive_kl": "kl.adaptive", "kl_target": "kl.target", "kl_horizon": "kl.horizon",
    "dynamic_sampling": "dapo.dynamic_sampling", "dynamic_sampling_max_rounds": "dapo.dynamic_sampling_max_rounds",
    "overlong_max_len": "dapo.overlong_max_len", "overlong_cache_len": "dapo.overlong_cache_len",
    "max_staleness": "off_policy.max_staleness", "recompute_old_logprobs": "off_policy.recompute_old_logprobs",
    "tis_cap": "off_policy.tis_cap", "mis_threshold": "off_policy.mis_threshold",
    "placement": "distribution.placement", "rollout_workers": "distribution.rollout_workers",
    "weight_sync": "distribution.weight_sync", "shard_reference": "distribution.shard_reference",
    "teacher_model_path": "distill.teacher_model_path", "distill_reward_coef": "distill.reward_coef",
}
"""Old flat name of an ``rl`` field -> its name within the sections (``kl_coef`` -> ``kl.coef``): the one table that
params files, ``--set`` overrides and ``alignflow diff`` read old names through."""

SECTION_CLASSES: dict[str, type] = {
    "rollout": RolloutSection,
    "reward": RewardSection,
    "environment": EnvironmentSection,
    "algorithm": AlgorithmSection,
    "kl": KLSection,
    "dapo": DapoSection,
    "off_policy": OffPolicySection,
    "distribution": DistributionSection,
    "distill": DistillSection,
}
"""RLConfig's sections: field name -> dataclass."""
