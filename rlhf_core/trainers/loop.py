"""Loop pieces every trainer shares: seeding, optimizer, schedule, accumulation, checkpoints.

A trainer (SFT now; DPO, KTO, reward model and RL later) supplies a function that maps a
micro-batch to ``(loss_sum, n_units)`` and gets the rest from here, so gradient
accumulation, clipping, the schedule and checkpoint format are written once.
"""

from __future__ import annotations

import json
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


def accumulate_and_step(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    max_grad_norm: float,
    autocast_dtype: torch.dtype | None,
    units_fn: Callable[[Any], int] = count_label_tokens,
) -> StepStats:
    """One optimizer step over ``micro_batches`` (gradient accumulation).

    ``loss_fn`` returns a *summed* loss and its unit count (tokens, pairs, ...); ``units_fn``
    counts a micro-batch's units without a forward pass. Each micro-batch's sum is divided
    by the units of the whole step before backward, so the gradient equals that of one
    batch holding every micro-batch, whatever their sizes.
    """
    device = next(model.parameters()).device
    total = sum(units_fn(mb) for mb in micro_batches)
    loss_total = 0.0
    units_total = 0
    for mb in micro_batches:
        with autocast_context(device, autocast_dtype):
            loss_sum, n = loss_fn(model, mb)
        (loss_sum / max(total, 1)).backward()
        loss_total += float(loss_sum.detach())
        units_total += int(n)
    if max_grad_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    else:
        grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepStats(loss_total / max(units_total, 1), units_total, grad_norm, scheduler.get_last_lr()[0])


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


def save_checkpoint(ckpt_root: str | Path, step: int, model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer,
                    scheduler: Any, extra_state: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write ``ckpt_root/step-{step:07d}``: weights (safetensors) + optimizer, schedule and RNG state."""
    path = save_hf_dir(model, tokenizer, Path(ckpt_root) / f"step-{step:07d}")
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "extra": extra_state or {},
    }
    torch.save(state, path / "trainer_state.pt")
    for old in sorted(Path(ckpt_root).glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``ckpt_root`` (one with its trainer state)."""
    done = [p for p in sorted(Path(ckpt_root).glob("step-*")) if (p / "trainer_state.pt").exists()]
    return done[-1] if done else None


class EpochSampler:
    """Indices of ``n`` examples in batches of ``batch_size``, reshuffled every epoch from ``seed``.

    Deterministic: the same seed gives the same order on every run (a batch may straddle two
    epochs; none is dropped).
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < 1:
            raise ValueError("cannot sample batches from an empty dataset")
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> list[int]:
        while len(self.order) < self.batch_size:
            self.order += torch.randperm(self.n, generator=self.generator).tolist()
        idx, self.order = self.order[:self.batch_size], self.order[self.batch_size:]
        return idx


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
    show_progress: bool = True,
) -> LoopResult:
    """Optimise ``model`` for ``cfg.max_steps`` steps: batch -> accumulate -> step -> log -> eval -> checkpoint.

    ``cfg`` is a :class:`rlhf_core.config.TrainerConfig`. ``evaluate()`` returns held-out
    metrics and sample answers; it runs every ``cfg.eval_every`` steps and once at the end,
    and its time is excluded from ``perf/train_seconds``. ``step_metrics()`` (optional)
    returns trainer-specific metrics gathered by ``loss_fn`` since the last call.
    """
    device = next(model.parameters()).device
    autocast_dtype = _resolve_autocast(cfg.precision, device)
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    last_metrics: dict[str, float] = {}
    eval_seconds = 0.0

    def run_eval(step: int) -> list[dict[str, str]]:
        nonlocal eval_seconds
        started = Timer()
        metrics, samples = evaluate()
        sink.log_metrics(metrics, step)
        last_metrics.update(metrics)
        eval_seconds += started.total()
        return samples

    model.train()
    timer, tokens_seen = Timer(), 0
    bar = tqdm(range(1, cfg.max_steps + 1), desc=name, disable=not show_progress, mininterval=2.0)
    for step in bar:
        micro = [next_micro_batch() for _ in range(cfg.grad_accum)]
        stats = accumulate_and_step(model, micro, loss_fn, optimizer, scheduler, max_grad_norm=cfg.max_grad_norm,
                                    autocast_dtype=autocast_dtype, units_fn=units_fn)
        tokens_seen += sum(int(mb["input_ids"].numel()) for mb in micro)
        if step % 10 == 0 or step == cfg.max_steps:
            elapsed = timer.total() - eval_seconds  # training time only
            extra = step_metrics() if step_metrics is not None else {}
            sink.log_metrics({"train/loss": stats.loss, "train/grad_norm": stats.grad_norm, "train/lr": stats.lr,
                              "perf/tokens_per_s": tokens_seen / max(elapsed, 1e-9), "perf/elapsed_s": elapsed,
                              **extra}, step)
            bar.set_postfix(loss=f"{stats.loss:.3f}", lr=f"{stats.lr:.1e}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.max_steps:
            run_eval(step)
        if cfg.save_every and step % cfg.save_every == 0:
            save_checkpoint(cfg.checkpoint_dir, step, model, tokenizer, optimizer, scheduler)
    train_seconds = timer.total() - eval_seconds

    samples = run_eval(cfg.max_steps)
    sink.log_metrics({"perf/train_seconds": train_seconds}, cfg.max_steps)
    metrics = {**last_metrics, "train/loss_final": stats.loss, "perf/train_seconds": train_seconds,
               "perf/tokens_per_s": tokens_seen / max(train_seconds, 1e-9)}
    return LoopResult(metrics, samples)


def _resolve_autocast(precision: str, device: torch.device) -> torch.dtype | None:
    from rlhf_core.models import resolve_precision

    return resolve_precision(precision, device)
