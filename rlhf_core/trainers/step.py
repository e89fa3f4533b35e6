"""One optimizer step, the same for every trainer: seeding, optimizer, schedule, gradient accumulation.

:func:`accumulate_and_step` is every trainer's update: the offline loop's (:mod:`rlhf_core.trainers.offline`)
and RL's policy and critic (:mod:`rlhf_core.trainers.rl_roles`). A micro-batch's loss enters backward as its
share of the whole step's units, so micro-batching, data parallelism and clipping are written once.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from rlhf_core.distributed.parallel import World
from rlhf_core.models.precision import MasterWeightAdamW, Precision, cast_parameters


def phase(name: str) -> Any:
    """A named range of the loop's host work in a torch.profiler trace (``alignflow#<name>``, next to
    torch's own ``Optimizer.step#...``), so a profile says which part of a step the host was in while
    the device waited; a few microseconds when no profiler runs."""
    return torch.profiler.record_function(f"alignflow#{name}")


def seed_everything(seed: int, num_threads: int | None = None) -> None:
    """Seed python, numpy and torch; fix CPU threads so results repeat bit for bit."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if num_threads is not None and not torch.cuda.is_available():
        torch.set_num_threads(num_threads)


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, precision: Precision | None = None, *,
                    parallel: str = "ddp", distributed: bool = False) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019) with no decay on biases, norms and embeddings' 1-D params.

    ``precision`` (a :class:`rlhf_core.models.precision.Precision`; None: fp32) ``mixed`` or ``bf16`` with
    ``parallel`` ddp: a :class:`rlhf_core.models.precision.MasterWeightAdamW` whose masters are taken from the
    model's weights as they are now, after which the model's parameters are cast to bf16 (so build
    it on the model as loaded, fp32 under mixed). Its fp32 gradient-accumulation hooks are on only
    when ``distributed`` is False: DDP (or a hand all-reduce) must see the gradients in ``.grad``.
    Under ZeRO (``parallel`` zero2/zero3) the plain AdamW: DeepSpeed's bf16 mode casts the model and
    keeps the masters (:class:`rlhf_core.distributed.strategies.DeepSpeedStrategy`).
    """
    decay, no_decay = [], []
    for _name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if parallel.startswith("zero"):
        # DeepSpeed wraps torch's default AdamW as it is. It drops a group without parameters (a LoRA model's
        # no-decay group: every adapter is a matrix), and a schedule built on this optimizer would then set one
        # learning rate too many (a ValueError at its first step). Elsewhere the empty group stays, so checkpoints
        # of LoRA runs keep loading.
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if (precision or Precision.FP32) is Precision.FP32:
        # torch's fused kernel (HF Trainer's default optimizer too): on a CPU one pass where the default steps
        # one tensor at a time (~10 ops each; 1.8 against 6.6 ms a step for the embedded model's 74 tensors, one
        # thread), and on either device it can skip a non-finite step without the host reading the flag
        # (parallel.optimizer_step). Every parameter on one device of one type: what the kernel takes.
        devices = {p.device.type for g in groups for p in g["params"]}
        fused = True if len(devices) == 1 and devices <= {"cpu", "cuda"} else None
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    optimizer = MasterWeightAdamW(groups, precision, lr=lr, betas=(0.9, 0.95), eps=1e-8, grad_hooks=not distributed)
    cast_parameters(model, precision.weight_dtype)
    return optimizer


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr`` (transformers' schedule)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup  # lazy: transformers (~1 s; LR schedule only)

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps, min_lr_rate=min_lr_ratio
    )


@dataclass
class StepStats:
    """What one optimizer step reports."""

    loss: float
    n_units: int
    grad_norm: float
    lr: float
    diagnostics: list[float] = field(default_factory=list)
    """the third values ``loss_fn`` returned, summed over micro-batches and ranks (empty where it returned two)"""


def count_label_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Units of a token-level loss: labelled next-token targets (labels shifted by one)."""
    return int((batch["labels"][:, 1:] != -100).sum())


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm was NaN or inf; the step was not applied."""


def accumulate_and_step(
    strategy: Any,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[torch.nn.Module, Any], tuple[Any, ...]],
    *,
    max_grad_norm: float,
    units_fn: Callable[[Any], int] | None = count_label_tokens,
    step: int | None = None,
    world: Any = None,
    while_device_runs: Callable[[], None] | None = None,
    before_clip: Callable[[], None] | None = None,
    where: str | None = None,
    names: tuple[str, str] = ("loss", "gradient norm"),
) -> StepStats:
    """One optimizer step over ``micro_batches`` (gradient accumulation, and data parallelism): every trainer's
    update, the offline loop's and RL's policy and critic (:mod:`rlhf_core.trainers.rl_roles`), is this one.

    ``strategy`` is a :class:`rlhf_core.distributed.parallel.Strategy` (the plain model in one process, DDP or
    DeepSpeed across ``world``). ``loss_fn`` returns a *summed* loss and its unit count (tokens,
    pairs, ...); ``units_fn`` counts a micro-batch's units without a forward pass. Each micro-batch's
    sum is divided by the units of the whole step on every rank before backward, so the gradient equals
    that of one batch holding every micro-batch of every rank, whatever their sizes. With ``units_fn``
    None the loss is already its micro-batch's share of the whole step's (RL weights its own) and enters
    backward times ``grad_scale`` alone; ``StepStats.loss`` is then the shares' sum. A third value of
    ``loss_fn``, a 1-D float64 tensor, is summed on the device (``StepStats.diagnostics``).
    ``before_clip()`` runs after the last backward (a model whose gradients are summed over ranks by
    hand). No autocast: the precision regime (:mod:`rlhf_core.models.precision`) holds the model in its dtype.

    The host never waits for the device inside a step: the losses and the gradient norm stay on the
    device, the clip and the optimizer step are launched behind the last backward, then
    ``while_device_runs()`` (host work for the next step, e.g. collating its micro-batches) runs while
    the device catches up, and only then are the losses and the norm read, in one transfer.

    A NaN/inf loss or gradient norm (on any rank) raises :class:`NonFiniteError` (naming ``where``, by
    default ``step``, and ``names``) and the optimizer has left the weights as they were: the step is
    launched with a device flag that makes it skip them (:func:`rlhf_core.distributed.parallel.optimizer_step`). (Under
    DeepSpeed the engine clips and steps in one call; its norm is checked after.)
    """
    world = world or World()
    total = world.all_reduce_sum([sum(units_fn(mb) for mb in micro_batches)])[0] if units_fn is not None else 1
    sums: list[torch.Tensor] = []
    counts: list[Any] = []
    extra: torch.Tensor | None = None  # the diagnostics' sum, from zeros
    deepspeed = hasattr(strategy, "last_grad_norm")  # DeepSpeed steps inside its own accumulation count
    for i, mb in enumerate(micro_batches):
        with strategy.accumulating(last=i == len(micro_batches) - 1), phase("forward_backward"):
            loss_sum, n, *diagnostics = loss_fn(strategy.module, mb)
            sums.append(loss_sum.detach().float().reshape(()))
            strategy.backward(loss_sum * (strategy.grad_scale / max(total, 1)))
            if deepspeed:
                strategy.step()
        counts.append(n)
        if diagnostics:
            extra = (torch.zeros_like(diagnostics[0]) if extra is None else extra) + diagnostics[0]
    if before_clip is not None:
        before_clip()
    to_read = torch.stack(sums) if sums else torch.zeros(0)  # the losses, then (not DeepSpeed) the norm
    if not deepspeed:
        with phase("clip"):
            norm = strategy.clip_grad_norm(max_grad_norm)
            to_read = torch.cat([to_read.to(norm.device), norm.reshape(1)])
            # every rank skips if any rank's loss or the (reduced, so common) norm is not finite
            skip = world.max_over_ranks_((~torch.isfinite(to_read)).any().float().reshape(1))
        with phase("optimizer_step"):
            strategy.step(skip=skip.reshape(()))
    if extra is not None:  # then the diagnostics, read in the same transfer (float32 to float64 is exact)
        to_read = torch.cat([to_read.to(extra.device, torch.float64), extra])
    if while_device_runs is not None:
        with phase("while_device_runs"):
            while_device_runs()
    with phase("read_losses"):
        values = to_read.tolist()
    losses, rest = values[:len(sums)], values[len(sums):]
    grad_norm = strategy.last_grad_norm() if deepspeed else rest.pop(0)
    where = where or (f"step {step}" if step is not None else "this step")
    return _checked_stats(strategy, world, losses, rest if extra is not None else None, counts, grad_norm, where,
                          names, normalised=units_fn is not None)


def _checked_stats(strategy: Any, world: Any, losses: list[float], diagnostics: list[float] | None, counts: list[Any],
                   grad_norm: float, where: str, names: tuple[str, str], normalised: bool) -> StepStats:
    """:func:`accumulate_and_step`'s totals over ranks, or its :class:`NonFiniteError` (on every rank alike)."""
    units_total = sum(int(n) for n in counts)
    bad_micro = next((i for i, v in enumerate(losses) if not math.isfinite(v)), -1)
    loss_total, units_total, bad = world.all_reduce_sum([sum(losses, 0.0), units_total, float(bad_micro >= 0)])
    summed = world.all_reduce_sum(diagnostics) if diagnostics is not None else []
    deepspeed = hasattr(strategy, "last_grad_norm")
    applied = ("DeepSpeed applied the step" if deepspeed
               else "stopped before the optimizer step, the last checkpoint is intact")
    if bad:
        strategy.zero_grad()
        raise NonFiniteError(f"{where}: {names[0]} is {loss_total} (micro-batch {bad_micro} on this rank, or "
                             f"another rank's); {applied}")
    if not math.isfinite(grad_norm):
        raise NonFiniteError(f"{where}: {names[1]} is {grad_norm}; {applied}")
    lr = strategy.scheduler.get_last_lr()[0] if strategy.scheduler is not None else float("nan")
    loss = loss_total / max(units_total, 1) if normalised else loss_total
    return StepStats(loss, int(units_total), grad_norm, lr, summed)
