"""The offline trainers' loop body (every trainer but online RL): ``grad_accum`` micro-batches,
one optimizer step, inside :func:`rlhf_core.trainers.loop.run_checkpointed`.

A trainer supplies its data as :class:`rlhf_core.trainers.batches.MicroBatches` (draw examples, count their
tokens, collate a group) and a function that maps a micro-batch to ``(loss_sum, n_units)``, and
:func:`run_training` does the rest, so micro-batching (a token budget with packing), gradient accumulation,
clipping, the schedule and the checkpoint format are written once. RL has its own body (:mod:`rlhf_core.trainers.rl`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from rlhf_core.common.redact import redact_secrets
from rlhf_core.config import config_to_dict
from rlhf_core.data.tokenize import group_by_tokens
from rlhf_core.distributed.parallel import current_world
from rlhf_core.distributed.strategies import build_strategy
from rlhf_core.models.loading import (
    enable_checkpointing, load_causal_lm, merged_model, prepare_for_training, resolve_checkpointing)
from rlhf_core.models.precision import Precision
from rlhf_core.tracking.checkpoint import Checkpointer, read_weights, run_fingerprint
from rlhf_core.trainers.batches import EmptyMicroBatch, MicroBatches, real_tokens
from rlhf_core.trainers.loop import (LoopClock, LoopPlan, MetricSink, NullSink, Resumable, StorageNeeds,
                                     estimate_state_bytes, run_checkpointed, save_hf_dir)
from rlhf_core.trainers.step import accumulate_and_step, build_optimizer, build_scheduler, count_label_tokens, phase

log = logging.getLogger(__name__)


def load_policy_and_reference(cfg: Any, device: torch.device) -> tuple[Any, Any]:
    """The policy a preference trainer trains (``cfg.model_path``, in its precision's load dtype) and the
    frozen reference (``cfg.ref_model_path`` or the policy's start, in the compute dtype, no gradients)."""
    precision = Precision.resolve(cfg.precision, device)
    policy = load_causal_lm(cfg.model_path, device, precision.load_dtype, cfg.attention)
    reference = load_causal_lm(cfg.ref_model_path or cfg.model_path, device, precision.weight_dtype, cfg.attention)
    return policy, reference.eval().requires_grad_(False)


@dataclass
class LoopResult:
    """What the shared loop hands back to a trainer."""

    metrics: dict[str, float]
    eval_samples: list[dict[str, str]]
    resumed_from_step: int = 0
    eval_answers: dict[str, Any] | None = None
    """the final eval's greedy answers and their settings (:attr:`LoopOutcome.eval_answers`)"""


def run_training(
    cfg: Any,
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    batches: MicroBatches,
    loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor]],
    evaluate: Callable[[], tuple[Any, ...]],
    sink: MetricSink,
    units_fn: Callable[[Any], int] = count_label_tokens,
    step_metrics: Callable[[], dict[str, float]] | None = None,
    state: dict[str, Resumable] | None = None,
    lineage: dict[str, str] | None = None,
    before_save: Callable[[], dict[str, float]] | None = None,
    show_progress: bool = True,
) -> LoopResult:
    """Optimise ``model`` for ``cfg.max_steps`` steps, then save it to ``cfg.output_dir``.

    Per step: micro-batches (:class:`MicroBatches`) -> accumulate -> step -> log, inside
    :func:`run_checkpointed` (eval, checkpoints, resume, SIGTERM). ``cfg`` is a
    :class:`rlhf_core.config.TrainerConfig`.
    ``evaluate()`` returns held-out metrics and sample answers; it runs every ``cfg.eval_every``
    steps and once at the end. ``step_metrics()`` (optional) returns trainer-specific metrics
    gathered by ``loss_fn`` since the last call. A checkpoint holds the weights, optimizer,
    schedule, RNG, the objects in ``state`` (the data sampler) and the loop's counters. The final
    model is saved with ``lineage`` (plus stage, config and base model) in ``alignflow.json``
    (``before_save()``, if given, runs first and its metrics are added).
    """
    world = current_world()
    if not world.is_main:  # every rank runs the loop; rank 0 logs, checkpoints and saves
        sink, show_progress = NullSink(), False
    body = _OfflineBody(cfg, name, model, tokenizer, world, batches=batches, loss_fn=loss_fn,
                        evaluate=evaluate, units_fn=units_fn, step_metrics=step_metrics, state=dict(state or {}),
                        lineage=lineage or {}, before_save=before_save)
    plan = LoopPlan(name, cfg.max_steps, cfg.eval_every, cfg.save_every, cfg.resume)
    checkpointer = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg), cfg.keep_checkpoints)
    outcome = run_checkpointed(plan, checkpointer, body, sink=sink, world=world, show_progress=show_progress,
                               result_metrics=lambda train_seconds: {
                                   "train/loss_final": body.last_loss,
                                   "perf/tokens_per_s": body.tokens_seen / max(train_seconds, 1e-9),
                                   **body.saved_metrics})
    metrics = {**outcome.eval_metrics, **outcome.result_metrics, "perf/train_seconds": outcome.train_seconds}
    return LoopResult(metrics, outcome.eval_samples, outcome.resumed_from_step, outcome.eval_answers)


