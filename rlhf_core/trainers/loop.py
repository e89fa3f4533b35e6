"""Loop pieces every trainer shares: seeding, optimizer, schedule, accumulation, checkpoints.

A trainer (SFT, DPO, KTO, reward model, distillation; RL has its own body) supplies its data as
:class:`MicroBatches` (draw examples, count their tokens, collate a group) and a function that maps
a micro-batch to ``(loss_sum, n_units)``, and gets the rest from here, so micro-batching (a token
budget with packing), gradient accumulation, clipping, the schedule and checkpoint format are
written once.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import random
import secrets
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from rlhf_core.data.tokenize import group_by_tokens
from rlhf_core.models.precision import Precision

log = logging.getLogger(__name__)

MetricsFn = Callable[[dict[str, float], int], None]


def phase(name: str) -> Any:
    """A named range of the loop's host work in a torch.profiler trace (``alignflow#<name>``, next to
    torch's own ``Optimizer.step#...``), so a profile says which part of a step the host was in while
    the device waited; a few microseconds when no profiler runs."""
    return torch.profiler.record_function(f"alignflow#{name}")


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


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, precision: Precision | None = None, *,
                    parallel: str = "ddp", distributed: bool = False) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019) with no decay on biases, norms and embeddings' 1-D params.

    ``precision`` (a :class:`rlhf_core.models.precision.Precision`; None: fp32) ``mixed`` or ``bf16`` with
    ``parallel`` ddp: a :class:`rlhf_core.models.precision.MasterWeightAdamW` whose masters are taken from the
    model's weights as they are now, after which the model's parameters are cast to bf16 (so build
    it on the model as loaded, fp32 under mixed). Its fp32 gradient-accumulation hooks are on only
    when ``distributed`` is False: DDP (or a hand all-reduce) must see the gradients in ``.grad``.
    Under ZeRO (``parallel`` zero2/zero3) the plain AdamW: DeepSpeed's bf16 mode casts the model and
    keeps the masters (:class:`rlhf_core.distributed.parallel.DeepSpeedStrategy`).
    """
    from rlhf_core.models.precision import MasterWeightAdamW, Precision, cast_parameters

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
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps, min_lr_rate=min_lr_ratio
    )


def load_policy_and_reference(cfg: Any, device: torch.device) -> tuple[Any, Any]:
    """The policy a preference trainer trains (``cfg.model_path``, in its precision's load dtype) and the
    frozen reference (``cfg.ref_model_path`` or the policy's start, in the compute dtype, no gradients)."""
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.models.precision import Precision

    precision = Precision.resolve(cfg.precision, device)
    policy = load_causal_lm(cfg.model_path, device, precision.load_dtype)
    reference = load_causal_lm(cfg.ref_model_path or cfg.model_path, device, precision.weight_dtype)
    return policy, reference.eval().requires_grad_(False)



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
    from rlhf_core.distributed.parallel import World

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


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


