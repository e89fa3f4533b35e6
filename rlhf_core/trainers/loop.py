"""Loop pieces every trainer shares: seeding, optimizer, schedule, accumulation, checkpoints.

A trainer (SFT now; DPO, KTO, reward model and RL later) supplies a function that maps a
micro-batch to ``(loss_sum, n_units)`` and gets the rest from here, so gradient
accumulation, clipping, the schedule and checkpoint format are written once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

MetricsFn = Callable[[dict[str, float], int], None]


class MetricSink(Protocol):
    """Where a trainer sends metrics (an MLflow run, a local file, or nothing)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


class NullSink:
    """Discards metrics (a trainer run with no tracking)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        del metrics, step


def seed_everything(seed: int, num_threads: int | None = None) -> None:
    """Seed python, numpy and torch; fix CPU threads so results repeat bit for bit."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if num_threads is not None and not torch.cuda.is_available():
        torch.set_num_threads(num_threads)


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019) with no decay on biases, norms and embeddings' 1-D params."""
    decay, no_decay = [], []
    for _name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr`` (transformers' schedule)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps, min_lr_rate=min_lr_ratio
    )


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """bf16 autocast when a dtype is given, else a no-op context."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class StepStats:
    """What one optimizer step reports."""

    loss: float
    n_units: int
    grad_norm: float
    lr: float


def count_label_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Units of a token-level loss: labelled next-token targets (labels shifted by one)."""
    return int((batch["labels"][:, 1:] != -100).sum())


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm was NaN or inf; the step was not applied."""


def accumulate_and_step(
    strategy: Any,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor]],
    *,
    max_grad_norm: float,
    autocast_dtype: torch.dtype | None,
    units_fn: Callable[[Any], int] = count_label_tokens,
    step: int | None = None,
    world: Any = None,
) -> StepStats:
    """One optimizer step over ``micro_batches`` (gradient accumulation, and data parallelism).

    ``strategy`` is a :class:`rlhf_core.parallel.Strategy` (the plain model in one process, DDP or
    DeepSpeed across ``world``). ``loss_fn`` returns a *summed* loss and its unit count (tokens,
    pairs, ...); ``units_fn`` counts a micro-batch's units without a forward pass. Each
    micro-batch's sum is divided by the units of the whole step on every rank before backward,
    so the gradient equals that of one batch holding every micro-batch of every rank, whatever
    their sizes.

    A NaN/inf loss or gradient norm (on any rank) raises :class:`NonFiniteError` (naming
    ``step``) before the optimizer touches the weights, so the model and the last checkpoint
    stay good. (Under DeepSpeed the engine clips and steps in one call; its norm is checked after.)
    """
    from rlhf_core.parallel import World

    world = world or World()
    device = next(strategy.unwrap().parameters()).device
    total = world.all_reduce_sum([sum(units_fn(mb) for mb in micro_batches)])[0]
    loss_total, units_total, bad_micro = 0.0, 0, -1
    where = f"step {step}" if step is not None else "this step"
    for i, mb in enumerate(micro_batches):
        with strategy.accumulating(last=i == len(micro_batches) - 1):
            with autocast_context(device, autocast_dtype):
                loss_sum, n = loss_fn(strategy.module, mb)
            value = float(loss_sum.detach())
            if not math.isfinite(value) and bad_micro < 0:
                bad_micro = i
            strategy.backward(loss_sum * (strategy.grad_scale / max(total, 1)))
            if hasattr(strategy, "last_grad_norm"):  # DeepSpeed steps inside its own accumulation count
                strategy.step()
        loss_total += value
        units_total += int(n)
    loss_total, units_total, bad = world.all_reduce_sum([loss_total, units_total, float(bad_micro >= 0)])
    if bad:
        strategy.zero_grad()
        raise NonFiniteError(f"{where}: loss is {loss_total} (micro-batch {bad_micro} on this rank, or another "
                             f"rank's); the step was not applied")
    if hasattr(strategy, "last_grad_norm"):
        grad_norm = strategy.last_grad_norm()
        if not math.isfinite(grad_norm):
            raise NonFiniteError(f"{where}: gradient norm is {grad_norm} (DeepSpeed applied the step)")
    else:
        grad_norm = strategy.clip_grad_norm(max_grad_norm)
        if not math.isfinite(grad_norm):
            strategy.zero_grad()
            raise NonFiniteError(f"{where}: gradient norm is {grad_norm}; the step was not applied")
        strategy.step()
    lr = strategy.scheduler.get_last_lr()[0] if strategy.scheduler is not None else float("nan")
    return StepStats(loss_total / max(units_total, 1), int(units_total), grad_norm, lr)


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


def save_hf_dir(model: Any, tokenizer: Any, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Save model + tokenizer as an HF directory atomically (temp folder, then rename).

    A crash mid-save leaves the previous directory intact, never a half-written one.
    ``extra`` is written as ``alignflow.json`` beside the weights (deterministic content only:
    no timestamps, so DVC md5s repeat).
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if extra is not None:
        (tmp / "alignflow.json").write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old.exists():
        shutil.rmtree(old)
    return out_dir


class EpochSampler:
    """Indices of ``n`` examples in batches of ``batch_size``, reshuffled every epoch from ``seed``.

    Deterministic: the same seed gives the same order on every run (a batch may straddle two
    epochs; none is dropped). With a data-parallel ``world`` every rank draws the same global
    batch and keeps its rows ``rank::size`` of it, so N workers see the examples one would.
    """

    def __init__(self, n: int, batch_size: int, seed: int, world: Any = None):
        if n < 1:
            raise ValueError("cannot sample batches from an empty dataset")
        self.n, self.batch_size, self.world = n, batch_size, world
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> list[int]:
        while len(self.order) < self.batch_size:
            self.order += torch.randperm(self.n, generator=self.generator).tolist()
        idx, self.order = self.order[:self.batch_size], self.order[self.batch_size:]
        return idx if self.world is None else idx[self.world.rows(len(idx))]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Generator state and the rest of the current epoch's order (checkpoint contents)."""
        return {"generator": self.generator.get_state(), "order": torch.tensor(self.order, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])
        self.order = [int(i) for i in state["order"].tolist()]


