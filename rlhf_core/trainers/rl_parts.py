"""The parts of an online RL run around its iteration (:mod:`rlhf_core.trainers.rl`): the records the phases hand
each other (:class:`Sampled`, :class:`Rollout`, :class:`Experience`) and the run's result, the prompts as the policy
reads them, rollout batches joined and cut by whole groups, the reward source and rollout engine a config names,
and the checks a run makes before its first step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import torch

from rlhf_core.common.redact import redact_secrets
from rlhf_core.config import ConfigError, RLConfig
from rlhf_core.config.choices import AdvantageEstimator, RewardKind
from rlhf_core.data.formats import prompt_text, read_prompt_examples
from rlhf_core.data.io import DataError, read_records
from rlhf_core.data.sequences import SAMPLE_ROWS, rendered_row
from rlhf_core.data.tokenize import IGNORE_INDEX, TokenizedExample, encode_prompt
from rlhf_core.models.fp8 import fp8_unsupported
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.models.parity import make_batch_invariant
from rlhf_core.models.precision import Precision
from rlhf_core.rewards.sources import RewardSource, build_reward_source
from rlhf_core.rollout.engine import HFGenerateEngine, RolloutBatch, RolloutEngine
from rlhf_core.rollout.environments import tool_conversations
from rlhf_core.rollout.static import StaticCacheEngine, supports
from rlhf_core.rollout.vllm import VLLMEngine, vllm_available
from rlhf_core.trainers.loop import Timer

log = logging.getLogger(__name__)


@dataclass
class RLResult:
    """The trained policy's directory, final metrics, greedy eval answers and the logged rollout rows."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)
    rollout_table: list[dict[str, Any]] = field(default_factory=list)
    rendered_examples: list[dict[str, Any]] = field(default_factory=list)
    """The first iteration's first samples as the policy saw and wrote them (:func:`rendered_rollout_rows`)."""
    eval_answers: dict[str, Any] | None = None
    """The final eval's every greedy answer and their settings (the guard probe reuses them)."""
    dashboard: Path | None = None
    """The run dashboard (one HTML file, :mod:`rlhf_core.tracking.run_dashboard`); None when no step was recorded."""


def read_prompts(cfg: RLConfig, tokenizer: Any) -> tuple[list[str], list[str | None], list[list[dict]] | None]:
    """Prompts of ``cfg.prompts_file`` as the policy reads them (a conversation rendered with its chat template and
    generation prompt, :func:`rlhf_core.data.formats.prompt_text`; standard text as it is), their labels (``None`` where
    a record has none) and, where an environment's observations are chat-template tool messages
    (``rl.environment.tool_messages``), the conversations they are rendered into (else ``None``)."""
    records = read_records(cfg.prompts_file)
    if not records:
        raise DataError(cfg.prompts_file, 0, "no prompts")
    examples = read_prompt_examples(records, cfg.prompts_file, prompt_field=cfg.prompt_field,
                                    label_field=cfg.label_field)
    conversations = (tool_conversations(cfg.environment.tool_messages, tokenizer, examples, cfg.prompts_file,
                                        cfg.prompt_field)
                     if cfg.environment.spec else None)
    return [prompt_text(tokenizer, e.prompt) for e in examples], [e.label for e in examples], conversations


def rendered_rollout_rows(tokenizer: Any, batch: RolloutBatch, rewards: torch.Tensor,
                          n: int = SAMPLE_ROWS) -> list[dict[str, Any]]:
    """The first ``n`` samples as the policy saw and wrote them: ``text`` (rendered prompt and sampled response,
    special tokens kept, so the template's markers and the end-of-turn eos show), ``loss_spans`` (the response:
    the tokens the policy loss covers, up to and including eos), ``prompt`` (rendered), ``completion`` (as the
    reward source got it, special tokens skipped) and ``reward``; secrets redacted."""
    rows = []
    loss_mask = batch.loss_mask()
    for i in range(min(n, len(batch))):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        kept = batch.response_mask[i].bool()
        response = batch.response_ids[i][kept].tolist()
        # an environment's observation tokens are not the policy's: outside the loss spans
        labels = [tok if own else IGNORE_INDEX for tok, own in zip(response, loss_mask[i][kept].tolist())]
        seq = TokenizedExample(prompt + response, [IGNORE_INDEX] * len(prompt) + labels)
        rows.append(redact_secrets({**rendered_row(tokenizer, seq),
                                    "prompt": tokenizer.decode(prompt, skip_special_tokens=False),
                                    "completion": batch.completions[i], "reward": float(rewards[i])}))
    return rows


