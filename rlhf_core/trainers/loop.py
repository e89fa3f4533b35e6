"""The one checkpointed loop every trainer runs its steps through: resume, SIGTERM, periodic evaluation,
checkpoints, the final save.

A trainer supplies a :class:`TrainingBody` (a step, an evaluation, its state, its final save) and gets the
rest from :func:`run_checkpointed`: the offline trainers through :func:`rlhf_core.trainers.offline.run_training`,
RL through :class:`rlhf_core.trainers.rl`'s iteration. Here too: the metric sinks, the free-space preflight,
the atomic HF save; after each step the loop fires the fault-injection test hook (:mod:`rlhf_core.common.faults`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from tqdm.auto import tqdm

from rlhf_core.common.faults import inject_fault
from rlhf_core.distributed.parallel import World, current_world
from rlhf_core.tracking.checkpoint import (
    StorageError, TrainingInterrupted, fsync_tree, replace_dir, rng_state, set_rng_state, sigterm_checkpoints,
    storage_guard, sweep_temps, temp_sibling)
from rlhf_core.trainers.step import phase

log = logging.getLogger(__name__)

MetricsFn = Callable[[dict[str, float], int], None]


class MetricSink(Protocol):
    """Where a trainer sends metrics (an MLflow run, a local file, or nothing)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


class NullSink:
    """Discards metrics (a trainer run with no tracking)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        del metrics, step


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
                inject_fault(plan.name, step, rank=lambda: current_world().rank)
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
    rngs = world.gather_to_main(rng_state())  # before the body's collectives: same order on every rank
    written = body.checkpoint()
    if written is None:
        return None
    model, tokenizer, state = written
    state = {**state, "loop": {**state.get("loop", {}), "eval_metrics": dict(evals.metrics)}, "rng_ranks": rngs}
    return checkpointer.save(step, model, tokenizer, state)


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