class Timer:
    """Wall-clock seconds since construction or the last ``lap``."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        return dt

    def total(self) -> float:
        return time.perf_counter() - self.start


def batched(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """Consecutive slices of ``items`` of length ``size`` (the last may be shorter)."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


# --------------------------------------------------------------------------------------
# The step loop every trainer runs
# --------------------------------------------------------------------------------------


@dataclass
class LoopResult:
    """What the shared loop hands back to a trainer."""

    metrics: dict[str, float]
    eval_samples: list[dict[str, str]]
    resumed_from_step: int = 0


class Resumable(Protocol):
    """Trainer-side state the loop checkpoints beside the model (a sampler, a controller)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def run_training(
    cfg: Any,
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    next_micro_batch: Callable[[], Any],
    loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor]],
    evaluate: Callable[[], tuple[dict[str, float], list[dict[str, str]]]],
    sink: MetricSink,
    units_fn: Callable[[Any], int] = count_label_tokens,
    step_metrics: Callable[[], dict[str, float]] | None = None,
    state: dict[str, Resumable] | None = None,
    lineage: dict[str, str] | None = None,
    before_save: Callable[[], dict[str, float]] | None = None,
    show_progress: bool = True,
) -> LoopResult:
    """Optimise ``model`` for ``cfg.max_steps`` steps, then save it to ``cfg.output_dir``.

    Per step: batch -> accumulate -> step -> log -> eval -> checkpoint. ``cfg`` is a
    :class:`rlhf_core.config.TrainerConfig`. ``evaluate()`` returns held-out metrics and
    sample answers; it runs every ``cfg.eval_every`` steps and once at the end, and its time
    is excluded from ``perf/train_seconds``. ``step_metrics()`` (optional) returns
    trainer-specific metrics gathered by ``loss_fn`` since the last call.

    Resuming: every ``cfg.save_every`` steps (and on SIGTERM) a checkpoint holds the weights,
    optimizer, schedule, RNG, the objects in ``state`` (the data sampler) and the loop's
    counters. With ``cfg.resume`` a run whose config and inputs match an interrupted run's
    continues from its newest checkpoint and ends with the same weights and metrics as an
    uninterrupted run. The final model is saved with ``lineage`` (plus stage, config and base
    model) in ``alignflow.json`` (``before_save()``, if given, runs first and its metrics are
    added); then the run's checkpoints are removed.
    """
    from rlhf_core.checkpoint import Checkpointer, TrainingInterrupted, load_weights, run_fingerprint, \
        set_rng_state, sigterm_checkpoints
    from rlhf_core.config import config_to_dict, redact_secrets
    from rlhf_core.models import merged_model, prepare_for_training
    from rlhf_core.parallel import build_strategy, current_world

    # ---- data parallelism: every rank runs this loop; rank 0 logs, checkpoints and saves ------
    world = current_world()
    if not world.is_main:
        sink, show_progress = NullSink(), False
    device = next(model.parameters()).device
    autocast_dtype = _resolve_autocast(cfg.precision, device)
    prepare_for_training(model, gradient_checkpointing=cfg.gradient_checkpointing, lora_rank=cfg.lora_rank,
                         lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout)
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    strategy = build_strategy(cfg.parallel, model, optimizer, scheduler, world, grad_accum=cfg.grad_accum,
                              max_grad_norm=cfg.max_grad_norm, offload_optimizer=cfg.offload_optimizer,
                              autocast_dtype=autocast_dtype)
    # Under ZeRO the optimizer state is partitioned across ranks; mid-run checkpoints would need
    # DeepSpeed's own sharded format, so a ZeRO run writes only its final model (no resume yet).
    can_checkpoint = world.is_main and strategy.optimizer_state() is not None
    state = dict(state or {})
    last_metrics: dict[str, float] = {}
    eval_seconds = 0.0
    timer, tokens_seen, last_loss = Timer(), 0, float("nan")
    checkpointer = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg), cfg.keep_checkpoints)

    def run_eval(step: int) -> list[dict[str, str]]:
        nonlocal eval_seconds
        started = Timer()
        metrics, samples = evaluate()
        sink.log_metrics(metrics, step)
        last_metrics.update(metrics)
        eval_seconds += started.total()
        return samples

    def save(step: int) -> Path | None:
        if not can_checkpoint:
            return None
        return checkpointer.save(step, model, tokenizer, {
            "optimizer": strategy.optimizer_state(), "scheduler": scheduler.state_dict(),
            "objects": {key: obj.state_dict() for key, obj in state.items()},
            "loop": {"tokens_seen": tokens_seen, "last_metrics": dict(last_metrics), "last_loss": last_loss}})

    # Only rank 0 takes the run's lock; the other ranks of its world only read checkpoints.
    with checkpointer.hold(name) if world.is_main else nullcontext():
        # ---- resume an interrupted run of this config ---------------------------------------
        start_step = 1
        found = checkpointer.latest() if cfg.resume and strategy.optimizer_state() is not None else None
        if found is not None:
            load_weights(model, found.path)
            strategy.load_optimizer_state(found.state["optimizer"])
            scheduler.load_state_dict(found.state["scheduler"])
            for key, obj in state.items():
                obj.load_state_dict(found.state["objects"][key])
            tokens_seen = int(found.state["loop"]["tokens_seen"])
            last_loss = float(found.state["loop"]["last_loss"])
            last_metrics.update(found.state["loop"]["last_metrics"])
            set_rng_state(found.state["rng"])
            start_step = found.step + 1
            log.warning("%s: resuming from %s (step %d of %d)", name, found.path, found.step, cfg.max_steps)
            sink.log_metrics({"checkpoint/resumed_from_step": float(found.step)}, found.step)

        model.train()
        bar = tqdm(range(start_step, cfg.max_steps + 1), desc=name, disable=not show_progress, mininterval=2.0)
        with sigterm_checkpoints() as stop:
            for step in bar:
                micro = [next_micro_batch() for _ in range(cfg.grad_accum)]
                stats = accumulate_and_step(strategy, micro, loss_fn, max_grad_norm=cfg.max_grad_norm,
                                            autocast_dtype=autocast_dtype, units_fn=units_fn, step=step, world=world)
                tokens_seen += int(world.all_reduce_sum([sum(int(mb["input_ids"].numel()) for mb in micro)])[0])
                last_loss = stats.loss
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    elapsed = timer.total() - eval_seconds  # training time only
                    extra = step_metrics() if step_metrics is not None else {}
                    sink.log_metrics({"train/loss": stats.loss, "train/grad_norm": stats.grad_norm, "train/lr": stats.lr,
                                      "perf/tokens_per_s": tokens_seen / max(elapsed, 1e-9), "perf/elapsed_s": elapsed,
                                      **extra}, step)
                    bar.set_postfix(loss=f"{stats.loss:.3f}", lr=f"{stats.lr:.1e}")
                if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.max_steps:
                    run_eval(step)
                if (cfg.save_every and step % cfg.save_every == 0) or stop.requested:
                    path = save(step)
                    world.barrier()  # no rank runs ahead of a checkpoint it might have to resume from
                if stop.requested:
                    raise TrainingInterrupted(f"{name}: stopped by SIGTERM after step {step}; resume from {path}")
                inject_fault(name, step)
        train_seconds = timer.total() - eval_seconds

        samples = run_eval(cfg.max_steps)
        sink.log_metrics({"perf/train_seconds": train_seconds}, cfg.max_steps)
        metrics = {**last_metrics, "train/loss_final": last_loss, "perf/train_seconds": train_seconds,
                   "perf/tokens_per_s": tokens_seen / max(train_seconds, 1e-9)}
        if before_save is not None:
            metrics.update(before_save())
        # Only deterministic content next to the weights, so DVC md5s repeat across runs. LoRA
        # adapters are merged, so the output is a plain HF model directory.
        with strategy.gathered():
            if world.is_main:
                save_hf_dir(merged_model(model), tokenizer, cfg.output_dir, extra={
                    "stage": name, "config": redact_secrets(config_to_dict(cfg)), "base_model": str(cfg.model_path),
                    **(lineage or {})})
                checkpointer.clear()
        world.barrier()
    return LoopResult(metrics, samples, start_step - 1)


def inject_fault(stage: str, step: int) -> None:
    """Test hook: ``ALIGNFLOW_FAULT=<stage>:<step>[:<marker file>]`` raises after that step.

    With a marker file the fault fires once (the file is created when it fires), which is how
    the tests make a Prefect task fail on its first attempt and succeed on its retry. Unset in
    normal use: the cost is one environment lookup per step.
    """
    spec = os.environ.get("ALIGNFLOW_FAULT")
    if not spec:
        return
    parts = spec.split(":", 2)
    if len(parts) < 2 or parts[0] != stage or parts[1] != str(step):
        return
    if len(parts) == 3:
        marker = Path(parts[2])
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{stage}:{step}\n")
    raise InjectedFault(f"{stage}: fault injected after step {step} (ALIGNFLOW_FAULT={spec})")


class InjectedFault(RuntimeError):
    """Raised by :func:`inject_fault`; Prefect treats it as transient and retries."""


def _resolve_autocast(precision: str, device: torch.device) -> torch.dtype | None:
    from rlhf_core.models import resolve_precision

    return resolve_precision(precision, device)
