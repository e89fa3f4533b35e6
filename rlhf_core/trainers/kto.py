"""Kahneman-Tversky optimisation (Ethayarajh et al. 2024, "KTO") on unpaired examples.

KTO needs only a thumbs-up or thumbs-down per (prompt, completion), not a pair. Reads top to
bottom: load policy + frozen reference -> unpaired examples (a KTO file, or preference pairs
split into a desirable and an undesirable example each) -> shared train loop with the KTO
loss, whose reference point ``z0`` is re-estimated on every draw of ``batch_size`` examples from
mismatched (prompt, completion) pairs -> save. The loss math lives in ``rlhf_core.algorithms.losses``; log-probs
come from ``rlhf_core.algorithms.logprobs``; optimiser, schedule, accumulation, eval and checkpoints
from ``rlhf_core.trainers.offline`` (with ``step``, ``batches`` and ``loop``).

Reference log-probs are computed live rather than once up front (as DPO can): the mismatched
pairs behind ``z0`` depend on which examples share a draw, so they cannot be cached. ``z0`` is
computed per draw before the draw's examples are grouped into micro-batches, so padded, packed
and token-budget micro-batches train on the same values.

Run: ``alignflow kto`` (config: ``params.yaml`` section ``kto``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rlhf_core.config import KTOConfig
from rlhf_core.data.formats import UnpairedExample, completion_text, prompt_text, read_unpaired_examples
from rlhf_core.data.io import DataError, Record, read_records
from rlhf_core.data.sequences import SAMPLE_ROWS, rendered_row
from rlhf_core.data.tokenize import TokenizedExample, collate_packed, collate_padded, tokenize_prompt_completion
from rlhf_core.rollout.evaluate import eval_options, evaluate_exact_match
from rlhf_core.models.lm_head import LMHead, prepare_kernels
from rlhf_core.algorithms.logprobs import response_logprobs
from rlhf_core.algorithms.losses import kto_loss, kto_reference_point
from rlhf_core.models.loading import load_tokenizer, pick_device
from rlhf_core.distributed.parallel import current_world
from rlhf_core.data.tokenize import group_by_tokens
from rlhf_core.trainers.batches import EpochSampler, MicroBatches
from rlhf_core.trainers.loop import MetricSink, NullSink
from rlhf_core.trainers.offline import load_policy_and_reference, run_training
from rlhf_core.trainers.step import seed_everything


@dataclass
class KTOResult:
    """The trained policy's directory and its final metrics."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)
    rendered_examples: list[dict[str, Any]] = field(default_factory=list)
    """The first examples as the model saw them, each with its flag (:func:`rlhf_core.data.sequences.rendered_row`)."""
    eval_answers: dict[str, Any] | None = None
    """The final eval's every greedy answer and their settings (the guard probe reuses them)."""


def unpaired_examples(records: Sequence[Record], cfg: KTOConfig, path: str | Path) -> list[UnpairedExample]:
    """KTO examples from ``records`` (:func:`rlhf_core.data.formats.read_unpaired_examples` with ``cfg``'s
    field names): unpaired rows as they are; a preference pair gives two (TRL's
    ``unpair_preference_dataset`` does the same split); standard or conversational."""
    out = read_unpaired_examples(records, path, prompt_field=cfg.prompt_field, completion_field=cfg.completion_field,
                                 desirable_field=cfg.desirable_field, chosen_field=cfg.chosen_field,
                                 rejected_field=cfg.rejected_field)
    if not out:
        raise DataError(path, 0, "no examples")
    return out


@torch.no_grad()
def draw_reference_point(policy: Any, reference: Any, mismatched: list[TokenizedExample],
                         collate: Callable[[list[TokenizedExample]], dict[str, torch.Tensor]], budget: int,
                         head: LMHead = LMHead()) -> float:
    """KTO's ``z0`` for one draw (Sec. 4.1) from its ``mismatched`` sequences (prompt x_i, completion y'_i
    of another example), in forwards of at most ``budget`` tokens (0: one forward).

    Per draw rather than per micro-batch, so a token budget that regroups the draw's examples leaves it
    unchanged; ``z0`` takes no gradient, so these sequences never enter a backward pass.
    """
    lengths = [len(s) for s in mismatched]
    groups = [collate([mismatched[k] for k in g]) for g in group_by_tokens(lengths, budget or sum(lengths))]
    policy_logps = torch.cat([response_logprobs(policy, b, head=head) for b in groups])
    ref_logps = torch.cat([response_logprobs(reference, b, head=head) for b in groups])
    return float(kto_reference_point(policy_logps, ref_logps))


