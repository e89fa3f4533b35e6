"""Kahneman-Tversky optimisation (Ethayarajh et al. 2024, "KTO") on unpaired examples.

KTO needs only a thumbs-up or thumbs-down per (prompt, completion), not a pair. Reads top to
bottom: load policy + frozen reference -> unpaired examples (a KTO file, or preference pairs
split into a desirable and an undesirable example each) -> shared train loop with the KTO
loss, whose reference point ``z0`` is re-estimated on every micro-batch from mismatched
(prompt, completion) pairs -> save. The loss math lives in ``rlhf_core.losses``; log-probs
come from ``rlhf_core.logprobs``; optimiser, schedule, accumulation, eval and checkpoints
from ``rlhf_core.trainers.loop``.

Reference log-probs are computed live rather than once up front (as DPO can): the mismatched
pairs behind ``z0`` depend on which examples share a micro-batch, so they cannot be cached.

Run: ``alignflow kto`` (config: ``params.yaml`` section ``kto``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from rlhf_core.config import KTOConfig
from rlhf_core.data.io import DataError, Record, read_records, require_str
from rlhf_core.data.tokenize import TokenizedExample, collate_padded, tokenize_prompt_completion
from rlhf_core.evaluate import evaluate_exact_match
from rlhf_core.logprobs import response_logprobs
from rlhf_core.losses import kto_loss, kto_reference_point
from rlhf_core.models import load_causal_lm, load_tokenizer, pick_device
from rlhf_core.parallel import current_world
from rlhf_core.precision import Precision
from rlhf_core.trainers.loop import EpochSampler, MetricSink, NullSink, run_training, seed_everything


@dataclass(frozen=True)
class UnpairedExample:
    """One KTO example: a prompt, a completion and whether it is desirable."""

    prompt: str
    completion: str
    desirable: bool


@dataclass
class KTOResult:
    """The trained policy's directory and its final metrics."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)


def unpaired_examples(records: Sequence[Record], cfg: KTOConfig, path: str | Path) -> list[UnpairedExample]:
    """KTO examples from ``records``: unpaired rows as they are; a preference pair gives two.

    A row with ``cfg.chosen_field`` and ``cfg.rejected_field`` is a pair (TRL's
    ``unpair_preference_dataset`` does the same split); any other row needs
    ``cfg.completion_field`` and a boolean ``cfg.desirable_field``.
    """
    out: list[UnpairedExample] = []
    for rec in records:
        prompt = require_str(rec, cfg.prompt_field, path)
        if cfg.chosen_field in rec.data and cfg.rejected_field in rec.data:
            out.append(UnpairedExample(prompt, require_str(rec, cfg.chosen_field, path), True))
            out.append(UnpairedExample(prompt, require_str(rec, cfg.rejected_field, path), False))
            continue
        completion = require_str(rec, cfg.completion_field, path)
        if cfg.desirable_field not in rec.data:
            raise DataError(path, rec.line, f"missing (or give {cfg.chosen_field}/{cfg.rejected_field} pairs)",
                            cfg.desirable_field)
        flag = rec.data[cfg.desirable_field]
        if not isinstance(flag, bool):
            raise DataError(path, rec.line, f"must be true or false, got {flag!r}", cfg.desirable_field)
        out.append(UnpairedExample(prompt, completion, flag))
    if not out:
        raise DataError(path, 0, "no examples")
    return out


def train_kto(cfg: KTOConfig, sink: MetricSink | None = None, show_progress: bool = True) -> KTOResult:
    """Optimise ``cfg.model_path`` with KTO and save an HF directory at ``cfg.output_dir``."""
    sink = sink or NullSink()
    seed_everything(cfg.seed, cfg.num_threads)
    device = pick_device()
    precision = Precision.resolve(cfg.precision, device)

    # ---- load: policy, frozen reference (in the policy's compute dtype), unpaired examples -
    tokenizer = load_tokenizer(cfg.model_path)
    model = load_causal_lm(cfg.model_path, device, precision.load_dtype)
    reference = load_causal_lm(cfg.ref_model_path or cfg.model_path, device,
                               precision.weight_dtype).eval().requires_grad_(False)
    examples = unpaired_examples(read_records(cfg.train_file), cfg, cfg.train_file)
    pad = tokenizer.pad_token_id

    def tokenize(prompt: str, completion: str) -> TokenizedExample:
        return tokenize_prompt_completion(tokenizer, prompt, completion, cfg.max_length)

    matched = [tokenize(e.prompt, e.completion) for e in examples]

    # ---- batches: the examples, and the same prompts with the next example's completion --
    sampler = EpochSampler(len(examples), cfg.batch_size, cfg.seed, current_world())

    def next_micro_batch() -> dict[str, Any]:
        idx = sampler.next()
        shifted = idx[1:] + idx[:1]  # KTO Sec. 4.1: y'_i is the completion of another example
        mismatched = [tokenize(examples[i].prompt, examples[j].completion) for i, j in zip(idx, shifted)]
        batch = collate_padded([matched[i] for i in idx] + mismatched, pad)
        batch["desirable"] = torch.tensor([examples[i].desirable for i in idx])
        return batch

    # ---- loss: KTO value on the policy/reference log-ratio ------------------------------
    seen: dict[str, list[float]] = {"z0": [], "good": [], "bad": []}

    def loss_fn(policy: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        desirable = batch["desirable"]
        n = len(desirable)
        logps = response_logprobs(policy, batch)  # (2n,): matched then mismatched
        with torch.no_grad():
            ref = response_logprobs(reference, batch)
        z0 = kto_reference_point(logps[n:].detach(), ref[n:])
        desirable = desirable.to(logps.device)
        losses = kto_loss(logps[:n], ref[:n], desirable, z0, beta=cfg.beta,
                          desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        rewards = cfg.beta * (logps[:n] - ref[:n]).detach()
        seen["z0"].append(float(z0))
        if desirable.any():
            seen["good"].append(float(rewards[desirable].mean()))
        if (~desirable).any():
            seen["bad"].append(float(rewards[~desirable].mean()))
        return losses.sum(), torch.tensor(n)

    def step_metrics() -> dict[str, float]:
        names = {"z0": "train/kl_reference_point", "good": "train/reward_desirable",
                 "bad": "train/reward_undesirable"}
        out = {names[k]: sum(v) / len(v) for k, v in seen.items() if v}
        for v in seen.values():
            v.clear()
        return out

    def evaluate() -> tuple[dict[str, float], list[dict[str, str]]]:
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, prompt_field=cfg.prompt_field,
                                      label_field=cfg.label_field, max_items=cfg.eval_items)
        return result.metrics("eval"), result.samples

    # ---- train, then save -------------------------------------------------------------
    loop = run_training(cfg, "kto", model, tokenizer, next_micro_batch=next_micro_batch, loss_fn=loss_fn,
                        evaluate=evaluate, sink=sink, state={"sampler": sampler}, units_fn=lambda b: len(b["desirable"]),
                        step_metrics=step_metrics, show_progress=show_progress)
    return KTOResult(Path(cfg.output_dir), loop.metrics, loop.eval_samples)
