"""Supervised fine-tuning: next-token NLL on the response tokens of demonstrations.

Reads top to bottom: load -> tokenize -> train loop (batch, accumulate, step, log, eval,
checkpoint) -> save. Runs the same in a plain process, a Prefect task or a Ray worker;
tracking is whatever ``MetricSink`` the caller passes.

Run: ``alignflow sft [--set field=value ...]`` (config: ``params.yaml`` section ``sft``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rlhf_core.config import SFTConfig
from rlhf_core.data.formats import labels_present
from rlhf_core.data.io import read_records
from rlhf_core.data.sequences import rendered_rows, tokenize_labelled_prompts, tokenize_sft_records
from rlhf_core.data.tokenize import TokenizedExample, collate_packed, collate_padded
from rlhf_core.rollout.evaluate import eval_options, evaluate_exact_match
from rlhf_core.models.lm_head import LMHead, labelled_token_logprobs, prepare_kernels
from rlhf_core.algorithms.losses import IGNORE_INDEX
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, pick_device
from rlhf_core.distributed.parallel import current_world
from rlhf_core.models.precision import Precision
from rlhf_core.trainers.batches import EpochSampler, MicroBatches
from rlhf_core.trainers.loop import MetricSink, NullSink
from rlhf_core.trainers.offline import run_training
from rlhf_core.trainers.step import seed_everything


@dataclass
class SFTResult:
    """What an SFT run produced: the model directory and its final metrics."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)
    rendered_examples: list[dict[str, Any]] = field(default_factory=list)
    """The first training sequences as the model saw them (:func:`rlhf_core.data.sequences.rendered_rows`)."""
    eval_answers: dict[str, Any] | None = None
    """The final eval's every greedy answer and their settings (the guard probe reuses them)."""


def nll_loss_fn(head: LMHead) -> Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """The loop's loss: ``(model, batch) -> (summed next-token NLL of the labelled tokens, their count)``.

    ``NLL = - sum_{t: y_t != -100} log p(y_t | x_{<t})`` (Ouyang et al. 2022, Sec. 3.5), each term from
    the LM head as ``head`` runs it (:mod:`rlhf_core.models.lm_head`: chunked or fused, no whole logits).
    """
    def loss_fn(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logp = labelled_token_logprobs(model, batch, head)  # (B, T-1), 0 where unlabelled
        return -logp.sum(), (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    return loss_fn


def _collate(examples: list[TokenizedExample], cfg: SFTConfig, pad_id: int) -> dict[str, torch.Tensor]:
    return collate_packed(examples) if cfg.packing else collate_padded(examples, pad_id)


@torch.no_grad()
def eval_loss(model: Any, examples: list[TokenizedExample], cfg: SFTConfig, pad_id: int,
              head: LMHead = LMHead()) -> float:
    """Token-mean NLL on held-out examples."""
    model.eval()
    total, count = 0.0, 0
    loss_fn = nll_loss_fn(head)
    for start in range(0, len(examples), cfg.batch_size):
        nll, n = loss_fn(model, _collate(examples[start:start + cfg.batch_size], cfg, pad_id))
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
    model = load_causal_lm(cfg.model_path, device, Precision.resolve(cfg.precision, device).load_dtype, cfg.attention)
    head = prepare_kernels(cfg, model)  # fused kernels, and how the LM head scores tokens
    fields = dict(prompt_field=cfg.prompt_field, completion_field=cfg.completion_field,
                  messages_field=cfg.messages_field, max_length=cfg.max_length)
    train = tokenize_sft_records(tokenizer, read_records(cfg.train_file), path=cfg.train_file, **fields)
    # Eval loss: the label is the reference completion of a held-out prompt (none when no item has a label).
    eval_records = read_records(cfg.eval_file, limit=cfg.eval_items)
    labelled = labels_present([r.data.get(cfg.label_field) for r in eval_records], [r.line for r in eval_records],
                              cfg.eval_file, cfg.label_field)
    held_out = tokenize_labelled_prompts(tokenizer, eval_records, path=cfg.eval_file, prompt_field=cfg.prompt_field,
                                         label_field=cfg.label_field, max_length=cfg.max_length) if labelled else []

    # ---- batches: a deterministic reshuffle every epoch; padded, or packed (token budget) --
    sampler = EpochSampler(len(train), cfg.batch_size, cfg.seed, current_world())
    batches = MicroBatches(draw=sampler.next, tokens=lambda i: len(train[i]),
                           collate=lambda idx: _collate([train[i] for i in idx], cfg, tokenizer.pad_token_id))

    def evaluate() -> tuple[Any, ...]:
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, max_items=cfg.eval_items, **eval_options(cfg))
        metrics, samples, answers = result.stage_output()  # every answer too: raft's guard probe reuses them
        if held_out:
            metrics["eval/loss"] = eval_loss(model, held_out, cfg, tokenizer.pad_token_id, head)
        return metrics, samples, answers

    # ---- train, then save ---------------------------------------------------------------
    loop = run_training(cfg, "sft", model, tokenizer, batches=batches, loss_fn=nll_loss_fn(head),
                        evaluate=evaluate, sink=sink, state={"sampler": sampler}, show_progress=show_progress)
    return SFTResult(Path(cfg.output_dir), loop.metrics, loop.eval_samples, rendered_rows(tokenizer, train),
                     loop.eval_answers)
