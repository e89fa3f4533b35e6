"""Typed stage configs: one dataclass per stage, loaded from ``params.yaml``, overridable.

``params.yaml`` is also DVC's params file, so the values a stage ran with are recorded in
``dvc.lock`` and in the stage's MLflow run. Each section of the YAML maps onto one dataclass
below; every field has a one-line docstring, and ``__post_init__`` rejects values a user
could plausibly get wrong with a message that names the section and field.

Command-line overrides use ``--set field=value`` (YAML syntax for the value), e.g.
``alignflow sft --set lr=3e-4 --set max_steps=200``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from rlhf_core.data.io import MAX_LINE_BYTES
from rlhf_core.common.shown import shown

if typing.TYPE_CHECKING:  # annotations only; imported at run time inside RLConfig's checks
    from rlhf_core.rewards.sources import RewardKind
    from rlhf_core.algorithms.rl_math import AdvantageEstimator


class ConfigError(ValueError):
    """A config value or key that cannot be used; the message names file, section and field."""


def _check(condition: bool, section: str, name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{section}.{name}: {message}")


# --------------------------------------------------------------------------------------
# Stage configs
# --------------------------------------------------------------------------------------


@dataclass
class GenerateConfig:
    """``generate``: write the embedded task's datasets."""

    out_dir: str = "data/embedded"
    """Folder that receives sft.jsonl, preferences.jsonl, prompts.jsonl and eval.jsonl."""
    seed: int = 1234
    """Seed of the problem draw and of the noisy demonstrations."""
    n_sft: int = 10000
    """Number of SFT demonstrations."""
    n_preference: int = 2000
    """Number of preference pairs (chosen correct, rejected a plausible error)."""
    n_prompts: int = 1000
    """Number of RL prompts with labels."""
    n_eval: int = 1000
    """Number of held-out evaluation items (disjoint from every training split)."""
    sft_noise: float = 0.25
    """Fraction of SFT demonstrations given a plausible wrong answer (scattered errors)."""
    sft_flaw: float = 0.6
    """Probability that a sorting demonstration of flaw_min_len+ digits is written in descending
    order: one systematic demonstrator mistake that greedy SFT imitates and alignment removes."""
    flaw_min_len: int = 6
    """Sorting inputs with at least this many digits are subject to the systematic flaw."""
    sort_fraction: float = 0.5
    """Fraction of problems that are digit sorting (the rest are arithmetic)."""
    sort_min_len: int = 3
    """Fewest digits in a sorting problem."""
    sort_max_len: int = 8
    """Most digits in a sorting problem."""
    ops: str = "+-*"
    """Operators of arithmetic problems (any of + - *)."""
    min_add: int = 0
    """Smallest operand of + and -."""
    max_add: int = 99
    """Largest operand of + and -."""
    min_mul_left: int = 0
    """Smallest left operand of *."""
    max_mul_left: int = 99
    """Largest left operand of *."""
    min_mul_right: int = 0
    """Smallest right operand of *."""
    max_mul_right: int = 9
    """Largest right operand of *."""

    def __post_init__(self) -> None:
        s = "generate"
        for name in ("n_sft", "n_preference", "n_prompts", "n_eval"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _check(0.0 <= self.sft_noise < 1.0, s, "sft_noise", f"must be in [0, 1), got {self.sft_noise}")
        _check(0.0 <= self.sft_flaw < 1.0, s, "sft_flaw", f"must be in [0, 1), got {self.sft_flaw}")
        _check(self.flaw_min_len >= 1, s, "flaw_min_len", f"must be >= 1, got {self.flaw_min_len}")
        _check(0.0 <= self.sort_fraction <= 1.0, s, "sort_fraction", f"must be in [0, 1], got {self.sort_fraction}")
        _check(1 <= self.sort_min_len <= self.sort_max_len, s, "sort_max_len",
               f"must be >= sort_min_len ({self.sort_min_len}) >= 1, got {self.sort_max_len}")
        _check(bool(self.ops) and set(self.ops) <= set("+-*"), s, "ops", f"must be a non-empty subset of '+-*', got {self.ops!r}")
        for lo, hi in (("min_add", "max_add"), ("min_mul_left", "max_mul_left"), ("min_mul_right", "max_mul_right")):
            _check(0 <= getattr(self, lo) <= getattr(self, hi), s, hi,
                   f"must be >= {lo} ({getattr(self, lo)}) and {lo} >= 0, got {getattr(self, hi)}")


@dataclass
class ModelConfig:
    """``init-model``: build the embedded tiny model and its tokenizer."""

    out_dir: str = "models/base"
    """Folder of the saved HF model directory (weights, config, tokenizer)."""
    corpus_file: str = "data/embedded/sft.jsonl"
    """JSONL whose prompt+completion text trains the tokenizer."""
    arch: str = "qwen2"
    """Architecture: qwen2 or llama (stock transformers classes)."""
    vocab_size: int = 320
    """Target BPE vocabulary size (byte alphabet + specials + merges)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 6
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 384
    """MLP hidden width."""
    max_positions: int = 64
    """Maximum sequence length the model supports."""
    seed: int = 0
    """Seed of the weight initialisation."""
    added_tokens: list[str] = field(default_factory=list)
    """Strings added to the tokenizer as single (non-special) tokens, e.g. a tool call's tags; empty: none."""

    def __post_init__(self) -> None:
        s = "model"
        _check(all(isinstance(t, str) and t and not t.isspace() for t in self.added_tokens), s, "added_tokens",
               f"must be non-blank strings, got {self.added_tokens!r}")
        _check(self.arch in ("qwen2", "llama"), s, "arch", f"must be 'qwen2' or 'llama', got {self.arch!r}")
        _check(self.vocab_size >= 260, s, "vocab_size", f"must be >= 260 (byte alphabet + specials), got {self.vocab_size}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.hidden_size % self.num_heads == 0, s, "hidden_size",
               f"must be divisible by num_heads ({self.num_heads}), got {self.hidden_size}")
        _check(self.num_heads % self.num_kv_heads == 0, s, "num_kv_heads",
               f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")


@dataclass
class DataFields:
    """Field names of a user's dataset (renamable so user data needs no conversion)."""

    prompt_field: str = "prompt"
    """Field holding the prompt text."""
    completion_field: str = "completion"
    """Field holding the target completion (SFT)."""
    messages_field: str = "messages"
    """Field holding a chat as a list of {role, content}; used when present instead of prompt/completion."""
    label_field: str = "label"
    """Field holding the checkable answer (RL prompts, eval)."""
    chosen_field: str = "chosen"
    """Field holding the preferred response (preference pairs)."""
    rejected_field: str = "rejected"
    """Field holding the dispreferred response (preference pairs)."""
    margin_field: str = "margin"
    """Optional numeric field: how much better chosen is than rejected."""
    max_field_chars: int = 20000
    """Longest text field (a message list: its contents together) the dataset gate accepts, in characters."""
    max_line_bytes: int = MAX_LINE_BYTES
    """Longest JSON Lines line read, in bytes, checked before parsing: a longer line is refused unread."""

    def __post_init__(self) -> None:
        self._check_limits("data")

    def _check_limits(self, s: str) -> None:
        """The size limits' checks, for the ``__post_init__`` of each config built on these fields."""
        for name in ("max_field_chars", "max_line_bytes"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")


PRECISIONS = ("auto", "fp32", "mixed", "bf16")
SWITCHES = ("auto", "on", "off")
LM_HEADS = ("auto", "chunked", "liger", "full")


@dataclass
class TrainerConfig(DataFields):
    """Fields every trainer shares: data, model, optimisation, evaluation, checkpoints."""

    section: ClassVar[str] = "trainer"

    model_path: str = "models/base"
    """HF model directory to start from (the embedded model or a user's)."""
    train_file: str = "data/embedded/sft.jsonl"
    """Training data: JSONL, parquet or a saved `datasets` folder."""
    eval_file: str = "data/embedded/eval.jsonl"
    """Held-out prompts with labels for accuracy (and prompt/completion for eval loss)."""
    output_dir: str = "models/sft"
    """Where the final HF model directory is written."""
    checkpoint_dir: str = "checkpoints/sft"
    """Where periodic checkpoints (safetensors + trainer state) go; kept out of DVC outputs."""
    max_steps: int = 500
    """Optimizer steps to train (deterministic budget; wall time is logged, not used)."""
    batch_size: int = 128
    """Examples (sequences, or pairs for preference losses) per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (global batch = batch_size * grad_accum * world size)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine decay)."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    max_length: int = 64
    """Sequences longer than this (in tokens) are truncated from the right."""
    precision: str = "auto"
    """auto (mixed on a bf16-capable GPU, fp32 otherwise), fp32, mixed (fp32 master weights held by the optimizer,
    the bf16 model updated from them once per step) or bf16 (bf16 weights, fp32 AdamW moments; TRL's default)."""
    eval_every: int = 0
    """Steps between evaluations (0: only at the end)."""
    log_every: int = 10
    """Steps between train/* and perf/* metric points (and at the last step)."""
    eval_items: int = 1000
    """Held-out items used for accuracy (greedy exact match)."""
    save_every: int = 50
    """Steps between checkpoints (0: none; a SIGTERM still writes one). Removed once the final model is saved."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep while the run is going."""
    resume: bool = True
    """Continue an interrupted run (same config and inputs) from its newest complete checkpoint."""
    num_threads: int = 2
    """torch intra-op threads on CPU (fixed, so results are reproducible)."""
    seed: int = 0
    """Seed of data order and dropout."""
    num_workers: int = 1
    """Data-parallel training workers. Above 1 they run as Ray actors forming one torch.distributed world
    (local Ray, or the cluster ``RAY_ADDRESS`` names); the global batch stays batch_size x grad_accum."""
    parallel: str = "ddp"
    """How workers share a step when num_workers > 1: ddp (torch DDP), zero2 or zero3 (DeepSpeed ZeRO)."""
    offload_optimizer: bool = False
    """zero2/zero3 only: keep optimizer state in CPU memory (DeepSpeed's CPU AdamW)."""
    gradient_checkpointing: str | bool = "auto"
    """auto, on or off (true/false read as on/off): recompute activations in backward (less memory, about 30%
    more compute); auto turns it on only when a micro-batch's estimated memory exceeds the device's, and logs why."""
    fused_kernels: str | bool = "auto"
    """auto, on or off (YAML's bare on/off are booleans: read as on/off): liger-kernel's Triton RMSNorm, RoPE and SwiGLU in the decoder; auto uses them on a CUDA
    device when liger-kernel is installed (the ``gpu`` extra), on fails if they cannot be used."""
    compile_layers: str | bool = "auto"
    """auto, on or off (bare on/off read as on/off): each decoder layer through ``torch.compile`` (inductor; one
    graph serves every layer) in the passes without a KV cache: training, reference and old log-probs, reward
    scores. auto compiles on a CUDA device for one process or DDP, not under ZeRO-2/3 or for LoRA; on fails under
    ZeRO-3. The first step pays the compile (seconds; BENCHMARKS.md); a failure to trace or compile the forward falls
    back to the eager layers with a warning (one in compiling the backward surfaces at the first backward: set off)."""
    lm_head: str = "auto"
    """How log-probs leave the LM head: chunked (no [tokens x vocab] tensor is kept; each chunk is recomputed in
    backward), liger (its fused linear cross-entropy), full (whole logits: the reference path) or auto (liger where
    fused kernels are on, every rank holds the whole head and no entropy gradient is asked: RL's logged entropy is
    computed beside it without one; else the labelled positions' logits whole while they stay under 2 GiB in
    float32, past that chunked)."""
    logit_chunk_tokens: int = 4096
    """Rows per LM-head chunk on the chunked and liger paths (bounds a chunk's [chunk x vocab] logits: float32
    on the chunked path, the weights' dtype in liger's kernel)."""
    packing: bool = False
    """Padding-free micro-batches: sequences concatenated, position ids restarting per sequence (on a GPU through
    torch's variable-length flash kernel). Without it SFT, KTO and distillation pad their rows, and DPO and the
    reward model lay each pair out as a prefix tree, its shared prompt once (``collate_pair_tree``)."""
    micro_batch_tokens: int = 0
    """With packing: token budget of a micro-batch; a step's batch_size x grad_accum examples are split
    into as many micro-batches as that takes (0: batch_size examples per micro-batch)."""
    lora_rank: int = 0
    """LoRA rank r of adapters on every linear layer (peft); 0 trains all weights. The saved model is merged."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: updates are scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch's input."""

    def __post_init__(self) -> None:
        s = self.section
        self._check_limits(s)
        _check(self.num_workers >= 1, s, "num_workers", f"must be >= 1, got {self.num_workers}")
        _check(self.batch_size >= self.num_workers, s, "batch_size",
               f"must be >= num_workers ({self.num_workers}): each worker takes rows of every micro-batch")
        _check(self.parallel in ("ddp", "zero2", "zero3"), s, "parallel",
               f"must be ddp, zero2 or zero3, got {self.parallel!r}")
        _check(self.offload_optimizer is False or self.parallel != "ddp", s, "offload_optimizer",
               "needs parallel zero2 or zero3 (DDP keeps optimizer state on the device)")
        _check(self.lora_rank >= 0, s, "lora_rank", f"must be >= 0, got {self.lora_rank}")
        _check(self.lora_alpha > 0, s, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        _check(0.0 <= self.lora_dropout < 1.0, s, "lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        for name in ("max_steps", "batch_size", "grad_accum", "max_length", "eval_items", "num_threads",
                     "keep_checkpoints", "log_every"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every"):
            _check(getattr(self, name) >= 0, s, name, f"must be >= 0, got {getattr(self, name)}")
        _check(self.lr > 0, s, "lr", f"must be > 0, got {self.lr}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, s, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(self.weight_decay >= 0, s, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.max_grad_norm >= 0, s, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        _check(self.precision in PRECISIONS, s, "precision",
               f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("gradient_checkpointing", "fused_kernels", "compile_layers"):  # YAML 1.1: bare on/off are booleans
            if isinstance(getattr(self, name), bool):
                setattr(self, name, "on" if getattr(self, name) else "off")
        for name, allowed in (("gradient_checkpointing", SWITCHES), ("fused_kernels", SWITCHES),
                              ("compile_layers", SWITCHES), ("lm_head", LM_HEADS)):
            _check(getattr(self, name) in allowed, s, name,
                   f"must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        _check(self.logit_chunk_tokens >= 1, s, "logit_chunk_tokens", f"must be >= 1, got {self.logit_chunk_tokens}")
        _check(self.micro_batch_tokens >= 0, s, "micro_batch_tokens", f"must be >= 0, got {self.micro_batch_tokens}")
        _check(self.micro_batch_tokens == 0 or self.packing, s, "micro_batch_tokens",
               "a token budget needs packing: true (padded micro-batches hold batch_size rows)")


@dataclass
class SFTConfig(TrainerConfig):
    """``sft``: supervised fine-tuning on demonstrations, loss on completion tokens only."""

    section: ClassVar[str] = "sft"


@dataclass
class DPOConfig(TrainerConfig):
    """``dpo``: direct preference optimisation (DPO, IPO or cDPO) on preference pairs."""

    section: ClassVar[str] = "dpo"

    model_path: str = "models/sft"
    """Policy to start from (usually the SFT model)."""
    ref_model_path: str = ""
    """Frozen reference model; empty means the starting policy."""
    train_file: str = "data/embedded/preferences.jsonl"
    """Preference pairs (prompt, chosen, rejected)."""
    output_dir: str = "models/dpo"
    """Where the final HF model directory is written."""
    checkpoint_dir: str = "checkpoints/dpo"
    """Where periodic checkpoints go."""
    max_steps: int = 200
    """Optimizer steps to train."""
    batch_size: int = 32
    """Preference pairs per micro-batch."""
    lr: float = 3e-5
    """Peak learning rate of AdamW (2e-4 collapsed the embedded SFT model: keep it small)."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    loss: str = "dpo"
    """dpo, ipo or cdpo (see rlhf_core.algorithms.losses.PreferenceLoss)."""
    beta: float = 0.1
    """DPO/cDPO inverse temperature; IPO's tau."""
    label_smoothing: float = 0.0
    """cDPO's assumed fraction of flipped preference labels, in [0, 0.5)."""
    nll_weight: float = 1.0
    """Weight of a per-token NLL term on the chosen response (RPO; 0 disables)."""
    precompute_reference: bool = True
    """Compute reference log-probs once before training (else live, every step)."""
    ipo_average_logps: bool = False
    """IPO on per-token mean log-probs (TRL's choice) instead of sums (the paper's)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.section
        _check(self.loss in ("dpo", "ipo", "cdpo"), s, "loss", f"must be dpo, ipo or cdpo, got {self.loss!r}")
        _check(self.beta > 0, s, "beta", f"must be > 0, got {self.beta}")
        _check(0.0 <= self.label_smoothing < 0.5, s, "label_smoothing",
               f"must be in [0, 0.5), got {self.label_smoothing}")
        _check(self.nll_weight >= 0, s, "nll_weight", f"must be >= 0, got {self.nll_weight}")


@dataclass
class RewardConfig(TrainerConfig):
    """``reward``: a scalar reward model trained on preference pairs (Bradley-Terry)."""

    section: ClassVar[str] = "reward"

    model_path: str = "models/sft"
    """Causal-LM backbone to start from (its LM head is replaced by a scalar head)."""
    train_file: str = "data/embedded/preferences.jsonl"
    """Preference pairs (prompt, chosen, rejected, optional margin)."""
    eval_file: str = ""
    """Held-out preference pairs; empty means the last eval_fraction of train_file."""
    eval_fraction: float = 0.1
    """Fraction of train_file held out when eval_file is empty."""
    output_dir: str = "models/reward"
    """Where the reward model's HF directory is written."""
    checkpoint_dir: str = "checkpoints/reward"
    """Where periodic checkpoints go."""
    max_steps: int = 300
    """Optimizer steps to train."""
    batch_size: int = 32
    """Preference pairs per micro-batch."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    loss: str = "sigmoid"
    """sigmoid (Bradley-Terry, honours margin) or logexp."""
    use_margin: bool = True
    """Subtract the pair's margin field (when present) inside the sigmoid."""
    eval_items: int = 1000
    """Held-out pairs used for accuracy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.loss in ("sigmoid", "logexp"), self.section, "loss",
               f"must be sigmoid or logexp, got {self.loss!r}")
        _check(0.0 < self.eval_fraction < 1.0, self.section, "eval_fraction",
               f"must be in (0, 1), got {self.eval_fraction}")


@dataclass
class KTOConfig(TrainerConfig):
    """``kto``: Kahneman-Tversky optimisation on unpaired desirable/undesirable examples."""

    section: ClassVar[str] = "kto"

    model_path: str = "models/sft"
    """Policy to start from (usually the SFT model)."""
    ref_model_path: str = ""
    """Frozen reference model; empty means the starting policy."""
    train_file: str = "data/embedded/preferences.jsonl"
    """Unpaired examples (prompt, completion, desirable: true/false), or preference pairs, each
    split into a desirable (chosen) and an undesirable (rejected) example."""
    desirable_field: str = "desirable"
    """Boolean field marking an unpaired example desirable (TRL's files call it `label`)."""
    output_dir: str = "models/kto"
    """Where the final HF model directory is written."""
    checkpoint_dir: str = "checkpoints/kto"
    """Where periodic checkpoints go."""
    max_steps: int = 200
    """Optimizer steps to train."""
    batch_size: int = 64
    """Unpaired examples per micro-batch (at least 2: the KL reference point pairs each
    example's prompt with another example's completion)."""
    lr: float = 3e-5
    """Peak learning rate of AdamW."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    beta: float = 0.1
    """Inverse temperature of the value function."""
    desirable_weight: float = 1.0
    """lambda_D: weight of desirable examples (the paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3])."""
    undesirable_weight: float = 1.0
    """lambda_U: weight of undesirable examples."""

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.section
        _check(self.batch_size >= 2, s, "batch_size", f"must be >= 2 (KL reference pairs), got {self.batch_size}")
        _check(self.beta > 0, s, "beta", f"must be > 0, got {self.beta}")
        for name in ("desirable_weight", "undesirable_weight"):
            _check(getattr(self, name) > 0, s, name, f"must be > 0, got {getattr(self, name)}")


@dataclass
class DistillConfig(TrainerConfig):
    """``distill``: token-level knowledge distillation from a teacher, mixable with NLL."""

    section: ClassVar[str] = "distill"

    model_path: str = "models/sft"
    """Student to start from."""
    teacher_path: str = "models/dpo"
    """Teacher HF directory; must share the student's tokenizer (vocabulary)."""
    train_file: str = "data/embedded/sft.jsonl"
    """Sequences on which the teacher's next-token distributions are matched."""
    output_dir: str = "models/distill"
    """Where the final HF model directory is written."""
    checkpoint_dir: str = "checkpoints/distill"
    """Where periodic checkpoints go."""
    max_steps: int = 150
    """Optimizer steps to train."""
    batch_size: int = 64
    """Sequences per micro-batch."""
    lr: float = 3e-4
    """Peak learning rate of AdamW."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    temperature: float = 1.0
    """Softmax temperature of both distributions (the KL is scaled by T^2)."""
    nll_weight: float = 0.0
    """Mix weight a of the NLL term: loss = (1 - a) KL + a NLL, in [0, 1]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.section
        _check(self.temperature > 0, s, "temperature", f"must be > 0, got {self.temperature}")
        _check(0.0 <= self.nll_weight <= 1.0, s, "nll_weight", f"must be in [0, 1], got {self.nll_weight}")
        _check(bool(self.teacher_path), s, "teacher_path", "must name the teacher's model directory")


@dataclass
class RaftConfig(SFTConfig):
    """``raft``: SFT of a policy on its own best-of-n samples (RAFT, Dong et al. 2023)."""

    section: ClassVar[str] = "raft"

    model_path: str = "models/sft"
    """Policy to continue from (the one that sampled the candidates)."""
    train_file: str = "data/rejection/best.jsonl"
    """The kept samples written by the rejection stage."""
    output_dir: str = "models/raft"
    """Where the final HF model directory is written."""
    checkpoint_dir: str = "checkpoints/raft"
    """Where periodic checkpoints go."""
    max_steps: int = 100
    """Optimizer steps to train."""
    batch_size: int = 64
    """Sequences per micro-batch."""
    lr: float = 3e-4
    """Peak learning rate (10x below SFT's: this continues a trained policy)."""
    warmup_steps: int = 10
    """Linear warmup steps."""


@dataclass
class RLConfig(TrainerConfig):
    """``rl``: online RL from sampled rollouts: PPO (GAE + critic), REINFORCE++, RLOO, GRPO, Dr.GRPO, DAPO options."""

    section: ClassVar[str] = "rl"

    model_path: str = "models/sft"
    """Policy to start from (usually the SFT model)."""
    ref_model_path: str = ""
    """Frozen reference model of the KL term; empty means the starting policy. With lora_rank > 0 that is the
    policy's own frozen base, scored with its adapters switched off: no reference model is loaded."""
    critic_model_path: str = ""
    """Critic backbone (estimator gae only), loaded with a scalar head via load_reward_model; empty
    means model_path (the policy's backbone, fresh zero-mean head). Name the reward model
    directory to start from it instead, as OpenRLHF does."""
    teacher_model_path: str = ""
    """Frozen teacher of on-policy distillation (estimator distill, required there, unused otherwise): it scores
    the policy's sampled tokens and each token's reward is -(log pi - log pi_teacher). Same tokenizer as the
    policy (checked at load); loaded like the reference (policy's compute dtype, no gradients)."""
    distill_reward_coef: float = 0.0
    """estimator distill: weight of the sequence reward (reward_kind's) added to every token's advantage;
    0 = pure distillation (the reward is still computed and logged)."""
    train_file: str = ""
    """Unused by rl (prompts come from prompts_file); must stay empty."""
    prompts_file: str = "data/embedded/prompts.jsonl"
    """Prompts to sample from, with a label per prompt when the reward needs one."""
    packing: str | bool = "auto"
    """auto, true or false: each update micro-batch and each no-grad log-prob chunk runs as one padding-free row
    (in place of prompt sharing; its rows stay micro_batch_size rows, so micro_batch_tokens is refused). auto
    packs where the model attends with the variable-length flash kernel (a CUDA device, rlhf_core.models.attention;
    faster GRPO steps, BENCHMARKS.md "RL packing on a GPU") and pads elsewhere (a
    CPU's packed row takes a dense block-diagonal mask and is slower)."""
    output_dir: str = "models/rl"
    """Where the final policy's HF model directory is written."""
    checkpoint_dir: str = "checkpoints/rl"
    """Where periodic checkpoints (policy, critic, optimizers, KL controller, RNG) go."""
    estimator: str = "grpo"
    """Advantage estimator: gae (PPO, trains a critic), reinforce++, reinforce++-baseline, rloo, grpo, dr-grpo, or
    distill (on-policy distillation from teacher_model_path: per-token reverse-KL rewards, discount 0)."""
    reward_kind: str = "function"
    """Where rewards come from: function (a .py file), model (a reward model directory) or http."""
    reward_function: str = "rlhf_core/embedded/reward.py:reward"
    """``file.py:function`` returning one reward per (prompt, completion, label), for reward_kind function."""
    reward_model_path: str = "models/reward"
    """Reward model directory, for reward_kind model."""
    reward_url: str = ""
    """Reward server URL (e.g. from ``alignflow serve-rm``), for reward_kind http."""
    reward_timeout_s: float = 30.0
    """Seconds one request to the reward or environment server may take, connect to last byte (then retried)."""
    reward_retries: int = 3
    """Retries of a reward request that timed out or failed with a 5xx, for reward_kind http."""
    reward_backoff_cap_s: float = 30.0
    """Longest wait between reward-server retries (full-jitter exponential backoff from 1 s), for reward_kind http."""
    reward_deadline_s: float = 300.0
    """Seconds one reward call may take, all retries and waits (429 Retry-After included), for reward_kind http."""
    reward_max_response_bytes: int = 4 * 1024 * 1024
    """Largest reply body the reward or environment server may send; a larger one is refused unread."""
    reward_token_env: str = ""
    """NAME of the environment variable holding the reward server's token (sent as Authorization: Bearer); never
    the token itself, so configs, Prefect parameters and MLflow hold the name only. Empty: no token."""
    environment: str = ""
    """Multi-turn rollouts with a tool (rlhf_core/rollout/environments.py): path/to/env.py:make_env (a function returning a
    fresh environment) or an http(s):// environment server (the reward_* timeout, retry, backoff and deadline
    settings apply to it too); empty: single-turn rollouts, as without this field."""
    environment_stop_tokens: list[str] = field(default_factory=list)
    """An HTTP environment's tokens that end a model turn (e.g. a tool call's closing tag); a file environment
    names its own."""
    environment_token_env: str = ""
    """NAME of the environment variable holding the environment server's token (Authorization: Bearer)."""
    max_turns: int = 2
    """With an environment: model turns per trajectory (tool calls + the answer)."""
    max_trajectory_tokens: int = 32
    """With an environment: response tokens per trajectory, model turns and observations together
    (each turn is also capped at max_new_tokens)."""
    tool_messages: str = "auto"
    """With an environment: how an observation joins a trajectory (environments.ToolMessages): chat (a chat-template
    tool message, then the next assistant turn's generation prompt; a turn ending at eos is a step too), text (its
    text appended inside the model's turn) or auto (chat where prompts_file holds conversations and the tokenizer
    has a chat template of its own that renders tool turns, else text)."""
    rollout_engine: str = "static"
    """static (our decode loop, rlhf_core/rollout/static.py: static KV cache, prompts prefilled once per group,
    CUDA graphs on a GPU; Llama-family models, falls back to hf with a warning otherwise), hf (transformers
    generate on the policy itself) or vllm (a vLLM engine whose weights are synced after every update; falls
    back to hf, with a warning, when vLLM cannot be imported)."""
    vllm_memory_fraction: float = 0.1
    """rollout_engine vllm: fraction of GPU memory (of RAM on CPU) vLLM reserves for its KV cache."""
    placement: str = "none"
    """none (every role in this process) or, through Ray, colocated (policy, reference, reward model and
    rollout engine share each worker's bundle) or disaggregated (each role its own bundles)."""
    rollout_workers: int = 1
    """Rollout engine replicas under Ray (prompts are split across them); ignored with placement none."""
    weight_sync: str = "auto"
    """How Ray rollout replicas get the learner's weights after an update (rlhf_core/distributed/weight_sync.py): object_store
    (rank 0's weights as one Ray object to every replica; works anywhere), collective (policy rank 0 and the
    replicas in a torch.distributed group of their own, weights broadcast in 1 GiB buckets: NCCL on GPUs,
    gloo on CPUs; replicas must not share rank 0's GPU) or auto (GPUs: CUDA IPC for colocated replicas,
    collective for replicas on GPUs of their own with the hf/static engines; CPUs: object_store)."""
    shard_reference: bool = True
    """parallel zero3 on Ray: the reference (and distillation teacher) ranks partition the frozen weights as the
    policy's are, a DeepSpeed ZeRO-3 engine without an optimizer, so a GPU holds 1/num_workers of them and gathers
    each layer for its forward (a 7B reference: 3.8 GB a GPU on four instead of 15.2); false: each reference rank
    holds the whole model (no gathers, more memory)."""
    rollout_sleep: str = "auto"
    """Colocated Ray replicas free their weights' memory once a rollout is done, and the weight sync after the
    update allocates and fills them again (vLLM's sleep mode, level 2, for our engines): the reference, old
    log-prob and update phases run without the replica's copy of the policy on the GPU. on, off or auto (on with
    GPUs where it can work: colocated, synchronous, hf or static engine, whole-weight syncs, i.e. no LoRA)."""
    max_steps: int = 40
    """Rollout/update iterations (each samples prompts_per_step x group_size responses)."""
    num_threads: int = 1
    """torch intra-op threads on CPU: 1, since generation's small per-token kernels gain little from more and
    slow down badly when another process shares the cores."""
    prompts_per_step: int = 32
    """Prompts sampled per iteration (after DAPO filtering: groups kept per iteration)."""
    group_size: int = 8
    """Samples per prompt (n); group estimators (grpo, rloo, dr-grpo, reinforce++-baseline) need >= 2."""
    temperature: float = 1.0
    """Sampling temperature of rollouts; log-probs for the loss use the same logits / temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass of rollouts, in (0, 1]."""
    max_new_tokens: int = 12
    """Generation budget per response in tokens, eos included."""
    batch_size: int = 256
    """Rows per forward pass when generating and when computing log-probs and values without gradient."""
    grad_accum: int = 1
    """Unused by rl (must stay 1): one mini-batch of mini_batch_size rows is one optimizer step."""
    max_length: int = 64
    """Longest prompt + response in tokens; a prompt with max_new_tokens that would exceed it stops the run at load."""
    ppo_epochs: int = 1
    """Passes over each iteration's rollouts (PPO's K epochs)."""
    mini_batch_size: int = 128
    """Rollout rows per optimizer step (policy and critic); with prompts_per_step x group_size rows and one
    PPO epoch, one update per batch (pi_old is then the update's own detached log-prob: no extra forward)."""
    micro_batch_size: int = 0
    """Rows per forward/backward of the policy update on each rank; gradients accumulate over a mini-batch's
    micro-batches (0: a rank's whole share of the mini-batch in one pass). Bounds activation memory."""
    lr: float = 3e-4
    """Peak learning rate of the policy's AdamW."""
    critic_lr: float = 1e-3
    """Peak learning rate of the critic's AdamW (estimator gae only)."""
    warmup_steps: int = 0
    """Linear warmup, in iterations (the schedule advances once per iteration; its first iteration runs at lr 0)."""
    policy_objective: str = "ppo_clip"
    """Policy-gradient surrogate (rl_math.PolicyObjective): ppo_clip (PPO's min over token ratios clipped to
    [1 - clip_low, 1 + clip_high]), gspo (GSPO-token, Zheng et al. 2025: one length-normalised ratio per
    response, clipped to [1 - gspo_clip_low, 1 + gspo_clip_high]) or cispo (MiniMax-M1: REINFORCE weighted by
    the detached token ratio capped at 1 + clip_high, no lower bound, no token's gradient dropped)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1 (ratio >= 1 - clip_low), in [0, 1); ppo_clip only (cispo has no lower bound)."""
    clip_high: float = 0.28
    """PPO clip epsilon above 1 (ratio <= 1 + clip_high); above clip_low is DAPO's clip-higher. cispo caps its
    importance weight at 1 + clip_high (a token ratio too, so the same scale)."""
    gspo_clip_low: float = 0.0003
    """gspo: clip epsilon below 1 of the sequence ratio, in [0, 1); the paper's 3e-4. Own fields, not clip_low:
    a geometric mean over the response moves ~1000x less than a token ratio, and 0.2 would never bind."""
    gspo_clip_high: float = 0.0004
    """gspo: clip epsilon above 1 of the sequence ratio, >= 0; the paper's 4e-4."""
    dual_clip: float = 0.0
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens (Ye et al. 2020); 0 = off. Not with cispo."""
    value_clip: float = 0.2
    """Clip range of the critic's value update around its rollout-time values; 0 = plain squared error."""
    vf_coef: float = 1.0
    """Scale of the value loss (the critic has its own optimizer, so this acts through gradient clipping)."""
    gamma: float = 1.0
    """Discount of token-level returns (gae, reinforce++ variants), in [0, 1]."""
    lam: float = 0.95
    """GAE lambda, in [0, 1] (1: Monte-Carlo returns minus V)."""
    kl_coef: float = 0.1
    """beta: weight of the KL to the reference (initial value when adaptive_kl); 0 = no KL term."""
    kl_estimator: str = "k3"
    """Per-token KL estimator of the penalty: k1, k2 or k3 (k1 is the usual choice inside the reward)."""
    kl_k3_cap: float = 10.0
    """Upper bound on each token's k3 value in the penalty (verl, OpenRLHF: 10); 0 disables. Where it binds
    the token's KL gradient is zero (rl_math.kl_penalty); train/kl is logged uncapped."""
    kl_in_reward: bool = False
    """Fold -beta * KL into token rewards (PPO, REINFORCE++) instead of adding beta * KL to the loss (GRPO);
    only for gae and the reinforce++ variants."""
    adaptive_kl: bool = False
    """Adapt beta towards kl_target (Ziegler et al. 2019) instead of keeping it fixed."""
    kl_target: float = 0.1
    """Target mean per-sequence KL (nats) of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (in samples) of the adaptive controller: beta moves by at most 20% x samples / horizon per step."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus subtracted from the policy loss; 0 = off (entropy is logged either way)."""
    loss_aggregation: str = "token_mean"
    """How token losses are reduced: token_mean (DAPO), seq_mean_token_mean (GRPO) or seq_mean_token_sum_norm (Dr.GRPO)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose samples all scored the same, top up with more prompts."""
    dynamic_sampling_max_rounds: int = 3
    """Extra rollout rounds allowed per iteration to top up the kept groups (dynamic_sampling only)."""
    overlong_max_len: int = 0
    """DAPO soft overlong penalty: L_max in tokens (at most max_new_tokens); 0 = off."""
    overlong_cache_len: int = 0
    """Width in tokens of the overlong penalty's ramp from 0 to -1 (0 < cache <= overlong_max_len when on)."""
    recompute_old_logprobs: bool = True
    """Recompute old log-probs with one no-grad policy forward; false uses the engine's sampling log-probs
    (exact only when the engine samples from the trained weights with the same numerics)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (Yao et al. 2025): weight each token's policy-gradient term by
    min(pi_old / pi_engine, tis_cap) to correct for an engine (vLLM) that samples slightly off the
    trainer's policy; 0 = off, 2 is the paper's choice. Needs recompute_old_logprobs."""
    mis_threshold: float = 0.0
    """Sequence-level masked importance sampling (Seq-MIS, rl_math.sequence_is_mask): a response whose ratio
    pi_old(y) / pi_engine(y) leaves [1 / mis_threshold, mis_threshold] is masked out of the loss, whether the
    engine's numerics or its staleness (max_staleness) caused the gap; 0 = off, else > 1 (e.g. 2)."""
    max_staleness: int = 0
    """Asynchronous training: 0 = synchronous (each batch sampled from the policy it updates); k >= 1 = the next
    batch is generated while the current one updates, from a policy at most k updates old (weights are pushed
    to the engine only when the gap would exceed k). Needs recompute_old_logprobs; not with placement colocated;
    under disaggregated placement the reference runs on the policy ranks' bundles, the reward model on the replicas'."""
    eval_at_start: bool = True
    """Evaluate the starting policy before iteration 1 (the baseline of eval/accuracy)."""
    eval_items: int = 1000
    """Held-out items used for accuracy (greedy exact match)."""
    log_rollouts_every: int = 10
    """Iterations between rollout tables (step, prompt, completion, reward); 0 = never."""
    save_every: int = 20
    """Iterations between checkpoints (0: only the final model)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        estimator, kind = self._check_choices()
        self._check_inputs()
        self._check_reward(kind)
        self._check_rollout()
        # packing: each micro-batch (and no-grad chunk) runs as one padding-free row; its rows stay
        # micro_batch_size rows, so a token budget has no meaning here
        _check(self.packing in (True, False, "auto"), self.section, "packing",
               f"must be auto, true or false, got {self.packing!r}")
        _check(self.micro_batch_tokens == 0, self.section, "micro_batch_tokens",
               "not for rl: its micro-batches are micro_batch_size rows (packed into one row with packing: true)")
        self._check_batches(estimator)
        self._check_update()
        self._check_kl(estimator)
        self._check_dapo()
        self._check_distill(estimator)
        self._check_environment()

    def _check_environment(self) -> None:
        """Multi-turn rollouts: the environment's spec, turn and token limits, where it can run."""
        s = self.section
        _check(self.max_turns >= 1, s, "max_turns", f"must be >= 1, got {self.max_turns}")
        _check(self.max_trajectory_tokens >= 1, s, "max_trajectory_tokens",
               f"must be >= 1, got {self.max_trajectory_tokens}")
        if not self.environment:
            _check(not self.environment_stop_tokens, s, "environment_stop_tokens",
                   "is only used with an environment (rl.environment is empty)")
            _check(self.tool_messages == "auto", s, "tool_messages",
                   "is only used with an environment (rl.environment is empty)")
            return
        spec = self.environment
        if spec.startswith(("http://", "https://")):
            _check(bool(self.environment_stop_tokens), s, "environment_stop_tokens",
                   "an HTTP environment needs the tokens that end a model turn, e.g. ['</calc>']")
        else:
            file_part, _, func = spec.rpartition(":")
            _check(file_part.endswith(".py") and func.isidentifier(), s, "environment",
                   f"must be path/to/env.py:function or an http(s):// URL, got {spec!r}")
        _check(self.max_length >= self.max_trajectory_tokens + 1, s, "max_trajectory_tokens",
               f"must leave room for a prompt within max_length ({self.max_length}), got {self.max_trajectory_tokens}")
        _check(not self.overlong_max_len or self.overlong_max_len <= self.max_trajectory_tokens, s, "overlong_max_len",
               f"must be <= max_trajectory_tokens ({self.max_trajectory_tokens}) with an environment")

    def _check_choices(self) -> tuple[AdvantageEstimator, RewardKind]:
        """Check the enum-valued fields; return the (AdvantageEstimator, RewardKind) they name."""
        # Local imports: rewards and rl_math import torch, and ``import rlhf_core.config.schema`` stays torch-free.
        from rlhf_core.rollout.environments import ToolMessages
        from rlhf_core.rewards.sources import RewardKind
        from rlhf_core.algorithms.rl_math import AdvantageEstimator, KLEstimator, LossAggregation, PolicyObjective

        s = self.section

        def one_of(name: str, enum: type) -> None:
            values = [e.value for e in enum]
            _check(getattr(self, name) in values, s, name, f"must be one of {values}, got {getattr(self, name)!r}")

        one_of("estimator", AdvantageEstimator)
        one_of("reward_kind", RewardKind)
        one_of("kl_estimator", KLEstimator)
        one_of("loss_aggregation", LossAggregation)
        one_of("policy_objective", PolicyObjective)
        one_of("tool_messages", ToolMessages)
        return AdvantageEstimator(self.estimator), RewardKind(self.reward_kind)

    def _check_inputs(self) -> None:
        """Trainer fields rl does not use must keep their neutral values; prompts must be named."""
        s = self.section
        _check(self.train_file == "", s, "train_file", "rl reads its prompts from prompts_file; leave train_file empty")
        _check(self.grad_accum == 1, s, "grad_accum", "must be 1 (mini_batch_size rows make one optimizer step)")
        _check(bool(self.prompts_file), s, "prompts_file", "must name the prompts file")

    def _check_reward(self, kind: RewardKind) -> None:
        """The reward source ``kind`` needs its own field; HTTP limits."""
        from rlhf_core.common.redact import redact_secrets
        from rlhf_core.rewards.sources import RewardKind

        s = self.section
        if kind is RewardKind.FUNCTION:
            _check(":" in self.reward_function, s, "reward_function",
                   f"must be 'path/to/file.py:function_name', got {self.reward_function!r}")
        elif kind is RewardKind.MODEL:
            _check(bool(self.reward_model_path), s, "reward_model_path", "must name a reward model directory")
        else:
            _check(self.reward_url.startswith(("http://", "https://")), s, "reward_url",
                   f"must start with http:// or https:// for reward_kind http, got {redact_secrets(self.reward_url)!r}")
        _check(self.reward_timeout_s > 0, s, "reward_timeout_s", f"must be > 0, got {self.reward_timeout_s}")
        _check(self.reward_retries >= 0, s, "reward_retries", f"must be >= 0, got {self.reward_retries}")
        _check(self.reward_backoff_cap_s >= 0, s, "reward_backoff_cap_s", f"must be >= 0, got {self.reward_backoff_cap_s}")
        _check(self.reward_deadline_s > 0, s, "reward_deadline_s", f"must be > 0, got {self.reward_deadline_s}")
        _check(self.reward_max_response_bytes > 0, s, "reward_max_response_bytes",
               f"must be > 0, got {self.reward_max_response_bytes}")
        self._check_token_env(kind)

    def _check_token_env(self, kind: RewardKind) -> None:
        """reward_token_env must be a variable's name, set now (checked at load: fail before hours of training)."""
        from rlhf_core.rewards.sources import RewardKind

        name, s = self.reward_token_env, self.section
        if not name or kind is not RewardKind.HTTP:
            return
        # Never quote a value that is not a name: it may be the token itself, pasted in by mistake.
        _check(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None, s, "reward_token_env",
               "must be the NAME of an environment variable holding the token (letters, digits, _), not the token")
        _check(bool(os.environ.get(name)), s, "reward_token_env",
               f"environment variable {name} is not set (or is empty); export the reward server's token under it")
        _check("@" not in self.reward_url.split("/")[2], s, "reward_token_env",
               "is set, and reward_url also carries user:pass@ credentials; use one (only the token would be sent)")

    def _check_rollout(self) -> None:
        """Rollout engine, its off-policy correction, and where roles and workers run."""
        s = self.section
        _check(self.tis_cap >= 0, s, "tis_cap", f"must be >= 0 (0 = off), got {self.tis_cap}")
        _check(self.tis_cap == 0 or self.recompute_old_logprobs, s, "tis_cap",
               "needs recompute_old_logprobs: true (without it pi_old is the engine's own log-prob)")
        self._check_async()
        _check(self.rollout_engine in ("hf", "static", "vllm"), s, "rollout_engine",
               f"must be hf, static or vllm, got {self.rollout_engine!r}")
        _check(0 < self.vllm_memory_fraction <= 1, s, "vllm_memory_fraction",
               f"must be in (0, 1], got {self.vllm_memory_fraction}")
        _check(self.placement in ("none", "colocated", "disaggregated"), s, "placement",
               f"must be none, colocated or disaggregated, got {self.placement!r}")
        _check(self.rollout_workers >= 1, s, "rollout_workers", f"must be >= 1, got {self.rollout_workers}")
        _check(self.num_workers == 1 or self.placement != "none", s, "num_workers",
               f"{self.num_workers} policy workers need Ray: set placement to colocated or disaggregated")
        # without Ray the engine samples from this process's policy, whose weights ZeRO-3 holds as empty
        # placeholders outside a forward (the static engine would read them directly: a size-0 reshape)
        _check(self.parallel != "zero3" or self.placement != "none", s, "parallel",
               "zero3 partitions the policy's weights, and with placement none the rollout engine samples from them "
               "in this process; set placement colocated (Ray replicas take whole weights at each sync, also on one "
               "GPU) or parallel zero2")
        self._check_weight_sync()
        self._check_rollout_sleep()

    def _check_rollout_sleep(self) -> None:
        """rl.rollout_sleep: on only where every rollout is followed by a sync of the whole weights."""
        s = self.section
        _check(self.rollout_sleep in ("auto", "on", "off"), s, "rollout_sleep",
               f"must be auto, on or off, got {self.rollout_sleep!r}")
        if self.rollout_sleep != "on":
            return
        _check(self.placement == "colocated", s, "rollout_sleep",
               f"on frees colocated Ray replicas' weights between phases; placement is {self.placement!r} "
               f"(set placement colocated, or rollout_sleep auto)")
        _check(self.rollout_engine in ("hf", "static"), s, "rollout_sleep",
               f"on needs the hf or static engine (vLLM has a sleep mode of its own), got {self.rollout_engine!r}")
        _check(not self.lora_rank, s, "rollout_sleep",
               "on needs a sync of the whole weights after each update, and a LoRA policy's replicas keep the "
               "frozen base and take the adapters alone; use rollout_sleep auto or off")

    def _check_weight_sync(self) -> None:
        """rl.weight_sync: a known path, and collective only where it can work."""
        from rlhf_core.distributed.weight_sync import WeightSync

        s, values = self.section, [e.value for e in WeightSync]
        _check(self.weight_sync in values, s, "weight_sync", f"must be one of {values}, got {self.weight_sync!r}")
        if self.weight_sync != WeightSync.COLLECTIVE.value:
            return
        _check(self.placement != "none", s, "weight_sync",
               "collective broadcasts to Ray rollout replicas; with placement none the engine samples from the "
               "trained policy in this process (set placement disaggregated, or weight_sync auto)")
        _check(not self.lora_rank, s, "weight_sync",
               "collective broadcasts the policy's parameters, and a LoRA policy (lora_rank > 0) needs its adapters "
               "merged first; use weight_sync auto or object_store")

    def _check_async(self) -> None:
        """Asynchronous training and sequence-level masking: both compare pi_old with the engine's log-probs."""
        s = self.section
        _check(isinstance(self.max_staleness, int) and self.max_staleness >= 0, s, "max_staleness",
               f"must be an integer >= 0 (0 = synchronous), got {self.max_staleness!r}")
        _check(self.mis_threshold == 0 or self.mis_threshold > 1, s, "mis_threshold",
               f"must be 0 (off) or > 1 (the band is [1 / mis_threshold, mis_threshold]), got {self.mis_threshold}")
        _check(self.mis_threshold == 0 or self.recompute_old_logprobs, s, "mis_threshold",
               "needs recompute_old_logprobs: true (without it pi_old is the engine's own log-prob: the ratio is 1)")
        if self.max_staleness:
            # pi_old must be the policy being updated (the proximal policy); the stale engine's log-probs are the
            # behaviour policy that TIS and MIS correct for, never the clipping anchor
            _check(self.recompute_old_logprobs, s, "max_staleness",
                   "needs recompute_old_logprobs: true (a stale rollout's own log-probs cannot anchor the PPO ratio)")
            _check(self.placement != "colocated", s, "max_staleness",
                   "overlaps generation with the update, but colocated roles share each GPU and take turns; "
                   "use placement disaggregated (rollout replicas on their own GPUs) or none")

    def _check_batches(self, estimator: AdvantageEstimator) -> None:
        """Batch, group and mini-batch sizes fit together and suit ``estimator``."""
        s = self.section
        _check(self.mini_batch_size >= self.num_workers, s, "mini_batch_size",
               f"must be >= num_workers ({self.num_workers}) so every worker gets rows")
        _check(isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 0, s, "micro_batch_size",
               f"must be an integer >= 0 (0: no micro-batching), got {self.micro_batch_size!r}")
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "ppo_epochs", "mini_batch_size"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _check(not estimator.needs_groups or self.group_size >= 2, s, "group_size",
               f"must be >= 2 for {estimator.value} (its baseline compares samples of one prompt), got {self.group_size}")
        rows = self.prompts_per_step * self.group_size
        _check(self.mini_batch_size <= rows, s, "mini_batch_size",
               f"must be <= prompts_per_step x group_size = {rows}, got {self.mini_batch_size}")

    def _check_update(self) -> None:
        """Sampling, PPO clipping, critic and return parameters of the update."""
        from rlhf_core.algorithms.rl_math import PolicyObjective  # valid: _check_choices ran first

        s = self.section
        _check(self.temperature > 0, s, "temperature", f"must be > 0 (rollouts are sampled), got {self.temperature}")
        _check(0 < self.top_p <= 1, s, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.critic_lr > 0, s, "critic_lr", f"must be > 0, got {self.critic_lr}")
        _check(0.0 <= self.clip_low < 1.0, s, "clip_low", f"must be in [0, 1), got {self.clip_low}")
        _check(self.clip_high >= 0, s, "clip_high", f"must be >= 0, got {self.clip_high}")
        _check(self.dual_clip == 0 or self.dual_clip > 1, s, "dual_clip", f"must be 0 (off) or > 1, got {self.dual_clip}")
        _check(0.0 <= self.gspo_clip_low < 1.0, s, "gspo_clip_low", f"must be in [0, 1), got {self.gspo_clip_low}")
        _check(self.gspo_clip_high >= 0, s, "gspo_clip_high", f"must be >= 0, got {self.gspo_clip_high}")
        _check(self.dual_clip == 0 or PolicyObjective(self.policy_objective).supports_dual_clip, s, "dual_clip",
               f"must be 0 with policy_objective {self.policy_objective}: its clipped weight has no unclipped branch "
               "to bound")
        _check(self.value_clip >= 0, s, "value_clip", f"must be >= 0 (0 = off), got {self.value_clip}")
        _check(self.vf_coef > 0, s, "vf_coef", f"must be > 0, got {self.vf_coef}")
        for name in ("gamma", "lam"):
            _check(0.0 <= getattr(self, name) <= 1.0, s, name, f"must be in [0, 1], got {getattr(self, name)}")

    def _check_kl(self, estimator: AdvantageEstimator) -> None:
        """KL penalty: coefficient, where it applies for ``estimator``, adaptive controller."""
        s = self.section
        _check(self.kl_coef >= 0, s, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(self.kl_k3_cap >= 0, s, "kl_k3_cap",
               f"must be >= 0 (an upper bound on each token's k3 value; 0 disables the cap), got {self.kl_k3_cap}")
        _check(not self.kl_in_reward or estimator.takes_token_rewards, s, "kl_in_reward",
               f"{estimator.value} scores whole sequences and takes no token rewards; set kl_in_reward false "
               "(KL as a loss term)")
        if self.adaptive_kl:
            _check(self.kl_coef > 0, s, "kl_coef", "must be > 0 with adaptive_kl (the controller scales it)")
            _check(self.kl_target > 0, s, "kl_target", f"must be > 0, got {self.kl_target}")
            _check(self.kl_horizon >= 1, s, "kl_horizon", f"must be >= 1, got {self.kl_horizon}")

    def _check_dapo(self) -> None:
        """Entropy bonus, DAPO dynamic sampling and overlong penalty, rollout logging."""
        s = self.section
        _check(self.entropy_coef >= 0, s, "entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        _check(not self.dynamic_sampling or self.group_size >= 2, s, "dynamic_sampling",
               f"needs group_size >= 2 (it drops groups whose samples all scored the same), got {self.group_size}")
        _check(self.dynamic_sampling_max_rounds >= 0, s, "dynamic_sampling_max_rounds",
               f"must be >= 0, got {self.dynamic_sampling_max_rounds}")
        if self.overlong_max_len or self.overlong_cache_len:
            _check(0 < self.overlong_cache_len <= self.overlong_max_len <= self.max_new_tokens, s, "overlong_cache_len",
                   f"need 0 < overlong_cache_len <= overlong_max_len <= max_new_tokens ({self.max_new_tokens}), "
                   f"got {self.overlong_cache_len} and {self.overlong_max_len}")
        _check(self.log_rollouts_every >= 0, s, "log_rollouts_every", f"must be >= 0, got {self.log_rollouts_every}")

    def _check_distill(self, estimator: AdvantageEstimator) -> None:
        """On-policy distillation (estimator distill) needs its teacher; the teacher's fields need distill."""
        s = self.section
        if not estimator.needs_teacher:
            _check(not self.teacher_model_path, s, "teacher_model_path",
                   f"is only used by estimator distill (on-policy distillation), got estimator {estimator.value}")
            _check(self.distill_reward_coef == 0, s, "distill_reward_coef",
                   f"is only used by estimator distill, got estimator {estimator.value}")
            return
        _check(bool(self.teacher_model_path), s, "teacher_model_path",
               "must name the teacher's model directory for estimator distill")
        _check(self.distill_reward_coef >= 0, s, "distill_reward_coef", f"must be >= 0, got {self.distill_reward_coef}")
        _check(not self.dynamic_sampling, s, "dynamic_sampling",
               "drops groups whose sequence rewards tie, but distill learns from the teacher on every token; "
               "set it false")


@dataclass
class RejectionConfig(DataFields):
    """``rejection``: best-of-n sampling from a policy, scored by a reward model or the rule."""

    policy_path: str = "models/sft"
    """Policy that samples the candidates."""
    prompts_file: str = "data/embedded/prompts.jsonl"
    """Prompts (with labels when scoring by rule)."""
    scorer: str = "reward_model"
    """reward_model (uses reward_model_path) or rule (exact match against the label)."""
    reward_model_path: str = "models/reward"
    """Reward model directory, for scorer=reward_model."""
    n_samples: int = 4
    """Candidates per prompt."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 12
    """Generation budget per candidate."""
    max_prompts: int = 0
    """Use at most this many prompts (0: all)."""
    batch_size: int = 64
    """Prompts per generate call."""
    output_file: str = "data/rejection/best.jsonl"
    """Best candidate per prompt, as an SFT dataset (prompt, completion, score)."""
    pairs_file: str = "data/rejection/pairs.jsonl"
    """Best vs worst candidate as preference pairs (only where their scores differ)."""
    num_threads: int = 2
    """torch intra-op threads on CPU."""
    seed: int = 0
    """Sampling seed."""

    def __post_init__(self) -> None:
        s = "rejection"
        self._check_limits(s)
        _check(self.scorer in ("reward_model", "rule"), s, "scorer",
               f"must be reward_model or rule, got {self.scorer!r}")
        _check(self.n_samples >= 2, s, "n_samples", f"must be >= 2, got {self.n_samples}")
        _check(self.temperature > 0, s, "temperature", f"must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, s, "top_p", f"must be in (0, 1], got {self.top_p}")
        for name in ("max_new_tokens", "batch_size", "num_threads"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.max_prompts >= 0, s, "max_prompts", f"must be >= 0, got {self.max_prompts}")


@dataclass
class EvalConfig(DataFields):
    """``evaluate``: greedy exact-match accuracy of a model on held-out prompts."""

    model_path: str = "models/sft"
    """HF model directory to evaluate."""
    eval_file: str = "data/embedded/eval.jsonl"
    """Held-out prompts with labels."""
    output_file: str = "metrics/eval_sft.json"
    """JSON file receiving accuracy, its standard error and the item count."""
    max_items: int = 1000
    """Evaluate on at most this many items (in file order)."""
    max_new_tokens: int = 12
    """Generation budget per answer (the longest embedded answer is 8 digits + eos)."""
    batch_size: int = 256
    """Prompts per generate call."""
    num_threads: int = 2
    """torch intra-op threads on CPU."""

    def __post_init__(self) -> None:
        self._check_limits("evaluate")
        for name in ("max_items", "max_new_tokens", "batch_size", "num_threads"):
            _check(getattr(self, name) >= 1, "evaluate", name, f"must be >= 1, got {getattr(self, name)}")


@dataclass
class TrackingConfig:
    """``tracking``: where MLflow (or the local-file fallback) records runs."""

    tracking_uri: str = ""
    """MLflow tracking URI; empty means sqlite at <project>/mlflow.db (MLFLOW_TRACKING_URI wins)."""
    artifact_dir: str = "mlartifacts"
    """Artifact folder for new experiments, relative to the project root unless absolute."""
    experiment: str = "alignflow"
    """MLflow experiment name."""
    registered_model: str = "alignflow-sft"
    """Registry name of the SFT model."""
    log_model: bool = True
    """Log the final model with MLflow's transformers flavor and register it."""
    connect_patience_s: float = 20.0
    """Seconds a stage waits for an http(s) tracking server to answer when it opens its run, then fails with a
    clear error (without this bound MLflow's own retries block each call about 4 minutes). 20 s keeps the whole
    failure, process start included, within 30 s; raise it to ride out a server restart."""
    model_storage: str = "copy"
    """How a registered model is kept: copy (MLflow's transformers flavor: the folder is copied into the artifact
    store, so models:/<name>@champion loads anywhere and outlives the folder; about 15 GB per 7B version) or
    reference (a small JSON pointer with the folder's absolute path and DVC md5, no weights copied: only for
    folders that are DVC-versioned or never overwritten, since the flows rewrite models/ on every run)."""
    keep_model_versions: int = 0
    """After each registration keep only this many newest versions of the registered model, plus every version
    an alias (champion, candidate) points at or whose registration is under way; older ones are deleted with
    the weights they copied. 0 keeps every version."""
    registry_settle_s: float = 2.0
    """On a shared tracking server (http(s) or a database server, which the project's lock cannot guard), seconds a
    promotion waits, twice, before re-reading the champion alias to catch a concurrent flow's overwrite."""

    def __post_init__(self) -> None:
        _check(self.connect_patience_s >= 0, "tracking", "connect_patience_s",
               f"must be >= 0 seconds, got {self.connect_patience_s}")
        _check(self.model_storage in ("copy", "reference"), "tracking", "model_storage",
               f"must be copy or reference, got {self.model_storage!r}")
        _check(self.keep_model_versions >= 0, "tracking", "keep_model_versions",
               f"must be >= 0 (0 keeps every version), got {self.keep_model_versions}")
        _check(self.registry_settle_s >= 0, "tracking", "registry_settle_s",
               f"must be >= 0 seconds, got {self.registry_settle_s}")


@dataclass
class FlowConfig:
    """``flow``: how the align flow runs its stages."""

    retries: int = 1
    """Retries of a failed task (transient failures: a busy file system, a killed worker)."""
    retry_delay_s: float = 2.0
    """Seconds between retries."""
    use_cache: bool = True
    """Reuse a task's result when its inputs (paths + md5s), params and code are unchanged."""
    isolation: str = "process"
    """Where training tasks run: process (a child process per stage, so a killed or crashed trainer is a
    failed task that Prefect retries from the stage's checkpoint, and the stage's memory is returned
    when it ends) or inline (in the flow's own process: no start-up cost, but a crash ends the flow)."""
    ray_address: str = ""
    """Ray cluster (``host:port`` that ``ray start --head`` prints) that training tasks are submitted to through
    prefect-ray; each task then runs in a Ray worker there (its data-parallel ranks too). Empty: tasks run on
    this machine, where a stage with num_workers > 1 still attaches to RAY_ADDRESS when that is set."""
    stages: list[str] = field(default_factory=lambda: list(_alignment_stages()))
    """Alignment stages run after SFT, in this order: any of reward, dpo, kto, rejection, raft,
    distill, rl (rejection and rl with reward_kind model use the reward stage's model; raft
    needs rejection)."""

    def __post_init__(self) -> None:
        _check(self.retries >= 0, "flow", "retries", f"must be >= 0, got {self.retries}")
        _check(self.isolation in ("process", "inline"), "flow", "isolation",
               f"must be process or inline, got {self.isolation!r}")
        _check(isinstance(self.stages, list) and all(isinstance(x, str) for x in self.stages), "flow", "stages",
               f"must be a list of stage names, got {self.stages!r}")
        unknown = [x for x in self.stages if x not in _alignment_stages()]
        _check(not unknown, "flow", "stages", f"unknown stage(s) {unknown}; known: {list(_alignment_stages())}")
        _check("raft" not in self.stages or "rejection" in self.stages, "flow", "stages",
               "raft trains on the rejection stage's output: add rejection")


def _alignment_stages() -> tuple[str, ...]:
    """The post-SFT stages the align flow knows, in their natural order: the stage registry's chain."""
    from rlhf_core.stages.registry import chain_names  # imports nothing of the core: no cycle

    return chain_names()


@dataclass
class DataReportConfig:
    """``data_report``: near-duplicate, eval-contamination and drift checks on every dataset a flow or a
    training stage command trains on (rlhf_core/data/report.py); a check over its threshold stops it before
    training. ``tool_data_report``: the same for the tool task's stage commands (``--section tool_*``)."""

    max_duplicate_prompt_rate: float = 0.25
    """Most rows whose normalised prompt repeats an earlier row's (embedded default: 0)."""
    max_repeated_chosen_rate: float = 0.6
    """Most rows whose normalised chosen text (completion, for SFT data) repeats an earlier row's
    (embedded default: 0.30 in preferences, 0.48 in sft: the task's answers are short numbers)."""
    max_near_duplicate_rate: float = 0.05
    """Most rows equal to an earlier row after normalisation (case, Unicode form, whitespace); exact
    duplicates are already refused by the gate (embedded default: 0)."""
    check_contamination: bool = True
    """Refuse any training prompt found in the eval set: exact match after normalisation, or a shared
    word n-gram for prompts of at least ngram words."""
    ngram: int = 13
    """Word n-gram length of the contamination overlap test (GPT-3's: 13)."""
    max_mean_drift: float = 0.5
    """Cycles: most relative change of a text field's mean length against the previous cycle's data
    (0.5: a mean of 10 may move to between 5 and 15)."""

    def __post_init__(self) -> None:
        s = "data_report"
        for name in ("max_duplicate_prompt_rate", "max_repeated_chosen_rate", "max_near_duplicate_rate"):
            value = getattr(self, name)
            _check(0.0 <= value <= 1.0, s, name, f"must be a rate in [0, 1], got {value}")
        _check(self.ngram >= 1, s, "ngram", f"must be >= 1, got {self.ngram}")
        _check(self.max_mean_drift >= 0, s, "max_mean_drift", f"must be >= 0, got {self.max_mean_drift}")


@dataclass
class CyclesConfig:
    """``cycles``: the iterative_dpo and raft flows (sample -> score -> version -> train, N times)."""

    cycles: int = 3
    """Number of cycles; each starts from the previous cycle's policy."""
    start_model: str = "models/sft"
    """Policy of the first cycle."""
    scorer: str = "reward_model"
    """reward_model (reward_model_path) or rule (exact match against the prompt's label)."""
    reward_model_path: str = "models/reward"
    """Reward model scoring the samples (and, with retrain_reward, the one retrained each cycle)."""
    n_samples: int = 4
    """Samples per prompt in each cycle."""
    temperature: float = 1.0
    """Sampling temperature."""
    max_prompts: int = 0
    """Prompts sampled per cycle (0: the whole prompt file)."""
    retrain_reward: bool = False
    """iterative_dpo: retrain the reward model each cycle on all pairs so far (plus the original pairs)."""
    data_dir: str = "data/cycles"
    """Each flow writes its cycle data under <data_dir>/<flow>/ (DVC-tracked, overwritten each cycle)."""
    models_dir: str = "models/cycles"
    """Each cycle's policy goes to <models_dir>/<flow>/cycle_<k>."""
    version: bool = True
    """Commit each cycle's data (and retrained reward model) to git + DVC and push to the DVC remote."""
    push: bool = True
    """Push versioned data to the default DVC remote."""
    registered_model: str = "alignflow-policy"
    """Registry name of each cycle's policy (aliases: candidate, champion)."""
    seed: int = 0
    """Base sampling seed; cycle k samples with seed + k."""

    def __post_init__(self) -> None:
        s = "cycles"
        _check(self.cycles >= 1, s, "cycles", f"must be >= 1, got {self.cycles}")
        _check(self.scorer in ("reward_model", "rule"), s, "scorer", f"must be reward_model or rule, got {self.scorer!r}")
        _check(self.n_samples >= 2, s, "n_samples", f"must be >= 2, got {self.n_samples}")
        _check(self.temperature > 0, s, "temperature", f"must be > 0, got {self.temperature}")
        _check(self.max_prompts >= 0, s, "max_prompts", f"must be >= 0, got {self.max_prompts}")


GUARD_NAMES = ("reward_hacking", "reward_disagreement", "kl", "length", "entropy_collapse", "skill_regression")
"""Every guard (rlhf_core/promotion/guards.py), in the order tags and the model card list them."""


@dataclass
class GuardsConfig:
    """``guards``: checks on every policy stage's model against the model it was trained from, and the registry's
    promotion gate (rlhf_core/promotion/guards.py; README "Guards and the promotion gate"). ``tool_guards``: the same for
    the tool task's rl stage command (``--section tool_rl``)."""

    enabled: bool = True
    """Compute the guards after every policy stage (rl, dpo, kto, raft, distill, each cycle) and log them to its
    run as guard/* metrics and guard.* tags; both models answer the stage's held-out eval items."""
    gate: bool = True
    """The registry moves champion only when the gate passes (eval gain and no guard fired); false: the guards
    are logged and shown in the model card, and champion moves on the accuracy comparison alone."""
    gate_metric: str = "auto"
    """What must improve to promote: accuracy (paired exact match on labelled eval items), reward (the held-out
    reward score of the greedy answers: for eval data without labels, with the KL guard), command (the per-item
    scores of metric_command, paired by item id), or auto (accuracy when every eval item has a label, else
    reward)."""
    metric_command: str = ""
    """With gate_metric command: the command that scores a model, e.g. "python my_eval.py --model {model}
    --out {out}" ({model}: the model folder, {out}: the score file to write, {eval_file}: the stage's eval file).
    It writes JSON lines {"id": <string or integer>, "score": <number>}, one per item, higher better; parent and
    child must score the same ids (rlhf_core/promotion/metric_command.py). Run in the project root, without a shell; the
    parent's scores are cached on its md5, the eval file's and the command (with the md5 of each file it names)."""
    metric_command_timeout_s: float = 3600.0
    """Seconds one run of metric_command may take before the stage fails."""
    min_improvement_se: float = 2.0
    """Promote only when the gate metric rose by more than this many paired standard errors over the parent."""
    hacking_reward_se: float = 2.0
    """Reward hacking: the held-out reward score rose by more than this many paired standard errors ..."""
    hacking_eval_se: float = 2.0
    """... while eval accuracy did not rise by more than this many paired standard errors (flat or down)."""
    top_fraction: float = 0.1
    """Reward disagreement: the child's answers with the top reward scores (this fraction of items) ..."""
    top_agreement_se: float = 2.0
    """... are correct less often than all its answers by more than this many standard errors."""
    max_kl: float = 5.0
    """KL guard: mean over eval items of the summed per-token KL(child || reference) along the child's greedy
    answer, in nats; fires above this."""
    max_length_change: float = 0.5
    """Length guard: fires when the mean greedy answer length (characters) changed by more than this fraction."""
    min_entropy_ratio: float = 0.1
    """Entropy collapse: fires when the child's mean next-token entropy along its answers falls below this
    fraction of the parent's along its own."""
    skill_regression_se: float = 2.0
    """Per-skill (slice) regression: fires when a slice's paired accuracy change is below -this many SEs ..."""
    skill_min_drop: float = 0.05
    """... and below -this much (absolute accuracy)."""
    slice_field: str = "skill"
    """Eval-record field naming an item's slice; items without it are sliced by the embedded task's skill
    (sort, arithmetic) when their prompt parses as one, else not sliced."""
    reward_model_path: str = "models/reward"
    """Reward model that scores held-out answers for stages without a reward of their own (dpo, kto, raft,
    distill, cycles); rl scores with its own reward. Empty or missing folder: no reward guards for them."""
    advisory_guards: list[str] = field(default_factory=lambda: ["reward_disagreement"])
    """Guards that are computed, logged and shown on the model card (FIRED (advisory)) but do not block promotion.
    reward_disagreement is advisory by default: it also fires on the shipped PPO + reward model run, whose accuracy
    rises 11 s.e. (README "Guards and the promotion gate"); [] makes every guard block."""

    def __post_init__(self) -> None:
        s = "guards"
        unknown = sorted(set(self.advisory_guards) - set(GUARD_NAMES))
        _check(not unknown, s, "advisory_guards", f"unknown guard(s) {unknown}; guards are {', '.join(GUARD_NAMES)}")
        _check(self.gate_metric in ("auto", "accuracy", "reward", "command"), s, "gate_metric",
               f"must be auto, accuracy, reward or command, got {self.gate_metric!r}")
        if self.gate_metric == "command":
            _check("{model}" in self.metric_command and "{out}" in self.metric_command, s, "metric_command",
                   "gate_metric command needs a metric_command naming {model} (the model folder) and {out} (the "
                   f"score file it writes), got {self.metric_command!r}")
        else:
            _check(not self.metric_command, s, "metric_command",
                   f"is set but gate_metric is {self.gate_metric!r}: set gate_metric: command to gate on it")
        _check(self.metric_command_timeout_s > 0, s, "metric_command_timeout_s",
               f"must be > 0, got {self.metric_command_timeout_s}")
        _check(0.0 < self.top_fraction <= 1.0, s, "top_fraction", f"must be in (0, 1], got {self.top_fraction}")
        for name in ("max_kl", "max_length_change", "skill_min_drop"):
            _check(getattr(self, name) >= 0, s, name, f"must be >= 0, got {getattr(self, name)}")
        _check(0.0 <= self.min_entropy_ratio <= 1.0, s, "min_entropy_ratio",
               f"must be in [0, 1], got {self.min_entropy_ratio}")


@dataclass
class ToolGenerateConfig:
    """``tool_generate``: write the tool task's datasets."""

    section: ClassVar[str] = "tool_generate"

    out_dir: str = "data/tool"
    """Folder that receives sft.jsonl, prompts.jsonl and eval.jsonl."""
    seed: int = 4321
    """Seed of the problem draw and of the demonstrator's choices."""
    n_sft: int = 10000
    """Number of SFT demonstrations."""
    n_prompts: int = 1000
    """Number of RL prompts with labels."""
    n_eval: int = 500
    """Number of held-out evaluation items (disjoint from the other splits)."""
    skip_tool: float = 0.7
    """Fraction of demonstrations that skip the calculator and answer directly (a guess)."""
    guess_noise: float = 0.5
    """Fraction of those guesses that are a plausible wrong answer."""
    ops: str = "+-*"
    """Operators (any of + - *)."""
    max_add: int = 99
    """Largest operand of + and - (smallest: 0)."""
    max_mul_left: int = 99
    """Largest left operand of * (smallest: 0)."""
    max_mul_right: int = 9
    """Largest right operand of * (smallest: 0)."""

    def __post_init__(self) -> None:
        s = self.section
        for name in ("n_sft", "n_prompts", "n_eval"):
            _check(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("skip_tool", "guess_noise"):
            _check(0.0 <= getattr(self, name) <= 1.0, s, name, f"must be in [0, 1], got {getattr(self, name)}")
        _check(bool(self.ops) and set(self.ops) <= set("+-*"), s, "ops", f"must be some of '+-*', got {self.ops!r}")


@dataclass
class ToolEvalConfig:
    """``tool_evaluate``: greedy multi-turn accuracy and tool-call rate on held-out items."""

    section: ClassVar[str] = "tool_evaluate"

    eval_file: str = "data/tool/eval.jsonl"
    """Held-out prompts with labels."""
    max_items: int = 500
    """Items evaluated (the first of the file)."""
    max_turns: int = 2
    """Model turns per trajectory."""
    max_trajectory_tokens: int = 32
    """Response tokens per trajectory (turns and observations)."""
    max_new_tokens: int = 24
    """Tokens per model turn."""
    num_threads: int = 2
    """torch intra-op threads on CPU."""

    def __post_init__(self) -> None:
        for name in ("max_items", "max_turns", "max_trajectory_tokens", "max_new_tokens", "num_threads"):
            _check(getattr(self, name) >= 1, self.section, name, f"must be >= 1, got {getattr(self, name)}")


# The repository's embedded tool task (rlhf_core/rollout/tool_task.py): its own sections beside the default's. Not in
# the `alignflow init` template (flows/project_template/params.yaml): a user's project gets the default task only.
TOOL_TASK_SECTIONS = ("tool_generate", "tool_model", "tool_sft", "tool_data_report", "tool_rl", "tool_guards",
                      "tool_evaluate")

SECTIONS: dict[str, type] = {
    "generate": GenerateConfig,
    "model": ModelConfig,
    "sft": SFTConfig,
    "dpo": DPOConfig,
    "reward": RewardConfig,
    "kto": KTOConfig,
    "distill": DistillConfig,
    "rejection": RejectionConfig,
    "raft": RaftConfig,
    "rl": RLConfig,
    "cycles": CyclesConfig,
    "data_report": DataReportConfig,
    "evaluate": EvalConfig,
    "tracking": TrackingConfig,
    "flow": FlowConfig,
    "guards": GuardsConfig,
    "tool_generate": ToolGenerateConfig,
    "tool_model": ModelConfig,
    "tool_sft": SFTConfig,
    "tool_data_report": DataReportConfig,
    "tool_rl": RLConfig,
    "tool_guards": GuardsConfig,
    "tool_evaluate": ToolEvalConfig,
}

T = TypeVar("T")


# --------------------------------------------------------------------------------------
# Loading and overriding
# --------------------------------------------------------------------------------------


MAX_INT = 2 ** 63
"""Integers in a config stay below this in magnitude (what torch and numpy hold): a larger one is refused."""

def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Coerce a YAML value to a dataclass field's annotated type, or raise ConfigError."""
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "str": str, "bool": bool}.get(annotation, Any)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        if isinstance(value, bool) and bool in args:
            return value
        return _coerce(value, args[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        return [_coerce(item, typing.get_args(annotation)[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {shown(value)}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
        if abs(value) >= MAX_INT:
            raise ConfigError(f"{where}: integer out of range (at most 2**63 - 1 in magnitude), got {shown(value)}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {shown(value)}")
        if isinstance(value, int) and abs(value) >= MAX_INT:
            raise ConfigError(f"{where}: number out of range, got {shown(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool) \
                or isinstance(value, int) and abs(value) >= MAX_INT:
            raise ConfigError(f"{where}: expected a string, got {shown(value)}")
        return str(value)
    return value


OVERRIDE_SOURCE = "command line (--set)"
"""The source named by an error in a value given as an override rather than read from the params file."""

MAX_YAML_DEPTH = 32
"""Deepest nesting of collections a params file or ``--set`` value may have (params.yaml needs 3)."""
MAX_YAML_NODES = 100_000
"""Most values a params file or ``--set`` value may hold with every alias expanded (a "billion laughs"
file of nested aliases holds 10**9 in a few hundred bytes)."""


class _ParamsLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: nesting past :data:`MAX_YAML_DEPTH`, more than :data:`MAX_YAML_NODES`
    values with aliases expanded, and a key given twice in one mapping (DVC refuses that file too) are
    errors marked with their line."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        sizes: dict[int, int] = {}

        def size(n: Any) -> int:  # memoised per node: an alias is the node it names, counted each time used
            if id(n) not in sizes:
                sizes[id(n)] = MAX_YAML_NODES + 1  # until counted: an alias inside its own anchor never ends
                children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else \
                    n.value if isinstance(n, yaml.SequenceNode) else []
                sizes[id(n)] = 1 + sum(size(c) for c in children)
            return sizes[id(n)]

        if size(node) > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(None, None, f"more than {MAX_YAML_NODES} values with its aliases "
                                              "expanded", node.start_mark)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *defaults" merges; a key given after it wins
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable):  # an unhashable key is PyYAML's own error, next
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {shown(key)} appears twice in one "
                                                            "mapping", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _load_yaml(text: str, source: str) -> Any:
    """``text`` as YAML (:class:`_ParamsLoader`), else a ConfigError naming ``source`` and the line."""
    try:
        return yaml.load(text, Loader=_ParamsLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}:" if mark is not None else ""
        raise ConfigError(f"{source}:{line} not valid YAML: {exc}") from None
    except (ValueError, OverflowError) as exc:  # a scalar PyYAML resolves but cannot build: 2020-13-45, 10**5000
        raise ConfigError(f"{source}: a value YAML cannot read: {exc}") from None


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """Parse ``["lr=3e-4", "packing=true"]`` into a dict, values read as YAML scalars."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ConfigError(f"{OVERRIDE_SOURCE}: {shown(pair)}: expected field=value")
        key, raw = pair.split("=", 1)
        out[key.strip()] = _load_yaml(raw, f"{OVERRIDE_SOURCE}: {key.strip()}") if raw.strip() else ""
    return out

# Names other trainers (TRL, HF Trainer) use for a field alignflow spells differently: "did you mean" for them.
KNOWN_ALIASES = {"learning_rate": "lr", "per_device_train_batch_size": "batch_size",
                 "gradient_accumulation_steps": "grad_accum", "model_name_or_path": "model_path",
                 "num_generations": "group_size", "max_seq_length": "max_length"}


def unknown_field(section: str, key: str, known: set[str]) -> str:
    """``section.key: unknown field; did you mean section.<closest>?`` (difflib, or a known alias), else the
    known fields, clipped so the message stays a few lines."""
    import difflib

    alias = KNOWN_ALIASES.get(key)
    close = [alias] if alias in known else difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return f"{section}.{key}: unknown field; did you mean {section}.{close[0]}?"
    listed = ", ".join(sorted(known))
    if len(listed) > 240:
        listed = listed[:listed.rfind(", ", 0, 220)] + f", ... ({len(known)} in all)"
    return f"{section}.{key}: unknown field; known fields are {listed}"


def build_config(cls: type[T], section: str, values: dict[str, Any], source: str = "<overrides>",
                 overridden: typing.Collection[str] = ()) -> T:
    """Construct ``cls`` from a mapping, rejecting unknown keys and mistyped values.

    ``overridden``: the keys of ``values`` that came from overrides, not from ``source``: an error in one
    of them names :data:`OVERRIDE_SOURCE` instead, so a typo on the command line never blames the file."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section {section!r} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = OVERRIDE_SOURCE if key in overridden else source
        if key not in known:
            raise ConfigError(f"{where}: {unknown_field(section, str(key), known)}")
        kwargs[key] = _coerce(value, hints[key], f"{where}: {section}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        named = re.match(r"\A(\w++)\.\w++", message)  # the checks name "section.field: ..." first
        if named and named[1] != section:  # the same fields under another section's name (tool_rl): name this one
            message = section + message[len(named[1]):]
        # A check that names an overridden field (its own, or the other one of a cross-field check) blames the
        # command line: the file's value was fine until the override changed its partner.
        blamed = OVERRIDE_SOURCE if set(re.findall(r"\w+", message)) & set(overridden) else source
        raise ConfigError(f"{blamed}: {message}") from None


def read_params(path: str | Path) -> dict[str, Any]:
    """Read a params YAML file into a dict of sections, each a mapping or None (empty file -> empty dict)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: params file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the params file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a params file is YAML") from None
    data = _load_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: {unknown_sections(unknown)}")
    for name, values in data.items():
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{path}: section {name!r} must be a mapping of field: value, got "
                              f"{type(values).__name__}")
    return data


def unknown_sections(unknown: typing.Collection[str]) -> str:
    """``unknown section(s) [...]; did you mean ...?`` (difflib), else the known sections."""
    import difflib

    names = sorted(shown(name) if not isinstance(name, str) else name for name in unknown)
    close = {name: difflib.get_close_matches(name, sorted(SECTIONS), n=1, cutoff=0.6) for name in names}
    if all(close.values()):
        return f"unknown section(s) {names}; did you mean {', '.join(c[0] for c in close.values())}?"
    return f"unknown section(s) {names}; known: {', '.join(sorted(SECTIONS))}"


def load_config(cls: type[T], section: str, params_path: str | Path | None = "params.yaml",
                overrides: dict[str, Any] | None = None) -> T:
    """Load one stage's config from ``params_path`` (if it exists) plus overrides (errors in those name
    the command line, :data:`OVERRIDE_SOURCE`)."""
    values: dict[str, Any] = {}
    source = "<defaults>"
    if params_path is not None and Path(params_path).exists():
        values = dict(read_params(params_path).get(section) or {})
        source = str(params_path)
    values.update(overrides or {})
    return build_config(cls, section, values, source, overridden=set(overrides or {}))


def config_to_dict(config: Any) -> dict[str, Any]:
    """Flat dict of a config's fields (for MLflow params and cache keys)."""
    return dataclasses.asdict(config)


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field, read from the source (for ``--help``)."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(inspect.getsource(klass))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value).strip()
    return docs


__all__ = [
    "ConfigError", "GenerateConfig", "ModelConfig", "DataFields", "SFTConfig", "EvalConfig",
    "TrackingConfig", "FlowConfig", "GuardsConfig", "TrainerConfig", "DPOConfig", "RewardConfig", "RejectionConfig", "RLConfig", "SECTIONS", "build_config", "load_config", "read_params",
    "parse_overrides", "config_to_dict", "field_docs", "ToolGenerateConfig", "ToolEvalConfig", "TOOL_TASK_SECTIONS",
    "DataReportConfig",
]