class _OfflineBody:
    """A supervised trainer's step: ``grad_accum`` micro-batches, one optimizer step (a :class:`TrainingBody`)."""

    def __init__(self, cfg: Any, name: str, model: torch.nn.Module, tokenizer: Any, world: Any, *,
                 batches: MicroBatches, loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 evaluate: Callable[[], tuple[Any, ...]],
                 units_fn: Callable[[Any], int], step_metrics: Callable[[], dict[str, float]] | None,
                 state: dict[str, Resumable], lineage: dict[str, str],
                 before_save: Callable[[], dict[str, float]] | None):
        self.cfg, self.name, self.model, self.tokenizer, self.world = cfg, name, model, tokenizer, world
        self.batches, self.loss_fn, self._evaluate, self.units_fn = batches, loss_fn, evaluate, units_fn
        self.step_metrics, self.state, self.lineage, self.before_save = step_metrics, state, lineage, before_save
        self.precision = Precision.resolve(cfg.precision, next(model.parameters()).device)
        prepare_for_training(model, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout)
        self.checkpointing: bool | None = None  # decided at the first step, from its micro-batch (gradient_checkpointing)
        # under mixed/bf16 this casts the model to bf16 (after taking the fp32 masters from it)
        optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, self.precision, parallel=cfg.parallel,
                                    distributed=world.distributed)
        self.scheduler = build_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        self.strategy = build_strategy(cfg.parallel, model, optimizer, self.scheduler, world, grad_accum=cfg.grad_accum,
                                       max_grad_norm=cfg.max_grad_norm, offload_optimizer=cfg.offload_optimizer,
                                       precision=self.precision)
        self.tokens_seen, self.last_loss = 0, float("nan")
        self.saved_metrics: dict[str, float] = {}
        self.drawn_ahead: tuple[list[Any], dict[str, Any]] | None = None
        """the next step's micro-batches, with the state objects' states from before they were drawn"""
        model.train()

    def restore(self, ckpt: Any) -> None:
        """Weights, optimizer, schedule, sampler and counters (on every rank; any world size wrote them)."""
        self.strategy.load_weights(read_weights(ckpt.path), str(ckpt.path))
        self.scheduler.load_state_dict(ckpt.state["scheduler"])
        self.strategy.load_optimizer_state(ckpt.state["optimizer"])
        for key, obj in self.state.items():
            obj.load_state_dict(ckpt.state["objects"][key])
        self.tokens_seen = int(ckpt.state["loop"]["tokens_seen"])
        self.last_loss = float(ckpt.state["loop"]["last_loss"])

    def train_step(self, step: int, clock: LoopClock) -> dict[str, float] | None:
        cfg, world = self.cfg, self.world
        with phase("micro_batches"):
            micro = self.drawn_ahead[0] if self.drawn_ahead is not None else self._micro_batches()
            self.drawn_ahead = None
        if self.checkpointing is None:
            self._decide_checkpointing([mb for mb in micro if not isinstance(mb, EmptyMicroBatch)])
        ahead = self._draw_ahead if self.batches.ahead and step < cfg.max_steps else None
        stats = accumulate_and_step(self.strategy, micro, self._loss, max_grad_norm=cfg.max_grad_norm,
                                    units_fn=self._units, step=step, world=world, while_device_runs=ahead)
        empty = sum(isinstance(mb, EmptyMicroBatch) for mb in micro)
        with phase("count_tokens"):
            tokens, real, empty = world.all_reduce_sum([sum(real_tokens(mb) for mb in micro), len(micro) - empty,
                                                        empty])
        self.tokens_seen += int(tokens)
        self.last_loss = stats.loss
        if step % cfg.log_every != 0 and step != cfg.max_steps:
            return None
        elapsed = clock.train_seconds()
        extra = self.step_metrics() if self.step_metrics is not None else {}
        if cfg.micro_batch_tokens:  # how the budget split this step, over all ranks (empty: rank agreement's cost)
            extra = {**extra, "perf/micro_batches": real, "perf/empty_micro_batches": empty}
        return {"train/loss": stats.loss, "train/grad_norm": stats.grad_norm, "train/lr": stats.lr,
                "perf/tokens_per_s": self.tokens_seen / max(elapsed, 1e-9), "perf/elapsed_s": elapsed, **extra}

    def _micro_batches(self) -> list[Any]:
        """This rank's micro-batches of one step: ``grad_accum`` draws of ``batch_size`` examples, each a
        micro-batch, or (``micro_batch_tokens``) regrouped into as many as the budget takes, padded with
        :class:`EmptyMicroBatch` to the largest count of any rank."""
        cfg, batches = self.cfg, self.batches
        draws = [batches.draw() for _ in range(cfg.grad_accum)]
        if not cfg.micro_batch_tokens:
            return [batches.collate(d) for d in draws]  # grad_accum on every rank: nothing to agree on
        examples = [e for d in draws for e in d]
        groups = group_by_tokens([batches.tokens(e) for e in examples], cfg.micro_batch_tokens)
        micro: list[Any] = [batches.collate([examples[i] for i in g]) for g in groups]
        count = int(self.world.all_reduce_max([len(micro)])[0])
        return micro + [EmptyMicroBatch(micro[0]["input_ids"][:1, :1])] * (count - len(micro))

    def _draw_ahead(self) -> None:
        """The next step's micro-batches, made while the device runs this step's (the host is otherwise idle
        then, and the device idle while the host makes them at the next step's start: several ms a 0.5B SFT step
        on a GPU). A checkpoint taken before that step runs saves the states from before the draw, so a
        resume draws the same examples."""
        before = {key: obj.state_dict() for key, obj in self.state.items()}
        self.drawn_ahead = (self._micro_batches(), before)

    def _loss(self, model: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(batch, EmptyMicroBatch):
            return self.loss_fn(model, batch)
        # every parameter is in the graph (DDP expects each one's gradient), each gradient is 0
        logits = model(input_ids=batch.input_ids.to(next(model.parameters()).device), use_cache=False).logits
        return logits.float().sum() * 0.0, torch.tensor(0)

    def _units(self, batch: Any) -> int:
        return 0 if isinstance(batch, EmptyMicroBatch) else self.units_fn(batch)

    def _decide_checkpointing(self, micro: list[dict[str, torch.Tensor]]) -> None:
        """Resolve ``gradient_checkpointing`` (auto: from a memory estimate of the largest micro-batch
        this run can draw: ``micro_batch_tokens``, or its sequences x ``max_length``) and log the choice."""
        cfg = self.cfg
        sequences = max(_count_sequences(mb) for mb in micro)
        tokens = cfg.micro_batch_tokens or sequences * cfg.max_length
        device = next(self.model.parameters()).device
        self.checkpointing, why = resolve_checkpointing(cfg.gradient_checkpointing, self.model, tokens,
                                                        Precision.resolve(cfg.precision, device).value)
        log.info("%s: %s", self.name, why)
        if self.checkpointing:
            enable_checkpointing(self.model)

    def progress(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['train/loss']:.3f}", "lr": f"{metrics['train/lr']:.1e}"}

    def evaluate(self, step: int) -> tuple[Any, ...]:
        del step
        return self._evaluate()

    def checkpoint(self) -> tuple[Any, Any, dict[str, Any]] | None:
        """Every rank takes part (ZeRO gathers the optimizer state and, at stage 3, the weights); rank 0
        gets what to write, the others None."""
        optimizer = self.strategy.optimizer_state()
        model = whole_weights(self.strategy, self.model, self.world)
        if not self.world.is_main:
            return None
        return model, self.tokenizer, {
            "optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
            "objects": self.drawn_ahead[1] if self.drawn_ahead is not None else {
                key: obj.state_dict() for key, obj in self.state.items()},
            "loop": {"tokens_seen": self.tokens_seen, "last_loss": self.last_loss}}

    def storage_needs(self) -> StorageNeeds:
        return StorageNeeds(Path(self.cfg.output_dir), *estimate_state_bytes(
            self.model, masters=self.precision.keeps_masters(self.cfg.parallel)))

    def save_final(self) -> None:
        if self.before_save is not None:
            self.saved_metrics = self.before_save()
        # Only deterministic content next to the weights, so DVC md5s repeat across runs. LoRA
        # adapters are merged, so the output is a plain HF model directory. Under mixed precision the
        # fp32 masters are the trained weights: they are what is saved (training is over).
        self.strategy.masters_into_model()
        with self.strategy.gathered():
            if self.world.is_main:
                save_hf_dir(merged_model(self.model), self.tokenizer, self.cfg.output_dir, extra={
                    "stage": self.name, "config": redact_secrets(config_to_dict(self.cfg)),
                    "base_model": str(self.cfg.model_path), **self.lineage})


def _count_sequences(batch: dict[str, torch.Tensor]) -> int:
    """Sequences in a micro-batch: its rows, where position ids restart in a packed row, or a prefix-tree batch's
    sequences (:func:`rlhf_core.data.tokenize.collate_pair_tree`)."""
    if "last_index" in batch:
        return int(batch["last_index"].numel())
    if "attention_mask" not in batch and "position_ids" in batch:
        return int((batch["position_ids"] == 0).sum())
    return int(batch["input_ids"].shape[0])


class _SavedWeights:
    """A model to ``save_pretrained`` with weights gathered beforehand (ZeRO-3 holds only shards)."""

    def __init__(self, model: Any, weights: dict[str, torch.Tensor]):
        self.model, self.weights = model, weights

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        self.model.save_pretrained(path, state_dict=self.weights, **kwargs)


def whole_weights(strategy: Any, model: torch.nn.Module, world: Any) -> Any:
    """What rank 0 saves as a checkpoint's weights: the model itself where every rank holds it whole,
    else (ZeRO-3) a CPU copy gathered by every rank (None on the others)."""
    if getattr(strategy, "stage", 0) < 3:
        return model
    with strategy.gathered():
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if world.is_main else None
    return _SavedWeights(model, weights) if world.is_main else None
