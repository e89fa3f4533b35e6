"""Reward-model training: Bradley-Terry on (prompt, chosen, rejected) pairs.

Reads top to bottom: load the backbone with a scalar head -> tokenize pairs (held-out split)
-> shared train loop with the pairwise loss -> reward statistics -> save. Reports pairwise
accuracy and mean reward margin on held-out pairs (``eval/reward_accuracy``,
``eval/reward_margin``).

Run: ``alignflow reward`` (config: ``params.yaml`` section ``reward``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import RewardConfig
from rlhf_core.data.formats import PairExample, read_pair_examples
from rlhf_core.data.io import read_records
from rlhf_core.data.sequences import rendered_pair_rows, tokenize_pair_examples
from rlhf_core.data.tokenize import TokenizedExample, collate_pair_batch
from rlhf_core.algorithms.losses import bradley_terry_loss, log_exp_loss
from rlhf_core.models.loading import load_tokenizer, pick_device
from rlhf_core.models.lm_head import prepare_decoder_kernels
from rlhf_core.rewards.model import load_reward_model, pair_rewards, set_normalisation
from rlhf_core.distributed.parallel import current_world
from rlhf_core.models.precision import Precision
from rlhf_core.trainers.batches import EpochSampler, MicroBatches
from rlhf_core.trainers.loop import MetricSink, NullSink
from rlhf_core.trainers.offline import run_training
from rlhf_core.trainers.step import seed_everything

Pair = tuple[TokenizedExample, TokenizedExample]


@dataclass
class RewardResult:
    """The reward model's directory and its held-out metrics."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    rendered_examples: list[dict[str, Any]] = field(default_factory=list)
    """The first pairs as the model saw them, with the token each score is read at
    (:func:`rlhf_core.data.sequences.rendered_pair_rows`)."""


def _margins(examples: list[PairExample], cfg: RewardConfig) -> torch.Tensor:
    return torch.tensor([(e.margin or 0.0) if cfg.use_margin else 0.0 for e in examples])


def read_pairs(cfg: RewardConfig, path: str, limit: int | None = None) -> list[PairExample]:
    """The preference pairs of ``path`` (explicit or implicit prompt, standard or conversational)."""
    return read_pair_examples(read_records(path, limit=limit), path, prompt_field=cfg.prompt_field,
                              chosen_field=cfg.chosen_field, rejected_field=cfg.rejected_field,
                              margin_field=cfg.margin_field)


@torch.no_grad()
def pairwise_metrics(model: Any, pairs: list[Pair], pad_id: int, batch_size: int,
                     packed: bool = False) -> dict[str, float]:
    """Held-out pairwise accuracy (chosen scores higher) and mean margin r_c - r_r."""
    was_training = model.training
    model.eval()
    diffs = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        r = pair_rewards(model, collate_pair_batch(chunk, pad_id, packed))
        diffs.append(r[:len(chunk)] - r[len(chunk):])
    model.train(was_training)
    d = torch.cat(diffs)
    return {"eval/reward_accuracy": float((d > 0).float().mean()), "eval/reward_margin": float(d.mean()),
            "eval/n_pairs": float(len(d))}


def train_reward_model(cfg: RewardConfig, sink: MetricSink | None = None, show_progress: bool = True) -> RewardResult:
    """Train a scalar reward model from ``cfg.model_path`` and save it at ``cfg.output_dir``."""
    sink = sink or NullSink()
    seed_everything(cfg.seed, cfg.num_threads)

    # ---- load: backbone + scalar head, pairs, held-out split ------------------------------
    tokenizer = load_tokenizer(cfg.model_path)
    device = pick_device()
    model = load_reward_model(cfg.model_path, device, Precision.resolve(cfg.precision, device).load_dtype,
                              cfg.attention)
    prepare_decoder_kernels(cfg, model)  # fused RMSNorm/RoPE/SwiGLU and the attention backend on a GPU
    examples = read_pairs(cfg, cfg.train_file)
    if cfg.eval_file:
        train_pairs, eval_pairs = examples, read_pairs(cfg, cfg.eval_file, limit=cfg.eval_items)
    else:
        n_eval = max(1, int(len(examples) * cfg.eval_fraction))
        train_pairs, eval_pairs = examples[:-n_eval], examples[-n_eval:]
    train = tokenize_pair_examples(tokenizer, train_pairs, cfg.max_length)
    held_out = tokenize_pair_examples(tokenizer, eval_pairs, cfg.max_length)
    margins = _margins(train_pairs, cfg)
    pad = tokenizer.pad_token_id

    # ---- batches: a pair is one example (chosen and rejected share a micro-batch) ------------
    sampler = EpochSampler(len(train), cfg.batch_size, cfg.seed, current_world())

    def collate(idx: list[int]) -> dict[str, torch.Tensor]:
        batch = collate_pair_batch([train[i] for i in idx], pad, cfg.packing)
        batch["margin"] = margins[idx]
        return batch

    batches = MicroBatches(draw=sampler.next, collate=collate, tokens=lambda i: len(train[i][0]) + len(train[i][1]))

    # ---- loss: Bradley-Terry on the pair's scalar rewards ---------------------------------
    seen: list[torch.Tensor] = []  # per pair, on the device until a logged step is over (as in dpo.py)

    def loss_fn(rm: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(batch["n_pairs"])
        r = pair_rewards(rm, batch)
        if cfg.loss == "logexp":
            losses = log_exp_loss(r[:n], r[n:])
        else:
            losses = bradley_terry_loss(r[:n], r[n:], batch["margin"].to(r.device) if cfg.use_margin else None)
        seen.append((r[:n] > r[n:]).float().detach())  # per pair: independent of the grouping
        return losses.sum(), torch.tensor(n)

    def step_metrics() -> dict[str, float]:
        values = torch.cat(seen).tolist() if seen else []
        out = {"train/reward_accuracy": sum(values) / max(len(values), 1)}
        seen.clear()
        return out

    def evaluate() -> tuple[dict[str, float], list[dict[str, str]]]:
        return pairwise_metrics(model, held_out, pad, cfg.batch_size, cfg.packing), []

    # ---- train; before the save, store the reward statistics used to normalise scores --------
    def store_normalisation() -> dict[str, float]:
        with torch.no_grad():
            model.eval()
            all_r = torch.cat([pair_rewards(model, collate_pair_batch(train[i:i + cfg.batch_size], pad, cfg.packing))
                               for i in range(0, len(train), cfg.batch_size)])
        set_normalisation(model, float(all_r.mean()), float(all_r.std()))
        return {"reward/mean": float(all_r.mean()), "reward/std": float(all_r.std())}

    loop = run_training(cfg, "reward", model, tokenizer, batches=batches, loss_fn=loss_fn,
                        evaluate=evaluate, sink=sink, state={"sampler": sampler}, units_fn=lambda b: int(b["n_pairs"]),
                        step_metrics=step_metrics, before_save=store_normalisation, show_progress=show_progress)
    return RewardResult(Path(cfg.output_dir), loop.metrics, rendered_pair_rows(tokenizer, train, scored=True))
