"""Knowledge distillation: match a teacher's next-token distributions, optionally with NLL.

Reads top to bottom: load student + frozen teacher (same vocabulary, checked) -> tokenize
the sequences -> shared train loop with the token-level KL of
``rlhf_core.algorithms.losses.distillation_loss`` -> save. Optimiser, schedule, accumulation, eval and
checkpoints come from ``rlhf_core.trainers.offline``, as for every offline trainer.

On the embedded default the teacher is the DPO model and the student the SFT model, trained
on the SFT demonstrations: where a demonstration is wrong, the teacher's distribution still
puts its mass on the right answer, so the student learns the teacher's behaviour rather
than the demonstrator's. With a user's models the teacher is usually larger.

Run: ``alignflow distill`` (config: ``params.yaml`` section ``distill``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import DistillConfig
from rlhf_core.data.io import read_records
from rlhf_core.data.sequences import rendered_rows, tokenize_sft_records
from rlhf_core.data.tokenize import collate_packed, collate_padded
from rlhf_core.rollout.evaluate import eval_options, evaluate_exact_match
from rlhf_core.algorithms.logprobs import MODEL_INPUTS
from rlhf_core.algorithms.losses import IGNORE_INDEX, distillation_loss
from rlhf_core.models.loading import ModelLoadError, load_causal_lm, load_tokenizer, pick_device
from rlhf_core.distributed.parallel import current_world
from rlhf_core.models.precision import Precision
from rlhf_core.trainers.batches import EpochSampler, MicroBatches
from rlhf_core.trainers.loop import MetricSink, NullSink
from rlhf_core.trainers.offline import run_training
from rlhf_core.trainers.step import seed_everything


@dataclass
class DistillResult:
    """The student's directory and its final metrics."""

    output_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    eval_samples: list[dict[str, str]] = field(default_factory=list)
    rendered_examples: list[dict[str, Any]] = field(default_factory=list)
    """The first training sequences as the model saw them (:func:`rlhf_core.data.sequences.rendered_rows`)."""
    eval_answers: dict[str, Any] | None = None
    """The final eval's every greedy answer and their settings (the guard probe reuses them)."""


def check_same_vocabulary(student_path: str | Path, student_tok: Any, teacher_path: str | Path, teacher_tok: Any) -> None:
    """Token-level KL needs one vocabulary: same tokens at the same ids, or a clear error."""
    if student_tok.get_vocab() != teacher_tok.get_vocab():
        raise ModelLoadError(f"{teacher_path}: teacher's tokenizer differs from the student's ({student_path}); "
                             "token-level distillation needs the same vocabulary")


def train_distill(cfg: DistillConfig, sink: MetricSink | None = None, show_progress: bool = True) -> DistillResult:
    """Distil ``cfg.teacher_path`` into ``cfg.model_path``; save an HF directory at ``cfg.output_dir``."""
    sink = sink or NullSink()
    seed_everything(cfg.seed, cfg.num_threads)
    device = pick_device()
    precision = Precision.resolve(cfg.precision, device)

    # ---- load: student, frozen teacher (in the student's compute dtype), sequences -------
    tokenizer = load_tokenizer(cfg.model_path)
    check_same_vocabulary(cfg.model_path, tokenizer, cfg.teacher_path, load_tokenizer(cfg.teacher_path))
    model = load_causal_lm(cfg.model_path, device, precision.load_dtype, cfg.attention)
    teacher = load_causal_lm(cfg.teacher_path, device, precision.weight_dtype, cfg.attention)
    teacher.eval().requires_grad_(False)
    if teacher.config.vocab_size != model.config.vocab_size:
        raise ModelLoadError(f"{cfg.teacher_path}: vocab_size {teacher.config.vocab_size} != student's "
                             f"{model.config.vocab_size} ({cfg.model_path})")
    train = tokenize_sft_records(tokenizer, read_records(cfg.train_file), path=cfg.train_file,
                                 prompt_field=cfg.prompt_field, completion_field=cfg.completion_field,
                                 messages_field=cfg.messages_field, max_length=cfg.max_length)

    # ---- batches: padded, or packed (token budget); teacher and student read the same rows --
    sampler = EpochSampler(len(train), cfg.batch_size, cfg.seed, current_world())

    def collate(idx: list[int]) -> dict[str, torch.Tensor]:
        examples = [train[i] for i in idx]
        return collate_packed(examples) if cfg.packing else collate_padded(examples, tokenizer.pad_token_id)

    batches = MicroBatches(draw=sampler.next, collate=collate, tokens=lambda i: len(train[i]))

    # ---- loss: KL(teacher || student) per labelled token, mixed with NLL ----------------
    def loss_fn(student: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
        labels = batch["labels"].to(device)
        with torch.no_grad():
            teacher_logits = teacher(**inputs, use_cache=False).logits
        logits = student(**inputs, use_cache=False).logits
        n_tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
        mean = distillation_loss(logits, teacher_logits, labels, temperature=cfg.temperature,
                                 nll_weight=cfg.nll_weight)
        return mean * n_tokens, n_tokens  # the loop wants a sum over its units (tokens)

    def evaluate() -> tuple[Any, ...]:
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, max_items=cfg.eval_items, **eval_options(cfg))
        return result.stage_output()  # metrics, samples, every answer (the guard probe reuses them)

    # ---- train, then save ---------------------------------------------------------------
    loop = run_training(cfg, "distill", model, tokenizer, batches=batches, loss_fn=loss_fn,
                        evaluate=evaluate, sink=sink, state={"sampler": sampler},
                        lineage={"teacher": str(cfg.teacher_path)}, show_progress=show_progress)
    return DistillResult(Path(cfg.output_dir), loop.metrics, loop.eval_samples, rendered_rows(tokenizer, train),
                         loop.eval_answers)