def train_kto(cfg: KTOConfig, sink: MetricSink | None = None, show_progress: bool = True) -> KTOResult:
    """Optimise ``cfg.model_path`` with KTO and save an HF directory at ``cfg.output_dir``."""
    sink = sink or NullSink()
    seed_everything(cfg.seed, cfg.num_threads)
    device = pick_device()

    # ---- load: policy, frozen reference (in the policy's compute dtype), unpaired examples -
    tokenizer = load_tokenizer(cfg.model_path)
    model, reference = load_policy_and_reference(cfg, device)  # the reference in the policy's compute dtype
    head = prepare_kernels(cfg, model, reference)  # fused kernels, and how the LM head scores tokens
    examples = unpaired_examples(read_records(cfg.train_file), cfg, cfg.train_file)
    pad = tokenizer.pad_token_id
    # rendered once: a mismatched pair joins one example's prompt with another's answer (as the model reads them)
    prompts = [prompt_text(tokenizer, e.prompt) for e in examples]
    answers = [completion_text(tokenizer, e.prompt, e.completion) for e in examples]

    def tokenize(i: int, j: int) -> TokenizedExample:  # prompt of example i, answer of example j
        return tokenize_prompt_completion(tokenizer, prompts[i], answers[j], cfg.max_length)

    matched = [tokenize(i, i) for i in range(len(examples))]

    # ---- batches: each draw's reference point z0, then its examples in micro-batches ------
    sampler = EpochSampler(len(examples), cfg.batch_size, cfg.seed, current_world())

    def collate_sequences(sequences: list[TokenizedExample]) -> dict[str, torch.Tensor]:
        return collate_packed(sequences) if cfg.packing else collate_padded(sequences, pad)

    def draw() -> list[tuple[int, float]]:  # this rank's examples of one draw, each with the draw's z0
        idx = sampler.next()
        partners = idx[1:] + idx[:1]  # KTO Sec. 4.1: y'_i is the completion of another example
        mismatched = [tokenize(i, j) for i, j in zip(idx, partners)]
        z0 = draw_reference_point(model, reference, mismatched, collate_sequences, cfg.micro_batch_tokens, head)
        return [(i, z0) for i in idx]

    def collate(drawn: list[tuple[int, float]]) -> dict[str, Any]:
        batch = collate_sequences([matched[i] for i, _ in drawn])
        batch["desirable"] = torch.tensor([examples[i].desirable for i, _ in drawn])
        batch["z0"] = torch.tensor([z0 for _, z0 in drawn])
        return batch

    # not drawn ahead: a draw's z0 is measured on the policy as the previous step left it
    batches = MicroBatches(draw=draw, collate=collate, tokens=lambda e: len(matched[e[0]]), ahead=False)

    # ---- loss: KTO value on the policy/reference log-ratio ------------------------------
    seen: dict[str, list[float]] = {"z0": [], "good": [], "bad": []}

    def loss_fn(policy: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logps = response_logprobs(policy, batch, head=head)  # (n,)
        with torch.no_grad():
            ref = response_logprobs(reference, batch, head=head)
        desirable, z0 = batch["desirable"].to(logps.device), batch["z0"].to(logps.device)
        losses = kto_loss(logps, ref, desirable, z0, beta=cfg.beta,
                          desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        rewards = cfg.beta * (logps - ref).detach()
        # per example, so the logged means do not depend on how examples were grouped
        seen["z0"].extend(batch["z0"].tolist())
        seen["good"].extend(rewards[desirable].tolist())
        seen["bad"].extend(rewards[~desirable].tolist())
        return losses.sum(), torch.tensor(len(desirable))

    def step_metrics() -> dict[str, float]:
        names = {"z0": "train/kl_reference_point", "good": "train/reward_desirable",
                 "bad": "train/reward_undesirable"}
        out = {names[k]: sum(v) / len(v) for k, v in seen.items() if v}
        for v in seen.values():
            v.clear()
        return out

    def evaluate() -> tuple[Any, ...]:
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, max_items=cfg.eval_items, **eval_options(cfg))
        return result.stage_output()  # metrics, samples, every answer (the guard probe reuses them)

    # ---- train, then save -------------------------------------------------------------
    loop = run_training(cfg, "kto", model, tokenizer, batches=batches, loss_fn=loss_fn,
                        evaluate=evaluate, sink=sink, state={"sampler": sampler}, units_fn=lambda b: len(b["desirable"]),
                        step_metrics=step_metrics, show_progress=show_progress)
    rendered = [{**rendered_row(tokenizer, matched[i]), "desirable": examples[i].desirable}
                for i in range(min(SAMPLE_ROWS, len(examples)))]
    return KTOResult(Path(cfg.output_dir), loop.metrics, loop.eval_samples, rendered, loop.eval_answers)
