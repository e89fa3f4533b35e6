"""Supervised fine-tuning: next-token NLL on the response tokens of demonstrations.

Reads top to bottom: load -> tokenize -> train loop (batch, accumulate, step, log, eval,
checkpoint) -> save. Runs the same in a plain process, a Prefect task or a Ray worker;
tracking is whatever ``MetricSink`` the caller passes.

Run: ``alignflow sft [--set field=value ...]`` (config: ``params.yaml`` section ``sft``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rlhf_core.config import SFTConfig, config_to_dict
from rlhf_core.data.io import read_records
from rlhf_core.data.tokenize import TokenizedExample, collate_packed, collate_padded, tokenize_sft_records
from rlhf_core.evaluate import EvalResult, evaluate_exact_match
from rlhf_core.losses import token_nll_sum
from rlhf_core.models import load_causal_lm, load_tokenizer, pick_device, resolve_precision
from rlhf_core.trainers.loop import (
    MetricSink,
    NullSink,
    Timer,
    accumulate_and_step,
    build_optimizer,
    build_scheduler,
    save_checkpoint,
    save_hf_dir,
    seed_everything,
)


@dataclass
class SFTResult:
    """What an SFT run produced: the model directory and its final metrics."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)


def _nll_loss_fn(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    return token_nll_sum(logits, batch["labels"].to(device))


def _collate(examples: list[TokenizedExample], cfg: SFTConfig, pad_id: int) -> dict[str, torch.Tensor]:
    return collate_packed(examples) if cfg.packing else collate_padded(examples, pad_id)


@torch.no_grad()
def eval_loss(model: Any, examples: list[TokenizedExample], cfg: SFTConfig, pad_id: int) -> float:
    """Token-mean NLL on held-out examples."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), cfg.batch_size):
        nll, n = _nll_loss_fn(model, _collate(examples[start:start + cfg.batch_size], cfg, pad_id))
        total += float(nll)
        count += int(n)
    model.train()
    return total / max(count, 1)


def train_sft(cfg: SFTConfig, sink: MetricSink | None = None, show_progress: bool = True) -> SFTResult:
    """Fine-tune ``cfg.model_path`` on ``cfg.train_file`` and save an HF directory at ``cfg.output_dir``."""
    sink = sink or NullSink()
    seed_everything(cfg.seed, cfg.num_threads)
    device = pick_device()
    autocast_dtype = resolve_precision(cfg.precision, device)

    # ---- load: model, tokenizer, data -------------------------------------------------
    tokenizer = load_tokenizer(cfg.model_path)
    model = load_causal_lm(cfg.model_path, device)
    model.train()
    fields = dict(prompt_field=cfg.prompt_field, completion_field=cfg.completion_field,
                  messages_field=cfg.messages_field, max_length=cfg.max_length)
    train = tokenize_sft_records(tokenizer, read_records(cfg.train_file), path=cfg.train_file, **fields)
    eval_records = read_records(cfg.eval_file, limit=cfg.eval_items)
    # Eval loss: the label is the reference completion of a held-out prompt.
    held_out = tokenize_sft_records(tokenizer, eval_records, path=cfg.eval_file,
                                    **{**fields, "completion_field": cfg.label_field})

    # ---- optimisation state -----------------------------------------------------------
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    generator = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []

    def next_micro_batch() -> dict[str, torch.Tensor]:
        nonlocal order
        if len(order) < cfg.batch_size:  # new epoch: reshuffle deterministically
            order = order + torch.randperm(len(train), generator=generator).tolist()
        idx, order = order[:cfg.batch_size], order[cfg.batch_size:]
        return _collate([train[i] for i in idx], cfg, tokenizer.pad_token_id)

    eval_seconds = 0.0

    def run_eval(step: int) -> EvalResult:
        nonlocal eval_seconds
        started = Timer()
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, prompt_field=cfg.prompt_field,
                                      label_field=cfg.label_field, max_items=cfg.eval_items)
        metrics = {**result.metrics("eval"), "eval/loss": eval_loss(model, held_out, cfg, tokenizer.pad_token_id)}
        sink.log_metrics(metrics, step)
        last_metrics.update(metrics)
        eval_seconds += started.total()
        return result

    # ---- train loop -------------------------------------------------------------------
    last_metrics: dict[str, float] = {}
    timer, tokens_seen = Timer(), 0
    bar = tqdm(range(1, cfg.max_steps + 1), desc="sft", disable=not show_progress, mininterval=2.0)
    for step in bar:
        micro = [next_micro_batch() for _ in range(cfg.grad_accum)]
        stats = accumulate_and_step(model, micro, _nll_loss_fn, optimizer, scheduler,
                                    max_grad_norm=cfg.max_grad_norm, autocast_dtype=autocast_dtype)
        tokens_seen += sum(int(mb["input_ids"].numel()) for mb in micro)
        if step % 10 == 0 or step == cfg.max_steps:
            elapsed = timer.total() - eval_seconds  # training time only
            sink.log_metrics({"train/loss": stats.loss, "train/grad_norm": stats.grad_norm, "train/lr": stats.lr,
                              "perf/tokens_per_s": tokens_seen / max(elapsed, 1e-9),
                              "perf/elapsed_s": elapsed}, step)
            bar.set_postfix(loss=f"{stats.loss:.3f}", lr=f"{stats.lr:.1e}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.max_steps:
            run_eval(step)
        if cfg.save_every and step % cfg.save_every == 0:
            save_checkpoint(cfg.checkpoint_dir, step, model, tokenizer, optimizer, scheduler)
    train_seconds = timer.total() - eval_seconds

    # ---- final eval and save ----------------------------------------------------------
    final = run_eval(cfg.max_steps)
    metrics = {**last_metrics, "train/loss_final": stats.loss, "perf/train_seconds": train_seconds,
               "perf/tokens_per_s": tokens_seen / max(train_seconds, 1e-9)}
    sink.log_metrics({"perf/train_seconds": train_seconds}, cfg.max_steps)
    # Only deterministic content next to the weights, so DVC md5s repeat across runs.
    save_hf_dir(model, tokenizer, cfg.output_dir,
                extra={"stage": "sft", "config": config_to_dict(cfg), "base_model": str(cfg.model_path)})
    return SFTResult(Path(cfg.output_dir), metrics, final.samples)
