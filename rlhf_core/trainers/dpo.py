"""Direct preference optimisation: DPO, IPO and cDPO on (prompt, chosen, rejected) pairs.

Reads top to bottom: load policy + reference -> tokenize pairs -> reference log-probs
(precomputed once, or live) -> shared train loop with the pairwise loss -> save. The loss
math lives in ``rlhf_core.algorithms.losses.preference_loss``; log-probs come from
``rlhf_core.algorithms.logprobs``; optimiser, schedule, accumulation, eval and checkpoints from
``rlhf_core.trainers.offline`` — the same pieces SFT uses.

Run: ``alignflow dpo`` (config: ``params.yaml`` section ``dpo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import DPOConfig
from rlhf_core.data.io import read_records
from rlhf_core.data.sequences import rendered_pair_rows, tokenize_preference_records
from rlhf_core.data.tokenize import TokenizedExample, collate_pair_batch
from rlhf_core.rollout.evaluate import eval_options, evaluate_exact_match
from rlhf_core.models.lm_head import LMHead, prepare_kernels
from rlhf_core.algorithms.logprobs import reference_logprobs, response_logprobs, response_token_counts
from rlhf_core.algorithms.losses import PreferenceLoss, preference_loss
from rlhf_core.models.loading import load_tokenizer, pick_device
from rlhf_core.distributed.parallel import current_world
from rlhf_core.trainers.batches import EpochSampler, MicroBatches
from rlhf_core.trainers.loop import MetricSink, NullSink
from rlhf_core.trainers.offline import load_policy_and_reference, run_training
from rlhf_core.trainers.step import seed_everything


@dataclass
class DPOResult:
    """The trained policy's directory and its final metrics."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)
    rendered_examples: list[dict[str, Any]] = field(default_factory=list)
    """The first pairs as the model saw them (:func:`rlhf_core.data.sequences.rendered_pair_rows`)."""
    eval_answers: dict[str, Any] | None = None
    """The final eval's every greedy answer and their settings (the guard probe reuses them)."""


def precompute_reference_logps(reference: Any, pairs: list[tuple[TokenizedExample, TokenizedExample]], pad: int,
                               batch_size: int, average: bool, packed: bool = False,
                               head: LMHead = LMHead()) -> torch.Tensor:
    """The frozen reference's log-probs of every pair's chosen and rejected response, in one pass.

    ``pairs`` are tokenized preference records, collated ``batch_size`` at a time (each chunk holds
    its chosen sequences before its rejected ones; prefix trees, or one ``packed`` row); ``average``
    takes per-token means instead of sums.
    Returns ``(n_pairs, 2)``: column 0 chosen, column 1 rejected, rows in ``pairs`` order.
    """
    chunks = [collate_pair_batch(pairs[i:i + batch_size], pad, packed) for i in range(0, len(pairs), batch_size)]
    flat = reference_logprobs(reference, chunks, average=average, head=head)
    sizes = [int(c["n_pairs"]) for c in chunks]
    per_chunk = torch.split(flat, [2 * n for n in sizes])
    return torch.stack([torch.cat([p[:n] for p, n in zip(per_chunk, sizes)]),
                        torch.cat([p[n:] for p, n in zip(per_chunk, sizes)])], dim=1)


