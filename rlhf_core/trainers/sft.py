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

from rlhf_core.config import SFTConfig
from rlhf_core.data.io import read_records
from rlhf_core.data.tokenize import TokenizedExample, collate_packed, collate_padded, tokenize_sft_records
from rlhf_core.evaluate import evaluate_exact_match
from rlhf_core.logprobs import MODEL_INPUTS
from rlhf_core.losses import token_nll_sum
from rlhf_core.models import load_causal_lm, load_tokenizer, pick_device
from rlhf_core.parallel import current_world
from rlhf_core.precision import Precision
from rlhf_core.trainers.loop import EpochSampler, MetricSink, NullSink, run_training, seed_everything


@dataclass
class SFTResult:
    """What an SFT run produced: the model directory and its final metrics."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)


def _nll_loss_fn(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
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

    # ---- load: model, tokenizer, data -------------------------------------------------
    tokenizer = load_tokenizer(cfg.model_path)
    device = pick_device()
    model = load_causal_lm(cfg.model_path, device, Precision.resolve(cfg.precision, device).load_dtype)
    fields = dict(prompt_field=cfg.prompt_field, completion_field=cfg.completion_field,
                  messages_field=cfg.messages_field, max_length=cfg.max_length)
    train = tokenize_sft_records(tokenizer, read_records(cfg.train_file), path=cfg.train_file, **fields)
    eval_records = read_records(cfg.eval_file, limit=cfg.eval_items)
    # Eval loss: the label is the reference completion of a held-out prompt.
    held_out = tokenize_sft_records(tokenizer, eval_records, path=cfg.eval_file,
                                    **{**fields, "completion_field": cfg.label_field})

    # ---- batches: a deterministic reshuffle every epoch ---------------------------------
    sampler = EpochSampler(len(train), cfg.batch_size, cfg.seed, current_world())

    def next_micro_batch() -> dict[str, torch.Tensor]:
        idx = sampler.next()
        return _collate([train[i] for i in idx], cfg, tokenizer.pad_token_id)

    def evaluate() -> tuple[dict[str, float], list[dict[str, str]]]:
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, prompt_field=cfg.prompt_field,
                                      label_field=cfg.label_field, max_items=cfg.eval_items)
        return {**result.metrics("eval"), "eval/loss": eval_loss(model, held_out, cfg, tokenizer.pad_token_id)}, \
            result.samples

    # ---- train, then save ---------------------------------------------------------------
    loop = run_training(cfg, "sft", model, tokenizer, next_micro_batch=next_micro_batch, loss_fn=_nll_loss_fn,
                        evaluate=evaluate, sink=sink, state={"sampler": sampler}, show_progress=show_progress)
    return SFTResult(Path(cfg.output_dir), loop.metrics, loop.eval_samples)