# --------------------------------------------------------------------------------------
# Rollout batches: select groups, join top-up rounds
# --------------------------------------------------------------------------------------


def _pad(t: torch.Tensor, width: int, value: float, *, left: bool) -> torch.Tensor:
    fill = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def concat_batches(batches: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
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
        group_size=batches[0].group_size,
        action_mask=(torch.cat([_pad(b.action_mask, r, 0, left=False) for b in batches])
                     if batches[0].action_mask is not None else None),
        tool_calls=torch.cat([b.tool_calls for b in batches]) if batches[0].tool_calls is not None else None)


def take_rows(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """The rows ``rows`` (whole groups, in order) of ``batch``."""
    idx = rows.tolist()
    return RolloutBatch(prompts=[batch.prompts[i] for i in idx], completions=[batch.completions[i] for i in idx],
                        prompt_ids=batch.prompt_ids[rows], prompt_mask=batch.prompt_mask[rows],
                        response_ids=batch.response_ids[rows], response_mask=batch.response_mask[rows],
                        sampling_logprobs=batch.sampling_logprobs[rows], group_size=batch.group_size,
                        action_mask=batch.action_mask[rows] if batch.action_mask is not None else None,
                        tool_calls=batch.tool_calls[rows] if batch.tool_calls is not None else None)


def mean_or_nan(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


@dataclass
class Sampled:
    """Phases 1-3: the kept rollout rows and their rewards, and what every sampling round drew."""

    batch: RolloutBatch
    rewards: torch.Tensor  # (rows,) reward of each kept sample
    all_rewards: torch.Tensor  # (sampled rows,) every round's rewards, kept or not (logged)
    all_lengths: torch.Tensor  # (sampled rows,) every round's response lengths
    sampled_groups: int
    kept_groups: int


@dataclass
class Rollout:
    """A batch on its way from the engine to the update: which policy version sampled it, and when.

    ``start`` and ``end`` are wall-clock seconds (``time.time()``), set by the thread that generates it."""

    step: int  # the iteration that learns from it
    version: int  # updates the engine's weights had seen when it was generated
    start: float | None = None
    end: float | None = None
    sampled: Sampled | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # perf/rollout_s, perf/reward_s
    spans: list[tuple[str, float, float, str]] = field(default_factory=list)  # PhaseTimes.spans; not checkpointed

    def state_dict(self) -> dict[str, Any]:
        """Tensors, strings and numbers only: a checkpoint reads its state back with weights_only."""
        sampled = self.sampled
        return {"step": self.step, "version": self.version, "start": self.start, "end": self.end,
                "seconds": dict(self.seconds),
                "sampled": {**{f.name: getattr(sampled, f.name) for f in fields(Sampled) if f.name != "batch"},
                            "batch": {f.name: getattr(sampled.batch, f.name) for f in fields(RolloutBatch)}}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Rollout:
        sampled = dict(state["sampled"])
        sampled["batch"] = RolloutBatch(**sampled["batch"])
        return cls(state["step"], state["version"], state["start"], state["end"], Sampled(**sampled),
                   dict(state["seconds"]))


@dataclass
class Experience:
    """Phases 4-5: what the update consumes; tensors are ``(rows, response_len)`` unless noted."""

    tensors: dict[str, torch.Tensor]  # the learner's input: ids, masks, log-probs, advantages (values, returns)
    prompt_width: int
    mask: torch.Tensor  # 1.0 on response tokens
    sampling_logp: torch.Tensor  # the engine's log-probs of its samples
    old_logp: torch.Tensor  # pi_old (the engine's when pi_old is fused into the update), masked
    ref_logp: torch.Tensor  # masked
    old_values: torch.Tensor | None  # the critic's (gae only)
    fused_old: bool  # pi_old is the update's own detached log-prob (one update per batch)
    teacher_logp: torch.Tensor | None = None  # the teacher's, masked (distill only)
    scores: torch.Tensor | None = None  # (rows,) shaped rewards
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    tis: dict[str, float] = field(default_factory=dict)  # off-policy diagnostics: TIS, MIS, async IS weights


class PhaseTimes:
    """Seconds spent in each named phase of an iteration (summed when a phase runs more than once), and each
    run of a phase as a span ``(name, start, end, thread name)`` in wall-clock seconds (the run dashboard's
    timeline)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"perf/rollout_s": 0.0, "perf/reward_s": 0.0}
        self.spans: list[tuple[str, float, float, str]] = []
        self.tallies: dict[str, float] = {}  # amounts other than seconds (perf/weight_sync_bytes), summed the same way

    def tally(self, name: str, amount: float) -> None:
        self.tallies[name] = self.tallies.get(name, 0.0) + float(amount)

    def time(self, name: str, fn: Any, *args: Any) -> Any:
        # DEBUG lines at each phase's start and end: where a step that never finishes is stuck
        # (bench/side_by_side.py turns them on; a 7B GRPO step ran past its limit with no trace)
        log.debug("rl: %s started", name)
        started, wall = Timer(), time.time()
        out = fn(*args)
        self.seconds[name] = self.seconds.get(name, 0.0) + started.total()
        self.spans.append((name, wall, time.time(), threading.current_thread().name))
        log.debug("rl: %s done in %.2f s", name, started.total())
        return out


def reward_source_for(cfg: RLConfig, kind: RewardKind, device: torch.device) -> RewardSource:
    return build_reward_source(kind, path=cfg.reward.model_path if kind is RewardKind.MODEL else cfg.reward.function,
                               url=cfg.reward.url, device=device, batch_size=cfg.batch_size,
                               timeout_s=cfg.reward.timeout_s, retries=cfg.reward.retries,
                               backoff_cap_s=cfg.reward.backoff_cap_s, deadline_s=cfg.reward.deadline_s,
                               token_env=cfg.reward.token_env, max_response_bytes=cfg.reward.max_response_bytes,
                               attention=cfg.attention)


def check_teacher_tokenizer(cfg: RLConfig, tokenizer: Any) -> None:
    """The teacher scores the policy's token ids, so both must read them as the same tokens: one vocabulary."""
    ours, theirs = tokenizer.get_vocab(), load_tokenizer(cfg.distill.teacher_model_path).get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise ConfigError(f"rl.distill.teacher_model_path: the teacher's tokenizer ({cfg.distill.teacher_model_path}, "
                          f"{len(theirs)} "
                          f"tokens) differs from the policy's ({cfg.model_path}, {len(ours)} tokens), e.g. "
                          f"{differ}; on-policy distillation scores the policy's token ids under the teacher, so "
                          "both must share one tokenizer")


def check_prompt_lengths(cfg: RLConfig, tokenizer: Any, prompts: list[str]) -> None:
    longest = max(len(encode_prompt(tokenizer, p)) for p in prompts)
    response, name = ((cfg.environment.max_trajectory_tokens, "environment.max_trajectory_tokens")
                      if cfg.environment.spec else (cfg.rollout.max_new_tokens, "rollout.max_new_tokens"))
    if longest + response > cfg.max_length:
        raise ConfigError(f"rl.max_length: the longest prompt of {cfg.prompts_file} has {longest} tokens; with "
                          f"{name} {response} that exceeds max_length {cfg.max_length}")


def training_prompts(cfg: RLConfig, tokenizer: Any) -> tuple[list[str], list[str | None], list[list[dict]] | None]:
    """What :func:`read_prompts` returns, checked before any model loads: a distillation teacher's tokenizer against
    the policy's, and every prompt's length within ``max_length``."""
    if AdvantageEstimator(cfg.algorithm.estimator).needs_teacher:
        check_teacher_tokenizer(cfg, tokenizer)
    prompts, labels, conversations = read_prompts(cfg, tokenizer)
    check_prompt_lengths(cfg, tokenizer, prompts)
    return prompts, labels, conversations


# --------------------------------------------------------------------------------------
# Checkpoints and engines
# --------------------------------------------------------------------------------------


class GeneratorState:
    """A torch.Generator seen as a checkpointable object."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["state"])


def sampling_copy(cfg: RLConfig, device: torch.device) -> Any:
    """A frozen copy of the starting policy for an in-process engine to sample from while the policy updates
    (asynchronous training); held in the compute dtype, as a Ray rollout replica's."""
    dtype = Precision.resolve(cfg.precision, device).compute_dtype or torch.float32
    return load_causal_lm(cfg.model_path, device, dtype, cfg.attention).eval().requires_grad_(False)


def syncs_adapters(cfg: RLConfig) -> bool:
    """Whether an engine with weights of its own takes a LoRA policy's adapters alone at each sync (``lora_rank`` > 0
    and ``rl.rollout.lora_sync`` adapters) rather than the merged weights."""
    return bool(cfg.lora_rank) and cfg.rollout.lora_sync == "adapters"


def build_rollout_engine(cfg: RLConfig, policy: Any, tokenizer: Any,
                         autocast_dtype: torch.dtype | None = None) -> RolloutEngine:
    """The engine ``cfg.rollout.engine`` names; vLLM falls back to HF generate, with a warning, when absent. Under
    ``rollout.parity`` the policy it samples from is made batch-invariant (already so where it is the learner's; the
    static and HF engines then run its batch-invariant forward);
    ``rollout.fp8`` is refused (ConfigError) where the policy's device has no FP8 matrix products."""
    if cfg.rollout.parity:
        make_batch_invariant(policy, cfg.max_length)
    if cfg.rollout.engine == "vllm":
        if vllm_available():
            lora = cfg.lora_rank if syncs_adapters(cfg) else 0  # serves the adapters on the base it starts from
            return VLLMEngine(cfg.model_path, tokenizer, seed=cfg.seed,
                              memory_fraction=cfg.rollout.vllm_memory_fraction, lora_rank=lora,
                              lora_alpha=cfg.lora_alpha)
        log.warning("rl: rollout_engine is vllm but vLLM cannot be imported here; using the HF engine instead")
    fp8 = cfg.rollout.fp8
    if fp8:
        unsupported = fp8_unsupported(next(policy.parameters()).device)
        if unsupported:
            raise ConfigError(f"{cfg.section}.rollout.fp8: {unsupported}; set rollout.fp8 false")
    if cfg.rollout.engine == "static":
        reason = supports(policy)
        if reason is None:
            return StaticCacheEngine(policy, tokenizer, batch_size=cfg.batch_size, autocast_dtype=autocast_dtype,
                                     fp8=fp8)
        log.warning("rl: rollout_engine static cannot run this policy (%s); using the HF engine instead", reason)
    return HFGenerateEngine(policy, tokenizer, batch_size=cfg.batch_size, autocast_dtype=autocast_dtype, fp8=fp8)


def sampling_parts(cfg: RLConfig, learner: Any, tokenizer: Any, device: torch.device,
                   autocast_dtype: torch.dtype | None, engine: RolloutEngine | None = None,
                   reward_source: RewardSource | None = None) -> tuple[RewardSource, RolloutEngine]:
    """The reward source and the rollout engine, each built unless given. A built engine samples from the learner's
    policy or, asynchronous, from a copy of its own, which the update does not write while it samples."""
    reward_source = reward_source or reward_source_for(cfg, RewardKind(cfg.reward.kind), device)
    engine = engine or build_rollout_engine(
        cfg, learner.policy if not cfg.off_policy.max_staleness else sampling_copy(cfg, device), tokenizer,
        autocast_dtype)
    return reward_source, engine