class _PairRewards:
    """The implicit rewards of the pairs trained since the last logged step (per pair, so the logged means do
    not depend on how pairs were grouped into micro-batches). Kept on the device and read once a logged step
    is over: a read per micro-batch would make the host wait for each forward before queueing its backward."""

    def __init__(self) -> None:
        self.seen: dict[str, list[torch.Tensor]] = {"acc": [], "margin": [], "chosen": [], "rejected": []}

    def add(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        for key, value in (("acc", (chosen > rejected).float()), ("margin", chosen - rejected),
                           ("chosen", chosen), ("rejected", rejected)):
            self.seen[key].append(value.detach())

    def means(self) -> dict[str, float]:
        values = {k: torch.cat(v).tolist() if v else [] for k, v in self.seen.items()}
        for v in self.seen.values():
            v.clear()
        return {f"train/reward_{k}" if k != "acc" else "train/reward_accuracy": sum(v) / max(len(v), 1)
                for k, v in values.items()}


def train_dpo(cfg: DPOConfig, sink: MetricSink | None = None, show_progress: bool = True) -> DPOResult:
    """Optimise ``cfg.model_path`` on preference pairs and save an HF directory at ``cfg.output_dir``."""
    sink = sink or NullSink()
    seed_everything(cfg.seed, cfg.num_threads)
    kind = PreferenceLoss(cfg.loss)
    average = kind is PreferenceLoss.IPO and cfg.ipo_average_logps
    device = pick_device()

    # ---- load: policy, frozen reference (in the policy's compute dtype), pairs -----------
    tokenizer = load_tokenizer(cfg.model_path)
    model, reference = load_policy_and_reference(cfg, device)  # the reference in the policy's compute dtype
    head = prepare_kernels(cfg, model, reference)  # fused kernels, and how the LM head scores tokens
    pairs = tokenize_preference_records(tokenizer, read_records(cfg.train_file), path=cfg.train_file,
                                        prompt_field=cfg.prompt_field, chosen_field=cfg.chosen_field,
                                        rejected_field=cfg.rejected_field, max_length=cfg.max_length,
                                        margin_field=cfg.margin_field)
    pad = tokenizer.pad_token_id

    # ---- reference log-probs: once up front (then the reference is freed), or live -------
    ref_logps: torch.Tensor | None = None
    if cfg.precompute_reference:
        ref_logps = precompute_reference_logps(reference, pairs, pad, cfg.batch_size, average, cfg.packing, head)
        reference = None  # (pairs, 2) kept; the model is freed

    # ---- batches: a pair is one example (chosen and rejected share a micro-batch) ------------
    sampler = EpochSampler(len(pairs), cfg.batch_size, cfg.seed, current_world())

    def collate(idx: list[int]) -> dict[str, torch.Tensor]:
        batch = collate_pair_batch([pairs[i] for i in idx], pad, cfg.packing)
        if ref_logps is not None:
            batch["ref_logps"] = ref_logps[idx]  # (B, 2)
        return batch

    batches = MicroBatches(draw=sampler.next, collate=collate, tokens=lambda i: len(pairs[i][0]) + len(pairs[i][1]))

    # ---- loss: pairwise on policy vs reference log-ratios ----------------------------------
    seen = _PairRewards()

    def loss_fn(policy: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(batch["n_pairs"])
        logps = response_logprobs(policy, batch, average=average, head=head)
        if "ref_logps" in batch:
            ref = batch["ref_logps"].to(logps.device)
            ref_c, ref_r = ref[:, 0], ref[:, 1]
        else:
            with torch.no_grad():
                live = response_logprobs(reference, batch, average=average, head=head)
            ref_c, ref_r = live[:n], live[n:]
        out = preference_loss(kind, logps[:n], logps[n:], ref_c, ref_r, beta=cfg.beta,
                              label_smoothing=cfg.label_smoothing)
        loss_sum = out.losses.sum()
        if cfg.nll_weight > 0:  # RPO-style per-token NLL on the chosen response (Pang et al. 2024)
            n_tok = response_token_counts(batch)[:n].clamp(min=1).to(logps.device)
            chosen_mean = logps[:n] if average else logps[:n] / n_tok
            loss_sum = loss_sum - cfg.nll_weight * chosen_mean.sum()
        seen.add(out.chosen_rewards, out.rejected_rewards)
        return loss_sum, torch.tensor(n)

    def evaluate() -> tuple[Any, ...]:
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, max_items=cfg.eval_items, **eval_options(cfg))
        return result.stage_output()  # metrics, samples, every answer (the guard probe reuses them)

    # ---- train, then save -----------------------------------------------------------------
    loop = run_training(cfg, "dpo", model, tokenizer, batches=batches, loss_fn=loss_fn,
                        evaluate=evaluate, sink=sink, state={"sampler": sampler}, units_fn=lambda b: int(b["n_pairs"]),
                        step_metrics=seen.means, show_progress=show_progress)
    return DPOResult(Path(cfg.output_dir), loop.metrics, loop.eval_samples, rendered_pair_rows(tokenizer, pairs),
                     loop.eval_answers)