def save_hf_dir(model: Any, tokenizer: Any, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Save model + tokenizer as an HF directory atomically and durably (temp folder, fsync, rename).

    A crash mid-save leaves the previous directory intact, never a half-written one; the temp
    folder has a unique name (pid and random suffix), is removed on failure, and those of killed
    writers are swept before writing. A full or read-only disk raises
    :class:`rlhf_core.tracking.checkpoint.StorageError`. ``extra`` is written as ``alignflow.json`` beside
    the weights (deterministic content only: no timestamps, so DVC md5s repeat).
    """
    from rlhf_core.tracking.checkpoint import fsync_tree, replace_dir, storage_guard, sweep_temps, temp_sibling

    out_dir = Path(out_dir)
    tmp = temp_sibling(out_dir)
    try:
        with storage_guard(out_dir, "cannot write the trained model to"):
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            sweep_temps(out_dir.parent, lambda name: name == out_dir.name)
            model.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
            if extra is not None:
                (tmp / "alignflow.json").write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
            fsync_tree(tmp)
            replace_dir(tmp, out_dir)  # fsyncs the parent after the rename
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only still there if something above failed
    return out_dir


@dataclass
class StorageNeeds:
    """What a run will write, for the loop's free-space preflight: its output folder and sizes in bytes."""

    output_dir: Path
    checkpoint_bytes: int
    """one checkpoint (weights and fp32 Adam moments), an estimate"""
    output_bytes: int
    """the final model (weights), an estimate"""


def estimate_state_bytes(model: torch.nn.Module, masters: bool = False) -> tuple[int, int]:
    """``(checkpoint, output)`` bytes of ``model``: its weights, plus two fp32 Adam moments per trainable
    parameter in a checkpoint, and with ``masters`` (mixed precision) an fp32 master per trainable
    parameter in a checkpoint and fp32 trained weights in the output (the model holds bf16 now).
    Tokenizer files and RNG state are left out (small next to a real model's weights), so for a
    micro model this is well under the real size."""
    params = list(model.parameters())  # tied weights are listed once
    # under ZeRO-3 a rank holds a slice of each parameter; ds_numel is the whole one's size
    numel = [getattr(p, "ds_numel", None) or p.numel() for p in params]
    weights = sum(n * p.element_size() for n, p in zip(numel, params))
    moments = sum(2 * 4 * n for n, p in zip(numel, params) if p.requires_grad)
    if not masters:
        return weights + moments, weights
    trained = sum(n for n, p in zip(numel, params) if p.requires_grad)
    return weights + moments + 4 * trained, weights + 2 * trained


def preflight_storage(plan: LoopPlan, checkpointer: Any, body: Any) -> None:
    """Before training (rank 0): refuse with :class:`StorageError` unless the checkpoint folder and the
    output's parent are writable (a probe file is created and removed) and have free space for
    ``(keep + 1)`` checkpoints (the newest is written before the oldest is pruned; fewer when the run
    saves fewer) and the output, less what this run's folder already holds (a resume replaces it)."""
    from rlhf_core.tracking.checkpoint import StorageError, storage_guard

    needs = body.storage_needs()
    saves = plan.max_steps // plan.save_every if plan.save_every else 1  # 1: a SIGTERM checkpoint
    n_ckpt = min(checkpointer.keep + 1, max(saves, 1))
    held = checkpointer.bytes_held()
    demands = [(Path(checkpointer.root), max(0, n_ckpt * needs.checkpoint_bytes - held)),
               (Path(needs.output_dir).parent, needs.output_bytes)]
    per_device: dict[int, tuple[Path, int]] = {}
    for folder, need in demands:
        with storage_guard(folder, f"{plan.name}: cannot write to"):
            folder.mkdir(parents=True, exist_ok=True)
            # secrets, not random: the run's seeded random stream must not move
            probe = folder / f".alignflow-probe-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                probe.write_bytes(b"probe")
            finally:
                probe.unlink(missing_ok=True)
        device = folder.stat().st_dev
        first, total = per_device.get(device, (folder, 0))
        per_device[device] = (first, total + need)
    for folder, need in per_device.values():
        free = shutil.disk_usage(folder).free
        if free < need:
            raise StorageError(errno.ENOSPC, f"{plan.name}: {folder} has {free:,} bytes free; this run needs about "
                                             f"{need:,} ({n_ckpt} checkpoint(s) of ~{needs.checkpoint_bytes:,} bytes "
                                             f"and an output of ~{needs.output_bytes:,}); free space or set "
                                             f"checkpoint_dir / output_dir on a larger disk. Refused before training")


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


@dataclass
class MicroBatches:
    """How an offline trainer's data becomes a step's micro-batches (the loop draws, groups and collates).

    A step draws ``grad_accum`` times, so its examples are the same with or without packing. Without
    a token budget each draw is one micro-batch; with one (``micro_batch_tokens``) the step's examples
    are regrouped by :func:`group_by_tokens`. An example is whatever ``collate`` takes: a dataset
    index, or an index with its partner (a DPO pair travels as one example, so it is never split).
    """

    draw: Callable[[], list[Any]]
    """this rank's examples of the next ``batch_size`` draw (``EpochSampler.next``, or items made from it)"""
    collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    """a micro-batch (padded or packed, as the config says) of some examples"""
    tokens: Callable[[Any], int]
    """an example's token count once collated packed (both sequences of a pair)"""
    ahead: bool = True
    """draw and collate the next step's micro-batches while the device runs this step's (False where a draw
    runs the model, as KTO's reference point does: it must see the weights this step leaves)"""


@dataclass
class EmptyMicroBatch:
    """A micro-batch that adds nothing to a step: run so this rank joins a backward the others run.

    DDP reduces gradients in the last backward of a step and ZeRO in every backward, so all ranks
    must run as many micro-batches; a rank whose examples fit in fewer runs these (a one-token
    forward whose loss is multiplied by 0) until it has the count every rank agreed on.
    """

    input_ids: torch.Tensor
    """``(1, 1)``: one token of one of this rank's real micro-batches"""


def real_tokens(batch: Any) -> int:
    """Non-padding tokens of a micro-batch (``perf/tokens_per_s`` means the same padded or packed)."""
    if isinstance(batch, EmptyMicroBatch):
        return 0
    if "n_tokens" in batch:  # pairs as prefix trees (collate_pair_tree): their sequences' tokens, as padded
        return int(batch["n_tokens"])
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


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
# The one checkpointed loop: offline trainers and RL run their steps through it
# --------------------------------------------------------------------------------------


class Resumable(Protocol):
    """Trainer-side state the loop checkpoints beside the model (a sampler, a controller)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LoopClock:
    """Wall-clock seconds of a run, split into training and evaluation (eval time is not training)."""

    def __init__(self) -> None:
        self.timer, self.eval_seconds = Timer(), 0.0

    def train_seconds(self) -> float:
        return self.timer.total() - self.eval_seconds

    def total_seconds(self) -> float:
        return self.timer.total()


class TrainingBody(Protocol):
    """A trainer as :func:`run_checkpointed` sees it: a step, an evaluation, its state and its final save."""

    def restore(self, ckpt: Any) -> None:
        """Load a checkpoint (found and fingerprint-checked by the loop): weights, optimizers, objects."""

    def train_step(self, step: int, clock: LoopClock) -> dict[str, float] | None:
        """One optimizer step (an RL iteration); returns the metrics to log at ``step``, or None."""

    def progress(self, metrics: dict[str, float]) -> dict[str, str]:
        """The progress bar's postfix for the metrics a step logged."""

    def evaluate(self, step: int) -> tuple[Any, ...]:
        """Held-out metrics and sample answers of the current weights, and optionally a third item: the record of
        every greedy answer (:meth:`rlhf_core.rollout.evaluate.EvalResult.stage_output`), which the final eval hands to
        the stage so its guard probe need not answer the same items again."""

    def checkpoint(self) -> tuple[Any, Any, dict[str, Any]] | None:
        """``(model, tokenizer, state)`` to write at a checkpoint; None where this rank writes nothing."""

    def save_final(self) -> None:
        """Write the trained model to its output directory (every rank calls it; rank 0 writes)."""

    def storage_needs(self) -> StorageNeeds:
        """The output folder and estimated checkpoint and output sizes (the loop's disk preflight)."""


@dataclass
class LoopPlan:
    """When the loop steps, evaluates, checkpoints and resumes (a trainer config's loop fields)."""

    name: str
    max_steps: int
    eval_every: int
    save_every: int
    resume: bool
    eval_at_start: bool = False


@dataclass
class LoopOutcome:
    """What the loop hands back: the last evaluation, timings, where the run started and the trainer's result.

    Recorded as JSON in the checkpoint folder's ``finished.json`` with the final model, so a retry after the
    final save (the stage's tracking failed) gets the same outcome back without training again."""

    eval_metrics: dict[str, float]
    eval_samples: list[dict[str, str]]
    train_seconds: float
    total_seconds: float
    resumed_from_step: int = 0
    result_metrics: dict[str, float] = field(default_factory=dict)
    """the trainer's own result metrics (``run_checkpointed``'s ``result_metrics``), taken after the final save"""
    reused: bool = False
    """True when nothing was trained: this is the recorded outcome of the run that saved the output"""
    eval_answers: dict[str, Any] | None = None
    """the final eval's greedy answers with their settings (:class:`rlhf_core.rollout.evaluate.GreedyAnswers`), if it gave them"""


def run_checkpointed(plan: LoopPlan, checkpointer: Any, body: TrainingBody, *, sink: MetricSink,
                     world: Any = None, show_progress: bool = True,
                     result_metrics: Callable[[float], dict[str, float]] | None = None) -> LoopOutcome:
    """Run ``body`` for ``plan.max_steps`` steps with resume, SIGTERM, checkpoints, evals and logging.

    Per step: ``body.train_step`` -> log its metrics -> eval every ``plan.eval_every`` steps ->
    checkpoint every ``plan.save_every`` steps (and on SIGTERM, then stop). With ``plan.resume``
    the newest checkpoint of this run's fingerprint is restored first and the loop continues
    after its step, so an interrupted run ends with the weights and metrics of an uninterrupted
    one. At the end: a final eval, ``body.save_final()``, then ``result_metrics(train_seconds)`` (the
    trainer's own result metrics, read from its state), and rank 0 records the outcome as finished
    (:meth:`rlhf_core.tracking.checkpoint.Checkpointer.mark_finished`). The checkpoints stay: the stage clears
    them once it has tracked and registered the model, and a retry before that (``plan.resume``) finds
    the record and hands back the recorded outcome (``reused``) instead of training again. Every rank
    of a data-parallel ``world`` runs this; rank 0 alone holds the run's lock, writes checkpoints and
    logs. Evaluation time is kept out of ``perf/train_seconds``.
    """
    from rlhf_core.tracking.checkpoint import TrainingInterrupted, sigterm_checkpoints
    from rlhf_core.distributed.parallel import World

    world = world or World()
    clock, evals = LoopClock(), _Evaluations(body, sink)
    with checkpointer.hold(plan.name) if world.is_main else nullcontext():
        reused = _reuse_finished(plan, checkpointer, world)
        if reused is not None:
            return reused
        if world.is_main:  # a full or read-only disk is refused now, not after hours of training
            preflight_storage(plan, checkpointer, body)
        start = _resume(plan, checkpointer, body, sink, evals, world)
        if plan.eval_at_start and start == 1:
            evals.run(0, clock)
        bar = tqdm(range(start, plan.max_steps + 1), desc=plan.name, disable=not show_progress, mininterval=2.0)
        with sigterm_checkpoints() as stop:
            for step in bar:
                metrics = body.train_step(step, clock)
                if metrics:
                    with phase("log_metrics"):
                        sink.log_metrics(metrics, step)
                        bar.set_postfix(body.progress(metrics))
                if plan.eval_every and step % plan.eval_every == 0 and step != plan.max_steps:
                    evals.run(step, clock)
                if (plan.save_every and step % plan.save_every == 0) or stop.requested:
                    path = _save(checkpointer, body, step, evals, world)
                    world.barrier()  # no rank runs ahead of a checkpoint it might have to resume from
                if stop.requested:
                    raise TrainingInterrupted(f"{plan.name}: stopped by SIGTERM after step {step}; resume from {path}")
                inject_fault(plan.name, step)
        train_seconds = clock.train_seconds()
        evals.run(plan.max_steps, clock)
        sink.log_metrics({"perf/train_seconds": train_seconds, "perf/total_seconds": clock.total_seconds()},
                         plan.max_steps)
        body.save_final()
        outcome = LoopOutcome(dict(evals.metrics), evals.samples, train_seconds, clock.total_seconds(), start - 1,
                              result_metrics(train_seconds) if result_metrics is not None else {},
                              eval_answers=evals.answers)
        if world.is_main:  # only once the final model is in place; kept until the stage's tracking is done
            checkpointer.mark_finished(plan.max_steps, body.storage_needs().output_dir, asdict(outcome))
        world.barrier()
    return outcome


def _reuse_finished(plan: LoopPlan, checkpointer: Any, world: Any) -> LoopOutcome | None:
    """With ``plan.resume``, the recorded outcome of this run if it already saved its final model and that
    output is unchanged (its stage failed after the final save, e.g. in tracking); else None: train.
    Rank 0 reads the record and decides for every rank (the others return an empty outcome)."""
    if not plan.resume:
        return None
    outcome = None
    found = checkpointer.finished() if world.is_main else None
    if found is not None:
        try:
            outcome = LoopOutcome(**{**found.outcome, "reused": True})
        except TypeError as exc:  # recorded by a version whose LoopOutcome had other fields
            log.warning("%s: the finished record in %s does not fit this version (%s); training again",
                        plan.name, checkpointer.root, exc)
    if not world.all_reduce_sum([float(outcome is not None)])[0]:
        return None
    if outcome is None:  # a rank other than 0: rank 0's outcome is the run's
        return LoopOutcome({}, [], 0.0, 0.0, reused=True)
    log.warning("%s: reusing the finished output of this run, %s (saved after step %d; the stage stopped before its "
                "tracking was done), instead of training again", plan.name, found.output_dir, found.step)
    return outcome


class _Evaluations:
    """Runs, logs and times ``body.evaluate``; keeps the latest metrics (checkpointed) and samples."""

    def __init__(self, body: TrainingBody, sink: MetricSink):
        self.body, self.sink = body, sink
        self.metrics: dict[str, float] = {}
        self.samples: list[dict[str, str]] = []
        self.answers: dict[str, Any] | None = None

    def run(self, step: int, clock: LoopClock) -> None:
        started = Timer()
        out = self.body.evaluate(step)
        metrics, self.samples = out[0], out[1]
        self.answers = out[2] if len(out) > 2 else None
        self.sink.log_metrics(metrics, step)
        self.metrics.update(metrics)
        clock.eval_seconds += started.total()


def _resume(plan: LoopPlan, checkpointer: Any, body: TrainingBody, sink: MetricSink, evals: _Evaluations,
            world: Any) -> int:
    """Restore the newest checkpoint of this run when ``plan.resume``; returns the first step to run."""
    from rlhf_core.tracking.checkpoint import set_rng_state

    found = checkpointer.latest() if plan.resume else None
    if found is None:
        return 1
    body.restore(found)
    evals.metrics.update(found.state["loop"]["eval_metrics"])
    # each rank its own generators (dropout draws differ per rank); a rank the writing world did not
    # have (resuming on more workers) takes rank 0's
    ranks, rank = found.state.get("rng_ranks") or [found.state["rng"]], world.rank
    set_rng_state(ranks[rank] if rank < len(ranks) else ranks[0])
    log.warning("%s: resuming from %s (step %d of %d)", plan.name, found.path, found.step, plan.max_steps)
    sink.log_metrics({"checkpoint/resumed_from_step": float(found.step)}, found.step)
    return found.step + 1


def _save(checkpointer: Any, body: TrainingBody, step: int, evals: _Evaluations, world: Any) -> Path | None:
    """Write a checkpoint of ``step`` (the body's state plus the loop's own); None where this rank writes none."""
    from rlhf_core.tracking.checkpoint import rng_state

    rngs = world.gather_to_main(rng_state())  # before the body's collectives: same order on every rank
    written = body.checkpoint()
    if written is None:
        return None
    model, tokenizer, state = written
    state = {**state, "loop": {**state.get("loop", {}), "eval_metrics": dict(evals.metrics)}, "rng_ranks": rngs}
    return checkpointer.save(step, model, tokenizer, state)


# --------------------------------------------------------------------------------------
# Offline trainers (SFT, reward model, DPO, KTO, distillation): accumulate-and-step bodies
# --------------------------------------------------------------------------------------


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
    from rlhf_core.tracking.checkpoint import Checkpointer, run_fingerprint
    from rlhf_core.distributed.parallel import current_world

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
        from rlhf_core.models.loading import prepare_for_training
        from rlhf_core.distributed.parallel import build_strategy
        from rlhf_core.models.precision import Precision

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
        from rlhf_core.tracking.checkpoint import read_weights

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
        from rlhf_core.models.loading import enable_checkpointing, resolve_checkpointing

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
        from rlhf_core.config import config_to_dict
        from rlhf_core.common.redact import redact_secrets
        from rlhf_core.models.loading import merged_model

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


def inject_fault(stage: str, step: int | str) -> None:
    """Test hook: ``ALIGNFLOW_FAULT=<stage>:<step>[:<marker file>]`` raises after that step.

    ``<step>`` may also be ``tracking``: :func:`rlhf_core.stages.wrappers._train_stage` fires that one after the
    model is saved and before it is logged and registered (a tracking server lost at that point).

    With a marker file the fault fires once (the file is created when it fires), which is how
    the tests make a Prefect task fail on its first attempt and succeed on its retry. With
    ``ALIGNFLOW_FAULT_RANK=r`` only data-parallel rank ``r`` fires; with ``ALIGNFLOW_FAULT_SIGNAL=KILL``
    the process SIGKILLs itself instead of raising (a worker dying with no handler run), with ``STOP``
    it SIGSTOPs itself (a worker that hangs). Unset in
    normal use: the cost is one environment lookup per step.
    """
    spec = os.environ.get("ALIGNFLOW_FAULT")
    if not spec:
        return
    parts = spec.split(":", 2)
    if len(parts) < 2 or parts[0] != stage or parts[1] != str(step):
        return
    only_rank = os.environ.get("ALIGNFLOW_FAULT_RANK")
    if only_rank is not None:
        from rlhf_core.distributed.parallel import current_world

        if current_world().rank != int(only_rank):
            return
    if len(parts) == 3:
        marker = Path(parts[2])
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{stage}:{step}\n")
    how = os.environ.get("ALIGNFLOW_FAULT_SIGNAL")
    if how in ("KILL", "STOP"):  # STOP: the process freezes, alive but silent (a hung rank)
        import signal

        os.kill(os.getpid(), signal.SIGKILL if how == "KILL" else signal.SIGSTOP)
    raise InjectedFault(f"{stage}: fault injected after step {step} (ALIGNFLOW_FAULT={spec})")


class InjectedFault(RuntimeError):
    """Raised by :func:`inject_fault`; Prefect treats it as transient and retries."""
