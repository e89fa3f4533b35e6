"""The offline training stages' sections: the fields every trainer shares (``TrainerConfig``) and one dataclass
per stage built on them (``sft``, ``dpo``, ``reward``, ``kto``, ``distill``, ``raft``). Online RL's is in
:mod:`rlhf_core.config.rl`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlhf_core.config.base import _check
from rlhf_core.config.data import DataFields


PRECISIONS = ("auto", "fp32", "mixed", "bf16")
SWITCHES = ("auto", "on", "off")
LM_HEADS = ("auto", "chunked", "liger", "full")
ATTENTIONS = ("auto", "sdpa", "varlen")
COMPILE_BACKENDS = ("inductor", "aot_eager")


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
    attention: str = "auto"
    """Attention of the training and scoring passes: auto (torch's variable-length flash kernel on a GPU, SDPA
    elsewhere), sdpa, or varlen (forced; its torch reference on a CPU)."""
    compile_backend: str = "inductor"
    """torch.compile backend of compile_layers: inductor, or aot_eager (the same traced graphs run by eager
    kernels: tells a difference of inductor's kernels from one of the tracing; CPU tests use it)."""
    collective_timeout_s: float = 600.0
    """Seconds a rank waits in a collective for a peer that stopped answering before the run fails."""
    stack_dump_s: float = 0.0
    """Every this many seconds each process of the run writes every thread's Python stack to stderr (for a
    run that hangs; 0: off)."""

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
                              ("compile_layers", SWITCHES), ("lm_head", LM_HEADS), ("attention", ATTENTIONS),
                              ("compile_backend", COMPILE_BACKENDS)):
            _check(getattr(self, name) in allowed, s, name,
                   f"must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        _check(self.collective_timeout_s > 0, s, "collective_timeout_s",
               f"must be > 0 seconds, got {self.collective_timeout_s}")
        _check(self.stack_dump_s >= 0, s, "stack_dump_s", f"must be >= 0 seconds (0: off), got {self.stack_dump_s}")
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
