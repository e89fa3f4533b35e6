"""alignflow and TRL 1.16 side by side: GRPO step, SFT / DPO / reward-model training, on one model and data.

Both frameworks get the same model, data, batch shape and optimizer settings (the ``settings`` line
prints every value, and the differences that remain). Every row -- one side in one setting -- runs in
its own fresh child process; rows run in ABBA order (round 1 over the row list, round 2 reversed, ...)
so load drift hits all of them; the summary gives each row's median and range of per-step times over
all its timed steps plus the per-round medians (never the best round), and the ratios ours / TRL for
matching regimes.

Variants (model shapes; random weights built on the device, no download):

* ``cpu``: the embedded default (``models/sft``, ``data/embedded``), fp32, torch threads fixed. Rows
  ``ours-fp32,trl-fp32``. After ``make bench-cpu`` (it installs the ``bench`` extra, i.e. TRL; in a worktree
  without the dvc outputs, ``--cpu-root`` names a checkout that has them)::

      .venv/bin/python bench/side_by_side.py --variant cpu --out bench/results/side_by_side_cpu.json

* ``gpu``: Qwen2-0.5B shape (24 layers, hidden 896, 14 heads, 2 KV heads), a 32k byte-level BPE built
  here. GRPO 64 prompts x 8 x 256 new tokens; SFT 32 x 512 tokens; DPO / RM 32 pairs x 512.
* ``gpu-1.5b``: Qwen2.5-1.5B shape (28 layers, hidden 1536, MLP 8960, 12 heads, 2 KV heads) with the real
  Qwen vocabulary size, 151,936 (the 32k tokenizer's ids are a subset: the LM head and softmax cost what
  Qwen2.5's do). GRPO 64 x 8 x 256; SFT 16 x 1024; DPO / RM 16 pairs x 1024.
* ``gpu-32b-lora`` (issue 22; ours, grpo only): Qwen2.5-32B shape (64 layers, hidden 5120, MLP 27648, 40 heads,
  8 KV heads, untied head, vocab 152,064) on eight GPUs: LoRA r 16 on every linear layer over a frozen ZeRO-3
  base, the reference the base with the adapters off, one rollout replica beside rank 0. GRPO 8 x 4 x 128.
* ``gpu-7b``: Qwen2-7B shape (28 layers, hidden 3584, MLP 18944, 28 heads, 4 KV heads, untied head,
  vocab 151,936) on four GPUs, saved as a sharded safetensors directory both sides load. Ours: the Ray
  launcher, ``num_workers=4, parallel=zero3`` (GRPO: colocated placement, 4 policy ranks and 4 rollout
  replicas, like ``bench/gpu_grpo.py --placement``); TRL: ``accelerate launch --num_processes 4`` with a
  DeepSpeed ZeRO-3 config this script writes. GRPO 32 x 8 x 256; SFT 32 x 512; DPO / RM 16 pairs x 512.
  One AB round by default (model loads dominate a 10-minute call).

Rows (``--rows``, comma-separated; default: all five on a GPU variant):

* ``ours-mixed`` / ``ours-bf16``: ``precision: mixed`` / ``bf16`` with our best settings
  (``fused_kernels: auto, lm_head: auto``, padded batches; ``ours-*-packed``: ``packing: true``, for GRPO each
  update micro-batch and log-prob chunk one padding-free row, what rl's ``packing: auto`` does on a GPU),
  ``gradient_checkpointing: auto``; its logged choice is captured per row).
* ``trl-default``: a bf16 model, ``bf16=True`` (compare with ours-bf16). NB TRL 1.16 given a model *path*
  loads fp32 (``model_init_kwargs`` dtype defaults to float32): that is our ``trl-mixed`` row.
* ``trl-mixed``: an fp32 model under ``bf16=True`` autocast (compare with ours-mixed).
* ``trl-best``: trl-default plus ``use_liger_kernel=True`` (liger-kernel from ``bench/device_wheels.sh``),
  padding-free SFT (``padding_free=True`` through ``packing=True, packing_strategy="bfd"``: TRL 1.16 refuses
  padding_free alone, and at these lengths a block holds one truncated example; its DPO falls back to
  padding, its RewardConfig has no such option), ``cache_implementation="static"`` for GRPO's HF generate. Compared with ours-best (the faster of
  our rows).
* TRL's ``gradient_checkpointing`` follows ours' logged choice for the same benchmark and regime once
  ours ran in this call (``--trl-grad-ckpt match``, like with like), else TRL's default (on); every row
  records its own setting and where it came from.

On a lent GPU: once here, ``bash bench/device_wheels.sh`` (Ray, DeepSpeed, TRL 1.16, liger-kernel 0.8.5 into
``.devwheels``); every call carries ``.devwheels`` and starts with ``source bench/device_setup.sh``. A
10-minute call holds one benchmark of a variant (or a subset of rows); each call rebuilds the model::

    # nvidia-h100-x1: 0.5B, one benchmark per call, all five rows, 2 ABBA rounds (10 children)
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu --rounds 2 \
        --bench sft --out $OUT/side_by_side_0p5b_sft.json
    # ... --bench dpo / --bench rm the same; GRPO in two calls of rows:
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu --rounds 2 --bench grpo \
        --rows ours-bf16,trl-default,trl-best --out $OUT/side_by_side_0p5b_grpo_a.json
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu --rounds 2 --bench grpo \
        --rows ours-mixed,trl-mixed --out $OUT/side_by_side_0p5b_grpo_b.json
    # nvidia-h100-x1: 1.5B (151,936 vocab), likewise one benchmark per call
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-1.5b --rounds 2 \
        --bench sft --out $OUT/side_by_side_1p5b_sft.json
    # nvidia-h100-x4: 7B, one AB round of one pair per call
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-7b \
        --bench grpo --rows ours-bf16,trl-default --out $OUT/side_by_side_7b_grpo.json
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-7b \
        --bench dpo --rows ours-bf16,trl-default --out $OUT/side_by_side_7b_dpo.json
    # nvidia-h100-x4: 1 -> 4 GPU scaling at a fixed global batch (ours, ZeRO-2), then the summary
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-1.5b --bench sft,dpo \
        --rows ours-bf16 --rounds 1 --gpus 1 --work /tmp/bw15 --out $OUT/scaling_1gpu.json && \
      python bench/side_by_side.py --variant gpu-1.5b --bench sft,dpo --rows ours-bf16 --rounds 1 --gpus 4 \
        --parallel zero2 --work /tmp/bw15 --out $OUT/scaling_4gpu.json && \
      python bench/side_by_side.py --scaling $OUT/scaling_1gpu.json $OUT/scaling_4gpu.json --out $OUT/scaling.json

Options for ours' rows: ``--micro-batch-tokens N`` (packed rows: a token budget per micro-batch; at 1.5B 8,192 lets
``gradient_checkpointing: auto`` choose off), ``--lm-head`` (ours' ``lm_head``, default auto), ``--grad-ckpt`` (ours'
``gradient_checkpointing``, default auto; TRL's matches it), ``--global-batch G``
(a step of G rows, each rank's micro-batch the variant's batch: the 1 -> N scaling pair at a fixed global batch
with the same work per GPU), ``--profile``
(torch.profiler over steps 4-6 of each offline row, rank 0's under Ray ranks, and over the third policy
update of the grpo bench on one device: device busy time, the idle gaps between kernels and what the host ran during
the largest; a where-the-time-goes run, not a timing), ``--sync-census`` (grpo on one GPU: every wait of the host for the device
in the third policy update, counted by where it was made; ``bench/ab_processes.sh`` runs old and new trees in
turn)::

    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-1.5b --rounds 2 --bench dpo,rm \
        --rows ours-mixed-packed --micro-batch-tokens 8192 --out $OUT/side_by_side_1p5b_packed.json
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu --rounds 1 --bench sft \
        --rows ours-mixed-packed --profile --out $OUT/prof_0p5b_sft.json

A device call returns at most 8 files from ``$OUT``: keep a call's outputs under that.

Ratios are only quoted between rows of one call (one machine). The result file is rewritten after every
child, so a call cut off at its limit keeps what ran; ``--resummarize FILE`` recomputes its summaries.

Settings shared by both sides (the ``settings`` line has every value):

* Optimizer: AdamW, betas (0.9, 0.95), eps 1e-8, weight decay 0.01 on matrices only (biases and norms
  undecayed on both sides), clip 1.0; learning-rate schedule irrelevant (timed steps only). Left
  different only under ZeRO (TRL's default ``adamw_torch_fused`` against our ``torch.optim.AdamW``,
  multi-tensor, which DeepSpeed wraps as a client optimizer); elsewhere both sides run torch's fused kernel
  (ours on a GPU on fp32 masters or copies of the bf16 weights, on a CPU on the fp32 weights).
* GRPO: KL coefficient beta > 0 on both (both compute reference log-probs); one policy update per
  generated batch (ours: ``mini_batch_size`` = every row, one PPO epoch; TRL: ``steps_per_generation`` =
  gradient accumulation, ``num_iterations = 1``); the same micro-batch rows. Ours generates with our
  static-cache engine (CUDA graphs on a GPU), TRL with HF ``generate`` (vLLM off). Reward: completion
  length / 1000 on both.
* DPO: both compute the reference per step (ours ``precompute_reference: false``, TRL
  ``precompute_ref_log_probs=False``), sigmoid loss, no NLL term.

Hygiene: ``--rounds`` ABBA rounds (default 2; 1 for gpu-7b), the first ``--warmup`` steps of every child
dropped; ONE matmul ceiling per call, the max of 3 measurements at the start and 3 at the end (all
stored), used by every row; torch thread counts, device names and versions recorded. Every child (and
Ray actor, and accelerate rank) runs with NVLink multicast off: NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.

Figures: tokens/s count real (non-padding) tokens; fraction of the ``6 N T`` ceiling (DPO ``8 N T``:
the reference forward too) with N the parameters that do a matmul per token (the LM head, not the input
embedding; RM: no LM head) over the ceiling x GPUs. Peak memory: ``torch.cuda.max_memory_allocated``,
summed over the processes sharing a GPU (colocated Ray roles) and the max over GPUs, and beside it the most
they held at one moment (``peak_memory_gb_concurrent``: half-second windows summed, :func:`concurrent_peak_gb`,
which shows a colocated replica freeing its weights between phases); nvidia-smi's
``memory.used`` (every process, the allocator's cache too) is sampled beside it. GRPO floor: prefill of
each prompt once per group + per decode step max(weights + KV bytes / bandwidth, 2 N B / peak) over the
measured mean response + 2 N T (reference) + 6 N T (update) over the real tokens, prompts counted once
per group.

``--small`` runs every code path on a micro model on the CPU (a smoke test), the new variants too
(the real vocabulary, the sharded save and load); for gpu-7b ours runs 2 Ray ranks under ZeRO-3 on gloo
and TRL one process on the same sharded directory (the accelerate command and DeepSpeed file are written
and recorded, not launched: on a CPU, HF's Trainer under DeepSpeed with ``use_cpu`` stops at zero.Init
with a world size of 1, and without ``use_cpu`` refuses bf16).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BENCHES = ("grpo", "sft", "dpo", "rm")
# NVLink multicast off in every process (rlhf_core.trainers.ray_launcher sets the same for Ray actors)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
QWEN_VOCAB = 151_936

# --------------------------------------------------------------------------------------
# Variants: model shape, data shape, batch and steps of every benchmark
# --------------------------------------------------------------------------------------

QWEN2_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2)
QWEN25_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2)
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4)
QWEN25_32B = dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                  num_key_value_heads=8)
SMALL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1)

SETTINGS = {
    "cpu": dict(model="models/sft", threads=1, seed=0, gpus=1, rounds=2,
                grpo=dict(prompts="data/embedded/prompts.jsonl", prompts_per_step=32, group_size=8,
                          max_new_tokens=12, temperature=1.0, beta=0.1, lr=3e-4, micro_rows=32, steps=5),
                sft=dict(data="data/embedded/sft.jsonl", batch=64, max_length=64, lr=3e-4, steps=12),
                dpo=dict(data="data/embedded/preferences.jsonl", batch=32, max_length=64, lr=3e-5, steps=12,
                         beta=0.1),
                rm=dict(data="data/embedded/preferences.jsonl", batch=32, max_length=64, lr=1e-4, steps=12)),
    "gpu": dict(model="Qwen2-0.5B shape, 32k vocab", shape=QWEN2_0_5B, vocab=0, tie=True, shard="",
                threads=8, seed=0, gpus=1, rounds=2, words=dict(prompt=64, completion=192, response=128),
                grpo=dict(prompts="prompts.jsonl", prompts_per_step=64, group_size=8, max_new_tokens=256,
                          temperature=1.0, beta=0.04, lr=1e-6, micro_rows=128, steps=4),
                sft=dict(data="sft.jsonl", batch=32, max_length=512, lr=1e-5, steps=8),
                dpo=dict(data="pairs.jsonl", batch=32, max_length=512, lr=1e-6, steps=8, beta=0.1),
                rm=dict(data="pairs.jsonl", batch=32, max_length=512, lr=1e-6, steps=8)),
    "gpu-1.5b": dict(model="Qwen2.5-1.5B shape, vocab 151,936", shape=QWEN25_1_5B, vocab=QWEN_VOCAB, tie=True,
                     shard="", threads=8, seed=0, gpus=1, rounds=2,
                     words=dict(prompt=128, completion=384, response=256),
                     grpo=dict(prompts="prompts.jsonl", prompts_per_step=64, group_size=8, max_new_tokens=256,
                               temperature=1.0, beta=0.04, lr=1e-6, micro_rows=32, steps=4),
                     sft=dict(data="sft.jsonl", batch=16, max_length=1024, lr=1e-5, steps=8),
                     dpo=dict(data="pairs.jsonl", batch=16, max_length=1024, lr=1e-6, steps=8, beta=0.1),
                     rm=dict(data="pairs.jsonl", batch=16, max_length=1024, lr=1e-6, steps=8)),
    "gpu-7b": dict(model="Qwen2-7B shape, vocab 151,936, sharded safetensors", shape=QWEN2_7B, vocab=QWEN_VOCAB,
                   tie=False, shard="2GB", threads=8, seed=0, gpus=4, rounds=1,
                   words=dict(prompt=64, completion=192, response=128),
                   grpo=dict(prompts="prompts.jsonl", prompts_per_step=32, group_size=8, max_new_tokens=256,
                             temperature=1.0, beta=0.04, lr=1e-6, micro_rows=16, steps=4),
                   sft=dict(data="sft.jsonl", batch=32, max_length=512, lr=1e-5, steps=4),
                   dpo=dict(data="pairs.jsonl", batch=16, max_length=512, lr=1e-6, steps=4, beta=0.1),
                   rm=dict(data="pairs.jsonl", batch=16, max_length=512, lr=1e-6, steps=4)),
    # issue 22: one GRPO step of a 32B-shaped policy, LoRA adapters (r 16) over a frozen ZeRO-3 base on eight GPUs;
    # the reference is the base itself (adapters off, no reference model), one rollout replica beside rank 0
    # takes merged weights (BENCHMARKS.md, "32B-shaped LoRA GRPO: the memory plan"). Ours only, grpo only.
    "gpu-32b-lora": dict(model="Qwen2.5-32B shape, vocab 152,064, sharded safetensors, LoRA r 16 over ZeRO-3",
                         shape=QWEN25_32B, vocab=152_064, tie=False, shard="5GB", threads=8, seed=0, gpus=8, rounds=1,
                         words=dict(prompt=64, completion=192, response=128), lora_rank=16, rollout_workers=1,
                         grpo=dict(prompts="prompts.jsonl", prompts_per_step=8, group_size=4, max_new_tokens=128,
                                   temperature=1.0, beta=0.04, lr=1e-5, micro_rows=4, steps=2),  # 1 timed step
                         sft=dict(data="sft.jsonl", batch=8, max_length=512, lr=1e-5, steps=3),
                         dpo=dict(data="pairs.jsonl", batch=8, max_length=512, lr=1e-6, steps=3, beta=0.1),
                         rm=dict(data="pairs.jsonl", batch=8, max_length=512, lr=1e-6, steps=3)),
}


def make_small(variant: str) -> None:
    """``--small``: the variant's code paths on a micro model and short runs (a CPU smoke test).
    The vocabulary stays the variant's (151,936 on 1.5b/7b: ids beyond the tokenizer's are exercised)."""
    s = SETTINGS[variant]
    s.update(threads=1, shape=SMALL_SHAPE, shard="4MB" if s.get("shard") else "",
             words=dict(prompt=16, completion=48, response=32))
    if s["gpus"] > 1:
        s["gpus"] = 2  # two Ray ranks under ZeRO-3 on gloo
    s["grpo"].update(prompts_per_step=4, group_size=4, max_new_tokens=16, micro_rows=4, steps=3)
    for name in ("sft", "dpo", "rm"):
        s[name].update(batch=4, max_length=128, steps=3)


def apply_global_batch(variant: str, global_batch: int) -> None:
    """``--global-batch G`` (ours' offline rows, scaling runs): a step of G rows in every benchmark, each rank's
    micro-batch the variant's own batch size (so one GPU accumulates G / batch micro-batches and N GPUs
    G / (N x batch)); the figures count G rows a step."""
    s = SETTINGS[variant]
    for name in ("sft", "dpo", "rm"):
        b = s[name]
        micro = b.get("micro_rows_per_rank", b["batch"])
        if global_batch % (micro * s["gpus"]):
            raise SystemExit(f"--global-batch {global_batch}: not a multiple of {micro} rows x {s['gpus']} GPUs")
        b.update(micro_rows_per_rank=micro, batch=global_batch, grad_accum=global_batch // (micro * s["gpus"]))


# Rows: one side in one setting. ``regime`` pairs ours with TRL.
ROWS = {
    "ours-mixed": dict(side="alignflow", precision="mixed", regime="mixed"),
    "ours-bf16": dict(side="alignflow", precision="bf16", regime="bf16"),
    "ours-fp32": dict(side="alignflow", precision="fp32", regime="fp32"),
    # padded rows (what ours-mixed / ours-bf16 now run; the names of the 2026-11-27 result files)
    "ours-mixed-padded": dict(side="alignflow", precision="mixed", regime="mixed", packing=False),
    "ours-bf16-padded": dict(side="alignflow", precision="bf16", regime="bf16", packing=False),
    # padding-free rows: on a GPU through torch's variable-length flash kernel (rlhf_core.models.attention)
    "ours-mixed-packed": dict(side="alignflow", precision="mixed", regime="mixed", packing=True),
    "ours-bf16-packed": dict(side="alignflow", precision="bf16", regime="bf16", packing=True),
    "trl-default": dict(side="trl", model_dtype="bfloat16", bf16=True, best=False, regime="bf16"),
    "trl-mixed": dict(side="trl", model_dtype="float32", bf16=True, best=False, regime="mixed"),
    "trl-best": dict(side="trl", model_dtype="bfloat16", bf16=True, best=True, regime="bf16"),
    # TRL at its best in the mixed regime: an fp32 model under bf16 autocast, liger + padding-free
    "trl-mixed-best": dict(side="trl", model_dtype="float32", bf16=True, best=True, regime="mixed"),
    "trl-fp32": dict(side="trl", model_dtype="float32", bf16=False, best=False, regime="fp32"),
}
DEFAULT_ROWS = {"cpu": "ours-fp32,trl-fp32"}
GPU_ROWS = "ours-mixed,ours-bf16,trl-default,trl-mixed,trl-best"
# (ours, TRL) pairs compared; ours-best is the faster of ours-mixed and ours-bf16
PAIRS = (("ours-mixed", "trl-mixed"), ("ours-bf16", "trl-default"), ("ours-best", "trl-best"),
         ("ours-mixed-padded", "trl-mixed"), ("ours-bf16-padded", "trl-default"), ("ours-best", "trl-default"),
         ("ours-mixed-packed", "trl-mixed"), ("ours-bf16-packed", "trl-default"),
         ("ours-mixed", "trl-mixed-best"), ("ours-mixed-packed", "trl-mixed-best"), ("ours-bf16-packed", "trl-best"),
         ("ours-fp32", "trl-fp32"))
# Our "best" settings, passed through the config on every ours row
OURS_BEST = dict(fused_kernels="auto", lm_head="auto", packing=False, gradient_checkpointing="auto")
OPTIMIZER = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=1.0)


def schedule(rows: list[str], rounds: int) -> list[tuple[int, str]]:
    """ABBA: (round, row) in run order, the row list reversed on every second round."""
    return [(r, row) for r in range(rounds) for row in (rows if r % 2 == 0 else rows[::-1])]


# --------------------------------------------------------------------------------------
# Inputs: tokenizer, data (parent, CPU), model (a child, on the device), DeepSpeed file
# --------------------------------------------------------------------------------------


def build_inputs(variant: str, work: Path, small: bool) -> dict:
    """Tokenizer and the four data files here; the model in a child process (the parent keeps off CUDA)."""
    s = SETTINGS[variant]
    inputs: dict = {"variant": variant, "small": small, "dir": str(work), "gpus": s["gpus"],
                    "parallel": s.get("parallel") or ("zero3" if s["gpus"] > 1 else "ddp")}
    if variant == "cpu":
        return {**inputs, "root": str(REPO), "model": str(REPO / s["model"])}
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_grpo import build_tokenizer

    inputs["tokenizer"] = str(build_tokenizer(32000, work / "tok"))
    rng = random.Random(0)
    words = open(os.__file__).read().split()
    w = s["words"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    rows = max(s[n]["batch"] * (s[n]["steps"] + 2) for n in ("sft", "dpo", "rm"))
    with (work / "prompts.jsonl").open("w") as fh:
        for i in range(max(64 * 8, s["grpo"]["prompts_per_step"] * (s["grpo"]["steps"] + 2))):
            fh.write(json.dumps({"prompt": f"Question {i}: compute {i}*{i + 3} and explain", "label": "x"}) + "\n")
    with (work / "sft.jsonl").open("w") as fh:
        for _ in range(rows):
            fh.write(json.dumps({"prompt": text(w["prompt"]), "completion": text(w["completion"])}) + "\n")
    with (work / "pairs.jsonl").open("w") as fh:
        for _ in range(rows):
            fh.write(json.dumps({"prompt": text(w["prompt"]), "chosen": text(w["response"]),
                                 "rejected": text(w["response"])}) + "\n")
    if s["gpus"] > 1:
        inputs["deepspeed_config"] = write_deepspeed_config(work / "ds_zero3.json")
    return inputs


def build_model(inputs: dict) -> dict:
    """Child ``build``: the variant's Qwen2-shaped model with random weights, initialised on the device in
    bf16 (no fp32 copy on the host), saved as safetensors -- sharded where the variant says."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    s = SETTINGS[inputs["variant"]]
    tok = AutoTokenizer.from_pretrained(inputs["tokenizer"])
    cfg = Qwen2Config(vocab_size=s["vocab"] or len(tok), **s["shape"], tie_word_embeddings=s["tie"],
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.eos_token_id)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(s["seed"])
    started = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    built = time.perf_counter()
    out = Path(inputs["dir"]) / "model"
    model.save_pretrained(str(out), safe_serialization=True, **({"max_shard_size": s["shard"]} if s["shard"] else {}))
    tok.save_pretrained(str(out))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    return {"model": str(out), "device": str(next(model.parameters()).device), "build_s": round(built - started, 2),
            "save_s": round(time.perf_counter() - built, 2), "shards": len(shards),
            "index": (out / "model.safetensors.index.json").exists(), "params": sum(p.numel() for p in model.parameters())}


def write_deepspeed_config(path: Path) -> str:
    """TRL's ZeRO-3 file: ``auto`` values filled by the HF Trainer from the TrainingArguments (batch,
    accumulation, clipping, bf16); no optimizer section, so the Trainer's AdamW (betas, eps, decay as set)
    is DeepSpeed's client optimizer, as ours is."""
    cfg = {"zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                 "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_gather_16bit_weights_on_model_save": False},
           "bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return str(path)


def _paths(inputs: dict, name: str) -> tuple[str, str]:
    """(model dir, data file) of a benchmark."""
    s = SETTINGS[inputs["variant"]]
    key = "prompts" if name == "grpo" else "data"
    if inputs["variant"] == "cpu":
        return inputs["model"], str(Path(inputs["root"]) / s[name][key])
    return inputs["model"], str(Path(inputs["dir"]) / s[name][key])


def _reward_file(work: Path) -> str:
    path = work / "length_reward.py"
    path.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 1000 for c in completions]\n")
    return f"{path}:reward"


# --------------------------------------------------------------------------------------
# In every child, rank and Ray actor: log capture, thread counts, peak memory
# --------------------------------------------------------------------------------------


def _child_logging() -> None:
    """rlhf_core's INFO lines (``gradient_checkpointing auto: on/off ...``) to stderr, where the parent reads them."""
    import logging

    logger = logging.getLogger("rlhf_core")
    if not any(getattr(h, "_bench", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._bench = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logging.getLogger("rlhf_core.trainers.rl").setLevel(logging.DEBUG)  # each RL phase's start and end


def _peak_writer(peak_dir: str | None):
    """Write this process's peak device memory to ``peak_dir/<pid>.json`` every half second (Ray actors are
    killed at the end: the last write stands); returns a function that writes once more now."""
    if not peak_dir:
        return lambda: None
    path = Path(peak_dir) / f"{os.getpid()}.json"
    lock = threading.Lock()  # the thread and a final flush share the temporary file

    def write() -> None:
        with lock:
            _write_peak(path)

    def loop() -> None:
        while True:
            try:
                write()
            except Exception:  # noqa: BLE001 - best effort; a torn-down CUDA context at exit
                pass
            time.sleep(0.5)

    threading.Thread(target=loop, daemon=True).start()
    return write


# This process's device memory, per GPU uuid: the all-time peak (GB) and half-second windows
# ``[start, end, peak GB]``. Each write reads the allocator's peak since the last one, then resets it, so the
# windows of processes sharing a GPU can be summed at each moment (:func:`concurrent_peak_gb`): the sum of
# their whole-run peaks counts a colocated replica's rollout memory and the learner's update memory as if both
# were held at once, and would hide a replica that frees its weights between the two (rl.rollout.sleep).
_PEAKS: dict[str, float] = {}
_WINDOWS: dict[str, list[list[float]]] = {}
_WINDOW_START = [time.time()]


def _write_peak(path: Path) -> None:
    import torch

    now = time.time()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):  # a rank's own GPU: the one its allocator used
            peak = torch.cuda.memory_stats(i).get("allocated_bytes.all.peak", 0)
            # the next window starts from what is allocated now (an allocation that rises and falls in the
            # microseconds between the read and the reset is missed)
            torch.cuda.reset_peak_memory_stats(i)
            if peak:
                dev = str(torch.cuda.get_device_properties(i).uuid)
                _PEAKS[dev] = max(_PEAKS.get(dev, 0.0), peak / 2**30)
                _WINDOWS.setdefault(dev, []).append([round(_WINDOW_START[0], 3), round(now, 3), peak / 2**30])
    else:
        _PEAKS[f"host:{os.getpid()}"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    _WINDOW_START[0] = now
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "peak_gb": _PEAKS, "windows_gb": _WINDOWS}))
    tmp.replace(path)


def concurrent_peak_gb(processes: list[list[list[float]]]) -> float:
    """The most memory the processes sharing one device held at one moment, from each one's windows
    ``[start, end, peak GB]`` (back to back, in time order): the max over window starts t of the sum, over
    processes, of the peak of the window holding t. An upper bound of the true concurrent peak (a window's peak
    may come at another moment of it), and never above the sum of the processes' whole-run peaks."""
    best = 0.0
    for t in sorted({w[0] for windows in processes for w in windows}):
        best = max(best, sum(next((w[2] for w in windows if w[0] <= t < w[1]), 0.0) for windows in processes))
    return best


def _read_peaks(peak_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Peak GB per device, processes sharing a GPU (colocated roles) summed: the sum of their whole-run peaks,
    and their peak at one moment (:func:`concurrent_peak_gb`; GPUs only)."""
    by_device: dict[str, float] = {}
    windows: dict[str, list[list[list[float]]]] = {}
    for f in peak_dir.glob("*.json"):
        try:
            record = json.loads(f.read_text())
            for dev, gb in record["peak_gb"].items():
                by_device[dev] = by_device.get(dev, 0.0) + gb
            for dev, series in record.get("windows_gb", {}).items():
                windows.setdefault(dev, []).append(series)
        except (OSError, ValueError, KeyError):
            continue
    return by_device, {dev: concurrent_peak_gb(series) for dev, series in windows.items()}


def _threads() -> dict:
    import torch

    return {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def _peak_memory_gb() -> float:
    import torch

    if torch.cuda.is_available():  # the peak writer resets the allocator's peak each window and keeps the max
        return max([torch.cuda.max_memory_allocated() / 2**30, *(v for k, v in _PEAKS.items() if not k.startswith("host:"))])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _in_actor(factory: str, peak_dir: str, *args, **kwargs):
    """A Ray actor's role, built by ``rlhf_core.trainers.rl_on_ray.<factory>`` after the log capture and the peak
    writer start (looked up by name in the actor, where the launcher is not patched)."""
    from rlhf_core.trainers import rl_on_ray

    _child_logging()
    _peak_writer(peak_dir)
    return getattr(rl_on_ray, factory)(*args, **kwargs)


RANK0_PROFILE = "rank0.profile"  # ``--profile`` under Ray ranks: rank 0's summary, in the child's peak folder


def _rank_main(train: str, peak_dir: str, cfg, sink=None, show_progress: bool = False, profile: dict | None = None):
    """One data-parallel rank of an offline trainer (``module:function``), with log capture and peak writer;
    with ``profile`` (``--profile`` on several GPUs), rank 0 (the rank given a sink) runs under torch.profiler
    and leaves its summary in ``peak_dir`` (:data:`RANK0_PROFILE`)."""
    import importlib

    _child_logging()
    flush = _peak_writer(peak_dir)
    module, fn = train.split(":")
    if profile and sink is not None and peak_dir:
        sink = _ForwardingProfiler(profile, sink)
    try:
        return getattr(importlib.import_module(module), fn)(cfg, sink=sink, show_progress=show_progress)
    finally:
        flush()
        if isinstance(sink, _ForwardingProfiler):
            sink.close()
            (Path(peak_dir) / RANK0_PROFILE).write_text(json.dumps(sink.summary))


# --------------------------------------------------------------------------------------
# Children: one side, one setting, one benchmark -> per-step times
# --------------------------------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))
        if "perf/step_s" in metrics:  # as it happens: a child cut off at its limit keeps its steps (run_child)
            print(json.dumps({"partial_step": {k: v for k, v in metrics.items() if k.startswith("perf/")}}),
                  flush=True)


    def close(self) -> None:
        pass


class _ProfilingSink(_Sink):
    """``--profile``: torch.profiler over ``active`` training steps after ``skip`` (a step ends when the loop
    logs it, so ``prof.step()`` runs there). The summary: wall seconds per profiled step, the device's busy
    seconds in them (sum of kernel and copy times, one stream at a time here) and the top ops by device and
    by host time. A profiled row's step times carry the profiler's overhead: not for the figures."""

    def __init__(self, spec: dict) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        super().__init__()
        self.active = int(spec.get("active", 3))
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                            schedule=schedule(wait=int(spec.get("skip", 2)), warmup=1, active=self.active),
                            on_trace_ready=self._ready)
        self.summary: dict = {}
        self.marks: list[float] = []
        self.prof.start()

    def log_metrics(self, metrics: dict, step: int) -> None:
        super().log_metrics(metrics, step)
        self._mark(metrics)

    def _mark(self, metrics: dict) -> None:
        """A logged step ends the profiler's step (and its wall time is kept for the summary)."""
        if "perf/elapsed_s" in metrics:
            self.marks.append(metrics["perf/elapsed_s"])
            self.prof.step()

    def _ready(self, prof) -> None:
        try:
            self._summarize(prof)
        except Exception as exc:  # noqa: BLE001 -- a profile that cannot be read must not cost the row
            self.summary = {"error": f"{type(exc).__name__}: {exc}"}

    def _summarize(self, prof) -> None:
        events = prof.key_averages()
        # steps actually profiled (fewer than ``active`` when the run ends first: a short --small run)
        n = next((e.count for e in events if e.key.startswith("ProfilerStep")), self.active) or self.active
        walls = [b - a for a, b in zip(self.marks, self.marks[1:])][-n:]
        self.summary = {"active_steps": n, **_profile_summary(prof, walls, n)}

    def close(self) -> None:
        self.prof.stop()


class _ForwardingProfiler(_ProfilingSink):
    """:class:`_ProfilingSink` on rank 0 of Ray ranks: the metrics also go on to the rank's own sink (the queue
    to the driver), and the partial-step lines are not printed (an actor's stdout is not the child's)."""

    def __init__(self, spec: dict, inner) -> None:
        super().__init__(spec)
        self.inner = inner

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.inner.log_metrics(metrics, step)
        self._mark(metrics)


def _profile_summary(prof, walls: list[float], n: int) -> dict:
    """A profile of ``n`` steps of wall seconds ``walls``: the device's busy seconds a step (kernels and
    copies, annotations left out), the top ops by device and by host time, and the idle gaps."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    # kernels (and copies); ops' own device time repeats these, annotations span them
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not _annotation(e.key)]
    device_us = sum(e.self_device_time_total for e in kernels)
    by_device = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
    by_host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    return {"step_wall_s": [round(w, 4) for w in walls],
            "device_busy_s_per_step": round(device_us / 1e6 / n, 4),
            "device_busy_share": round(device_us / 1e6 / max(sum(walls), 1e-9), 3),
            "top_device_ops": [{"op": e.key[:90], "calls": e.count // n,
                                "device_ms_per_step": round(e.self_device_time_total / 1e3 / n, 3)}
                               for e in by_device],
            "top_host_ops": [{"op": e.key[:90], "calls": e.count // n,
                              "host_ms_per_step": round(e.self_cpu_time_total / 1e3 / n, 3)}
                             for e in by_host],
            "device_idle": _idle_gaps(prof.events(), n)}


# The RL phases a watch can wrap (``--profile-phase``): the method of rl_roles that runs each one in this process.
_WATCHED = {"update": ("PolicyLearner", "update"), "reference": ("ReferenceScorer", "logprobs")}


class _UpdateWatch:
    """Something run around one call of an RL phase of this process (``spec["phase"]``: the policy update by
    default, or the reference pass; the ``skip + 1``-th call, past compiles and warm-up): :meth:`around` gets the
    call as ``run`` and leaves its findings in ``summary`` under ``key``."""

    key = ""

    def __init__(self, spec: dict) -> None:
        self.at = int(spec.get("skip", 2)) + 1
        self.phase = spec.get("phase", "update")
        self.summary: dict = {}

    def install(self) -> None:
        from rlhf_core.trainers import rl_roles

        owner = getattr(rl_roles, _WATCHED[self.phase][0])
        method = _WATCHED[self.phase][1]
        original, calls, around = getattr(owner, method), [0], self.around

        def watched(role, *args, **kwargs):
            calls[0] += 1
            run = functools.partial(original, role, *args, **kwargs)
            return around(run) if calls[0] == self.at else run()

        setattr(owner, method, watched)

    def around(self, run):
        raise NotImplementedError


class _UpdateProfile(_UpdateWatch):
    """``--profile`` on the grpo bench: torch.profiler over one update call, summarised as the offline rows' steps
    are. One process (no Ray ranks). The profiled step's times carry the profiler's overhead: not for the figures."""

    key = "update_profile"

    def around(self, run):
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            out = run()
            sync()
        wall = time.perf_counter() - start
        try:
            self.summary = {"phase": self.phase, "update_call": self.at, **_profile_summary(prof, [wall], 1)}
        except Exception as exc:  # noqa: BLE001 -- a profile that cannot be read must not cost the row
            self.summary = {"error": f"{type(exc).__name__}: {exc}"}
        return out


class _UpdateSyncCensus(_UpdateWatch):
    """``--sync-census`` on the grpo bench: every wait of the host for the device during one update call, counted
    by where it was made. Runs the call under ``torch.cuda.set_sync_debug_mode("warn")`` (a host read of a device
    value, a blocking copy, a ``nonzero`` warns) and keeps, for each warning, the innermost frames outside torch's
    own files (no transformers frame shows in the lent image's census: its files seem to sit under a ``/torch/``
    path there, so a wait inside transformers is named by the caller of the model). One process, GPU only (a CPU never waits); the row's times then carry the warnings' cost: not
    for the figures."""

    key = "update_sync_census"

    def around(self, run):
        import collections
        import traceback
        import warnings

        import torch

        if not torch.cuda.is_available():
            self.summary = {"error": "no CUDA device: a CPU run has no waits to count"}
            return run()
        where: collections.Counter = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and "/warnings.py" not in f.filename]
            where[" < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:][::-1])] += 1

        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.summary = {"update_call": self.at, "waits": sum(where.values()),
                        "where": dict(where.most_common())}
        return out


def _annotation(name: str) -> bool:
    """A profiler range drawn on the device timeline (``ProfilerStep#``, ``Optimizer.step#...``), not a kernel."""
    return name.startswith("ProfilerStep") or "#" in name


def _idle_gaps(events, steps: int, top: int = 12) -> dict:
    """Where the device waited: gaps between consecutive kernels (their union) over the profiled steps, with
    the host ops running during each of the largest (what the host was doing while the device sat idle)."""
    from torch.autograd import DeviceType

    kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == DeviceType.CUDA and not _annotation(e.name))
    if not kern:
        return {}
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == DeviceType.CPU and not e.name.startswith("ProfilerStep")]
    gaps, end, before = [], kern[0][1], kern[0][2]
    for start, stop, name in kern[1:]:
        if start > end:
            gaps.append((start - end, end, start, before, name))
        if stop > end:
            end, before = stop, name
    span = kern[-1][1] - kern[0][0]
    idle = sum(g[0] for g in gaps)

    def during(a: float, b: float) -> list[str]:
        overlap: dict[str, float] = {}
        for s0, s1, name in host:
            o = min(b, s1) - max(a, s0)
            if o > 0.5 * (b - a):  # ran through most of the gap
                overlap[name] = min(overlap.get(name, math.inf), s1 - s0)
        return [k[:60] for k, _ in sorted(overlap.items(), key=lambda kv: kv[1])[:4]]  # innermost first

    return {"span_ms_per_step": round(span / 1e3 / steps, 2), "idle_ms_per_step": round(idle / 1e3 / steps, 2),
            "gaps_over_100us_per_step": round(sum(g[0] > 100 for g in gaps) / steps, 1),
            "idle_in_gaps_over_1ms_per_step": round(sum(g[0] for g in gaps if g[0] > 1000) / 1e3 / steps, 2),
            "largest": [{"ms": round(g[0] / 1e3, 2), "after": g[3][:60], "before": g[4][:60],
                         "host_during": during(g[1], g[2])} for g in sorted(gaps, reverse=True)[:top]]}


TRAINERS = {"sft": "rlhf_core.trainers.sft:train_sft", "dpo": "rlhf_core.trainers.dpo:train_dpo",
            "rm": "rlhf_core.trainers.reward:train_reward_model"}


def _ours_settings(task: dict, work: Path) -> dict:
    """The config fields every ours row shares: paths, precision, threads, optimizer, ranks, OURS_BEST and the
    command line's overrides (lm_head, compile_layers, gradient_checkpointing, micro_batch_tokens)."""
    inputs, name, row = task["inputs"], task["bench"], ROWS[task["row"]]
    s = SETTINGS[inputs["variant"]]
    common = dict(output_dir=str(work / "out"), checkpoint_dir=str(work / "ckpt"), save_every=0,
                  precision=row["precision"], num_threads=s["threads"], seed=s["seed"],
                  weight_decay=OPTIMIZER["weight_decay"], max_grad_norm=OPTIMIZER["max_grad_norm"],
                  num_workers=inputs["gpus"], parallel=inputs["parallel"],
                  **{**OURS_BEST, "packing": row.get("packing", OURS_BEST["packing"])})
    for key in ("lm_head", "compile_layers", "gradient_checkpointing"):
        if task.get(key):
            common[key] = task[key]
    if common["packing"] and task.get("micro_batch_tokens") and name != "grpo":  # rl packs micro_batch_size rows
        common["micro_batch_tokens"] = task["micro_batch_tokens"]
    return common


def ours(task: dict) -> dict:
    import torch

    inputs, name = task["inputs"], task["bench"]
    s = SETTINGS[inputs["variant"]]
    gpus = inputs["gpus"]
    torch.manual_seed(s["seed"])
    work = Path(tempfile.mkdtemp(prefix=f"bench-ours-{name}-"))
    common = _ours_settings(task, work)
    sink = _ProfilingSink(task["profile"]) if task.get("profile") and name != "grpo" and gpus == 1 else _Sink()
    run = _ours_grpo if name == "grpo" else _ours_offline
    return run(task, common, sink, work)


def _ours_grpo(task: dict, common: dict, sink: Any, work: Path) -> dict:
    """One GRPO run of ours (one process, or Ray ranks with colocated replicas): its step times and phases."""
    import torch

    from rlhf_core.config import RENAMED, RLConfig, build_config, config_params
    from rlhf_core.trainers.rl import train_rl

    inputs = task["inputs"]
    s, gpus, peak_dir = SETTINGS[inputs["variant"]], inputs["gpus"], os.environ.get("BENCH_PEAK_DIR", "")
    # ZeRO-3 partitions the weights, so its rollout replicas live on Ray even on one GPU (placement none, where the
    # engine samples from this process's policy, is refused under zero3: RLConfig); --gpus 1 --parallel zero3 then
    # runs the eight-GPU variants' path on one device
    on_ray = gpus > 1 or inputs["parallel"] == "zero3"
    b = s["grpo"]
    model, data = _paths(inputs, "grpo")
    rows = b["prompts_per_step"] * b["group_size"]
    cfg = build_config(RLConfig, "rl", {"model_path": model, "prompts_file": data, "eval_file": data,
                                        "reward.function": _reward_file(work), "algorithm.estimator": "grpo",
                                        "max_steps": b["steps"], "rollout.prompts_per_step": b["prompts_per_step"],
                                        "rollout.group_size": b["group_size"],
                                        "rollout.max_new_tokens": b["max_new_tokens"],
                                        "rollout.temperature": b["temperature"], "kl.coef": b["beta"], "lr": b["lr"],
                                        "algorithm.mini_batch_size": rows, "micro_batch_size": task.get("micro_rows")
                                        or b["micro_rows"], "algorithm.ppo_epochs": 1, "batch_size": rows,
                                        "max_length": b["max_new_tokens"] + 64, "warmup_steps": 0, "eval_items": 1,
                                        "eval_at_start": False, "log_rollouts_every": 0, "rollout.engine": "static",
                                        "distribution.placement": "colocated" if on_ray else "none",
                                        "distribution.rollout_workers": s.get("rollout_workers", gpus),
                                        "lora_rank": s.get("lora_rank", 0),
                       # Ray only: the memory switches (--rollout-sleep, --shard-reference) as the command line sets them
                       **({"rollout.sleep": task.get("rollout_sleep") or "auto",
                           "distribution.shard_reference": task.get("shard_reference", "on") == "on"} if on_ray
                           else {}),
                       **common})
    _sync()
    update_profile = _UpdateProfile(task["profile"]) if task.get("profile") and not on_ray else None
    if update_profile is None and task.get("sync_census") and not on_ray:
        update_profile = _UpdateSyncCensus({"skip": 2})
    if update_profile is not None:
        update_profile.install()
    if on_ray:
        from rlhf_core.trainers import rl_on_ray

        for factory in ("_learner", "_reference", "RolloutReplica"):
            setattr(rl_on_ray, factory, functools.partial(_in_actor, factory, peak_dir))
        rl_on_ray.train_rl_on_ray(cfg, sink, show_progress=False)
    else:
        train_rl(cfg, sink, show_progress=False)
    steps = [m for _, m in sink.rows if "perf/step_s" in m]
    return {"step_s": [m["perf/step_s"] for m in steps],
            "phase_s": {k: [m[k] for m in steps] for k in ("perf/rollout_s", "perf/reward_s", "perf/logprob_s",
                                                         "perf/update_s", "perf/weight_sync_s")},
            "response_len": [m["rollout/response_length"] for m in steps], "peak_memory_gb": _peak_memory_gb(),
            # engine vs learner log-probs of the sampled tokens: a weight sync that scrambled weights shows here
            "logprob_mismatch": [m.get("rollout/logprob_mismatch") for m in steps],
            "engine": "alignflow StaticCacheEngine" + (" + CUDA graphs" if torch.cuda.is_available() else ""),
            "launch": f"Ray, colocated, {inputs['parallel']}" if on_ray else "one process",
            "settings": {k: config_params(cfg)[RENAMED.get(k, k)] for k in ("precision", "gradient_checkpointing",
                                                                            "fused_kernels",
                                                      "compile_layers", "lm_head", "packing", "num_workers", "parallel",
                                                      "micro_batch_size", "mini_batch_size", "kl_coef",
                                                      "lora_rank", "rollout_workers", "rollout_sleep",
                                                      "shard_reference")},
            **({update_profile.key: update_profile.summary} if update_profile is not None else {}),
            "threads": _threads()}


def _ours_offline(task: dict, common: dict, sink: Any, work: Path) -> dict:
    """One SFT, DPO or reward-model run of ours: the time between logged steps."""
    from rlhf_core.models import attention
    from rlhf_core.config import DPOConfig, RewardConfig, SFTConfig

    inputs, name = task["inputs"], task["bench"]
    gpus, peak_dir = inputs["gpus"], os.environ.get("BENCH_PEAK_DIR", "")
    b = SETTINGS[inputs["variant"]][name]
    model, data = _paths(inputs, name)
    held_out = _paths(inputs, "grpo")[1]  # prompt + label rows: the end-of-run eval (not timed) reads 1
    accum = b.get("grad_accum", 1)  # --global-batch: a step of b["batch"] rows in accum draws
    shared = dict(model_path=model, train_file=data, eval_file=held_out, max_steps=b["steps"],
                  batch_size=b["batch"] // accum, grad_accum=accum,
                  max_length=b["max_length"], lr=b["lr"], warmup_steps=0, log_every=1, eval_items=1, **common)
    if name == "sft":
        cfg = SFTConfig(**shared)
    elif name == "dpo":
        cfg = DPOConfig(**shared, beta=b["beta"], precompute_reference=False, nll_weight=0.0)
    else:
        cfg = RewardConfig(**{**shared, "eval_file": data})  # pairs as the held-out file: no split of the train rows
    profile: dict = {}
    if gpus > 1:
        from rlhf_core.trainers.ray_launcher import train_data_parallel

        train_data_parallel(functools.partial(_rank_main, TRAINERS[name], peak_dir, profile=task.get("profile")),
                            cfg, sink, show_progress=False)
        written = Path(peak_dir) / RANK0_PROFILE if peak_dir else None
        if written is not None and written.exists():
            profile = {"rank": 0, **json.loads(written.read_text())}
    else:
        _rank_main(TRAINERS[name], "", cfg, sink)
    elapsed = [m["perf/elapsed_s"] for _, m in sink.rows if "perf/elapsed_s" in m]
    sink.close()
    if isinstance(sink, _ProfilingSink):
        profile = sink.summary
    return {"step_s": [b2 - a for a, b2 in zip([0.0] + elapsed, elapsed)], "peak_memory_gb": _peak_memory_gb(),
            **({"profile": profile} if profile else {}),
            "launch": f"Ray, {gpus} ranks, {inputs['parallel']}" if gpus > 1 else "one process",
            # decoder-layer attention calls by path in this process (packed rows on a GPU: varlen); one rank's
            # under Ray ranks live in other processes, so both stay 0 there
            "attention_layer_calls": dict(attention.calls),
            "settings": {k: config_params(cfg)[RENAMED.get(k, k)] for k in ("precision", "gradient_checkpointing",
                                                                            "fused_kernels",
                                                      "compile_layers", "lm_head", "packing", "micro_batch_tokens",
                                                      "num_workers", "parallel", "batch_size", "grad_accum",
                                                      "max_length", "weight_decay")},
            "threads": _threads()}


def _trl_timer(times: list[float], lengths: list[float], rank: int) -> Any:
    """A TrainerCallback that appends each step's seconds to ``times`` and GRPO's mean completion length to
    ``lengths``."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        """Step end to step end (the first from the start of training), like ours' elapsed-time differences:
        the Trainer fetches and collates a step's batches before ``on_step_begin``, so that would leave them out."""

        def on_train_begin(self, args, state, control, **kw):
            _sync()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync()
            now = time.perf_counter()
            times.append(now - self.t)
            self.t = now
            if rank == 0:  # as it happens: a child cut off at its limit keeps its steps (run_child)
                print(json.dumps({"partial_step": {"perf/step_s": times[-1]}}), flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    return Timer()


def _trl_trainer(name: str, row: dict, b: dict, common: dict, settings: dict, records: list, model_dir: str,
                 dtype: Any, tok: Any, world: int) -> Any:
    """TRL's trainer for ``name`` (its config first, then the models: under ZeRO-3 ``from_pretrained`` then
    partitions at load); adds what it chose to ``settings``."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    def causal_lm():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")

    pairs = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in records] if name in ("dpo", "rm") else []
    if name == "grpo":
        rows = b["prompts_per_step"] * b["group_size"]
        accum = rows // (b["micro_rows"] * world)

        def reward(completions, **kw):
            return [len(c) / 1000 for c in completions]

        extra = {"cache_implementation": "static"} if row["best"] else {}
        settings.update(extra, per_device_train_batch_size=b["micro_rows"], steps_per_generation=accum)
        cfg = trl.GRPOConfig(**common, per_device_train_batch_size=b["micro_rows"], gradient_accumulation_steps=accum,
                             steps_per_generation=accum, num_iterations=1, num_generations=b["group_size"],
                             max_completion_length=b["max_new_tokens"], temperature=b["temperature"], beta=b["beta"],
                             use_vllm=False, **extra)
        return trl.GRPOTrainer(model=causal_lm(), reward_funcs=reward, args=cfg, processing_class=tok,
                               train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in records]))
    if name == "sft":
        ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in records])
        # TRL 1.16 refuses padding_free without packing (max_length would not be enforced): packing with
        # best-fit decreasing is its padding-free path. Rows here exceed or nearly fill max_length, so a
        # block holds one truncated example and a step the same real tokens as ours.
        pack = dict(packing=True, packing_strategy="bfd", padding_free=True) if row["best"] else {}
        settings["padding_free"] = pack or False
        cfg = trl.SFTConfig(**common, per_device_train_batch_size=b["batch"] // world, max_length=b["max_length"],
                            **pack)
        return trl.SFTTrainer(model=causal_lm(), args=cfg, train_dataset=ds, processing_class=tok)
    if name == "dpo":
        settings["padding_free"] = "not available in TRL 1.16's DPOTrainer (it falls back to padding)"
        cfg = trl.DPOConfig(**common, per_device_train_batch_size=b["batch"] // world, max_length=b["max_length"],
                            beta=b["beta"], precompute_ref_log_probs=False)
        return trl.DPOTrainer(model=causal_lm(), ref_model=causal_lm(), args=cfg, train_dataset=Dataset.from_list(pairs),
                              processing_class=tok)
    settings["padding_free"] = "no such option in TRL 1.16's RewardConfig"
    cfg = trl.RewardConfig(**common, per_device_train_batch_size=b["batch"] // world, max_length=b["max_length"])
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype, num_labels=1,
                                                               attn_implementation="sdpa")
    model.config.pad_token_id = tok.pad_token_id
    return trl.RewardTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(pairs), processing_class=tok)


def trl_side(task: dict) -> dict:
    import torch
    import trl
    from transformers import AutoTokenizer

    from rlhf_core.data.io import read_records

    inputs, name, row = task["inputs"], task["bench"], ROWS[task["row"]]
    s = SETTINGS[inputs["variant"]]
    b = s[name]
    world = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate launch sets it on every rank
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(s["seed"])
    torch.set_num_threads(s["threads"])
    model_dir, data = _paths(inputs, name)
    gpu = torch.cuda.is_available()
    # TRL 1.16's liger path patches the causal-LM forward: on the reward model's sequence-classification
    # head it fails ("no attribute 'lm_head'", side_by_side_h200_0p5b_rm.json), so its best RM is its default
    liger = bool(row["best"]) and gpu and name != "rm"
    if liger:
        import liger_kernel  # noqa: F401  (trl-best without it would not be TRL's best: fail, not fall back)
    tok = AutoTokenizer.from_pretrained(model_dir)
    times: list[float] = []
    lengths: list[float] = []
    grad_ckpt = bool(task["trl_grad_ckpt"]["on"])
    common = dict(output_dir=tempfile.mkdtemp(prefix=f"bench-trl-{name}-"), learning_rate=b["lr"],
                  lr_scheduler_type="constant", warmup_steps=0,
                  max_steps=b["steps"], use_cpu=not gpu, bf16=row["bf16"], logging_steps=1, report_to="none",
                  save_strategy="no", gradient_checkpointing=grad_ckpt, seed=s["seed"], dataloader_num_workers=0,
                  adam_beta1=OPTIMIZER["betas"][0], adam_beta2=OPTIMIZER["betas"][1], adam_epsilon=OPTIMIZER["eps"],
                  weight_decay=OPTIMIZER["weight_decay"], max_grad_norm=OPTIMIZER["max_grad_norm"],
                  use_liger_kernel=liger)
    if world > 1:
        common["deepspeed"] = inputs["deepspeed_config"]  # also given to accelerate launch; ZeRO-3 init at load
    settings = {"model_dtype": row["model_dtype"], "bf16": row["bf16"], "use_liger_kernel": liger,
                "gradient_checkpointing": grad_ckpt, "gradient_checkpointing_source": task["trl_grad_ckpt"]["source"],
                "optimizer": f"HF default optim, betas {OPTIMIZER['betas']}, eps {OPTIMIZER['eps']}, "
                             f"weight decay {OPTIMIZER['weight_decay']}", "world_size": world}
    if row["best"] and not gpu:
        settings["use_liger_kernel_note"] = "off: no CUDA (CPU smoke)"
    elif row["best"] and name == "rm":
        settings["use_liger_kernel_note"] = "off: TRL 1.16's liger forward needs an LM head (the RM has none)"
    trainer = _trl_trainer(name, row, b, common, settings, read_records(data), model_dir,
                           getattr(torch, row["model_dtype"]), tok, world)
    trainer.add_callback(_trl_timer(times, lengths, rank))
    trainer.train()
    if name == "sft" and row["best"] and "seq_lengths" in trainer.train_dataset.column_names:
        blocks = trainer.train_dataset["seq_lengths"]  # bfd packing: the examples' lengths in each block
        settings["packing_check"] = {"blocks": len(blocks),
                                     "examples_per_block": round(sum(map(len, blocks)) / len(blocks), 4),
                                     "tokens_per_block": round(sum(map(sum, blocks)) / len(blocks), 2)}
    out = {"step_s": times, "peak_memory_gb": _peak_memory_gb(), "trl": trl.__version__, "settings": settings,
           "launch": f"accelerate launch --num_processes {world}, DeepSpeed ZeRO-3" if world > 1 else "one process",
           "threads": _threads(), "rank": rank}
    if name == "grpo":
        out.update(response_len=lengths, engine="TRL HF generate (use_vllm=False"
                   + (", static cache)" if row["best"] else ")"))
    return out


def measure_ceiling(inputs: dict, reps: int = 3) -> dict:
    """Child ``ceiling``: ``reps`` measurements of the matmul peak (bf16 8192^3 on a GPU, fp32 1024^3 on the
    CPU at the benchmark's thread count) and of device copy bandwidth; the parent keeps them all."""
    import torch

    s = SETTINGS[inputs["variant"]]
    if torch.cuda.is_available() and inputs["variant"] != "cpu":
        dev, dtype, n, device = torch.device("cuda"), torch.bfloat16, 8192, torch.cuda.get_device_name(0)
    else:
        torch.set_num_threads(s["threads"])
        dev, dtype, n, device = torch.device("cpu"), torch.float32, 1024, "cpu"
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    flops, bws = [], []
    x = torch.empty(2**28, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    for _ in range(reps):
        _sync()
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        _sync()
        flops.append(2 * n**3 / ((time.perf_counter() - t) / 10))
        t = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        _sync()
        bws.append(2 * x.numel() / ((time.perf_counter() - t) / 5))
    return {"matmul_flops": flops, "copy_bytes_per_s": bws, "device": device, "matmul": f"{dtype} {n}^3",
            "threads": _threads()}


def child_main(kind: str, task: dict) -> None:
    _child_logging()
    flush = _peak_writer(os.environ.get("BENCH_PEAK_DIR"))
    fn = {"alignflow": ours, "trl": trl_side, "ceiling": measure_ceiling, "build": build_model}[kind]
    result = fn(task if kind in ("alignflow", "trl") else task["inputs"])
    if kind in ("alignflow", "trl"):
        import torch

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    flush()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"result": result}), flush=True)


# --------------------------------------------------------------------------------------
# Parent: children in fresh processes, nvidia-smi beside them
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def trl_launch_command(inputs: dict) -> list[str]:
    """The TRL side's launcher on several GPUs: accelerate with the script's ZeRO-3 file."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(inputs["gpus"]),
            "--num_machines", "1", "--use_deepspeed", "--deepspeed_config_file", inputs["deepspeed_config"],
            "--zero3_init_flag", "true", "--main_process_port", str(_free_port())]


def run_child(kind: str, task: dict, timeout_s: float) -> dict:
    """One fresh child process; its result line, the gradient-checkpointing lines it logged, peak memory
    of every process it started (per GPU) and nvidia-smi's peak per GPU."""
    inputs = task["inputs"]
    peak_dir = Path(tempfile.mkdtemp(prefix="bench-peaks-"))
    launcher = [sys.executable]
    if kind == "trl" and inputs["gpus"] > 1 and not inputs["small"]:
        launcher = trl_launch_command(inputs)
    cmd = launcher + [__file__, "--child", kind, "--task", json.dumps(task)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "BENCH_PEAK_DIR": str(peak_dir), **NO_MULTICAST}
    scratch = None
    if kind in ("alignflow", "trl"):
        # A training child's outputs and checkpoints go to its own temporary folder, removed when it ends: left
        # behind, a 1.5B run's (6 GB model, 21 GB mixed-precision checkpoint) filled the disk by the fifth row.
        scratch = Path(tempfile.mkdtemp(prefix="bench-child-"))
        env["TMPDIR"] = str(scratch)
    smi = None
    smi_log = peak_dir / "nvidia-smi.csv"  # a file, not a pipe: a full pipe would stall the sampler
    if kind in ("alignflow", "trl") and _has_nvidia_smi():
        with smi_log.open("w") as fh:
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                    "-lms", "200"], stdout=fh, text=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout_s)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, rc = _text(exc.stdout), _text(exc.stderr) + f"\n[bench] timed out after {timeout_s} s", -9
    wall = time.perf_counter() - started
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    used: dict[str, float] = {}
    if smi is not None:
        smi.terminate()
        smi.wait()
        for line in smi_log.read_text().splitlines():
            try:
                idx, mib = (x.strip() for x in line.split(","))
                used[idx] = max(used.get(idx, 0.0), float(mib) / 1024)
            except ValueError:  # a line cut short when the sampler was stopped
                continue
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{\"result\"")]
    if os.environ.get("BENCH_CHILD_LOG_DIR"):  # whole stderr of every child (the result keeps its last 4,000 chars)
        log_dir = Path(os.environ["BENCH_CHILD_LOG_DIR"])
        log_dir.mkdir(parents=True, exist_ok=True)
        label = "-".join(str(x) for x in (kind, task.get("bench", ""), task.get("row", ""), task.get("round", "")) if x)
        (log_dir / f"{label}-{int(started)}.log").write_text(stderr)
    if rc != 0 or not lines:
        # the steps it printed before it failed or was cut off (never summarised as a row: the bench's own
        # figures need a finished child; these are for reading what happened)
        partial = [json.loads(ln)["partial_step"] for ln in stdout.splitlines() if ln.startswith("{\"partial_step\"")]
        return {"error": f"exit {rc}: {stderr[-4000:]}", "wall_s": round(wall, 1),
                **({"partial_steps": partial} if partial else {})}
    result = json.loads(lines[-1])["result"]
    result["wall_s"] = round(wall, 1)
    if kind in ("alignflow", "trl"):
        by_device, concurrent = _read_peaks(peak_dir)
        gpus = {k: v for k, v in by_device.items() if not k.startswith("host:")}
        by_device = gpus or by_device  # a Ray driver's host memory is no GPU's
        result["peak_memory_gb_by_device"] = {k: round(v, 3) for k, v in by_device.items()}
        result["peak_memory_gb"] = max([result["peak_memory_gb"], *by_device.values()])
        if concurrent:
            result["peak_memory_gb_concurrent_by_device"] = {k: round(v, 3) for k, v in concurrent.items()}
            result["peak_memory_gb_concurrent"] = max(concurrent.values())
        if used:
            result["nvidia_smi_peak_used_gb_by_gpu"] = {k: round(v, 2) for k, v in sorted(used.items())}
        found = re.findall(r"gradient_checkpointing(?: auto)?: (on|off)[^\n]*", stdout + "\n" + stderr)
        logged = re.search(r"gradient_checkpointing(?: auto)?: (?:on|off)[^\n]*", stdout + "\n" + stderr)
        if kind == "alignflow":
            result["gradient_checkpointing"] = ({"on": found[0] == "on", "log": logged.group(0), "ranks_logged": len(found)}
                                                if found else {"on": None, "log": "no gradient_checkpointing line logged"})
    return result


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


@functools.cache
def _has_nvidia_smi() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def trl_checkpointing(row: str, decided: dict[str, bool], mode: str) -> dict:
    """TRL's gradient_checkpointing for ``row``: ours' logged choice in the same regime (else any ours
    row's) once known (``match``), else TRL's default (on); or forced on/off."""
    if mode in ("on", "off"):
        return {"on": mode == "on", "source": f"--trl-grad-ckpt {mode}"}
    regime = ROWS[row]["regime"]
    same = [r for r in decided if ROWS[r]["regime"] == regime]
    if same:
        return {"on": decided[same[0]], "source": f"matches {same[0]}'s logged choice"}
    if decided:
        first = next(iter(decided))
        return {"on": decided[first], "source": f"matches {first}'s logged choice (no ours row of this regime yet)"}
    return {"on": True, "source": "TRL default (no ours row had run yet)"}


# --------------------------------------------------------------------------------------
# Summary: medians and ranges, fractions of 6NT, floors, ratios, targets
# --------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def row_summary(name: str, row_runs: list[dict], warmup: int, ceiling: dict, facts: dict, variant: str) -> dict:
    s = SETTINGS[variant]
    b = s[name]
    ok = [r for r in row_runs if "error" not in r and r.get("step_s")]
    if not ok:
        errs = [r.get("error", "no steps") for r in row_runs]
        return {"error": (errs[-1] if errs else "not run")[-1500:]}
    timed = [t for r in ok for t in r["step_s"][warmup:]]
    if not timed:
        return {"error": f"no timed steps (every child ran <= {warmup} warm-up steps)"}
    med = _median(timed)
    need = 3 if s["gpus"] > 1 else 5  # the issue's minimum: 5 timed steps a side (7B: 3)
    entry = {"median_step_s": round(med, 4), "range_step_s": [round(min(timed), 4), round(max(timed), 4)],
             "round_medians_s": [round(_median(r["step_s"][warmup:]), 4) for r in ok], "timed_steps": len(timed),
             "enough_timed_steps": len(timed) >= need, "device": ok[0].get("device"),
             "runs_ok": len(ok), "runs_failed": len(row_runs) - len(ok),
             "peak_memory_gb": round(max(r["peak_memory_gb"] for r in ok), 2),
             "settings": ok[0].get("settings"), "launch": ok[0].get("launch"), "threads": ok[0].get("threads")}
    concurrent = [r["peak_memory_gb_concurrent"] for r in ok if "peak_memory_gb_concurrent" in r]
    if concurrent:
        entry["peak_memory_gb_concurrent"] = round(max(concurrent), 2)
    smi = [v for r in ok for v in r.get("nvidia_smi_peak_used_gb_by_gpu", {}).values()]
    if smi:
        entry["nvidia_smi_peak_used_gb"] = round(max(smi), 2)
    ckpt = [r.get("gradient_checkpointing") or {"on": r.get("settings", {}).get("gradient_checkpointing"),
                                                 "source": r.get("settings", {}).get("gradient_checkpointing_source")}
            for r in ok]
    entry["gradient_checkpointing"] = ckpt[0] if all(c.get("on") == ckpt[0].get("on") for c in ckpt) else ckpt
    F = ceiling["matmul_flops"] * s["gpus"]
    if name == "grpo":
        rows = b["prompts_per_step"] * b["group_size"]
        resp = _median([x for r in ok for x in r.get("response_len", [])[warmup:]] or
                       [x for r in ok for x in r.get("response_len", [])])
        entry.update(engine=ok[0].get("engine"), samples_per_s=round(rows / med, 1), median_response_len=resp,
                     generated_tokens_per_s=round(rows * resp / med, 1))
        if "phase_s" in ok[0]:
            entry["phase_s"] = {k.split("/")[1]: round(_median([x for r in ok for x in r["phase_s"][k][warmup:]]), 4)
                                for k in ok[0]["phase_s"]}
        fl = floor(variant, name, ceiling, facts, resp)
        entry["floor_s"], entry["fraction_of_floor"] = fl["step_s"], round(fl["step_s"] / med, 4)
    else:
        tokens = facts["tokens_per_row"][name] * b["batch"]
        check = (entry["settings"] or {}).get("packing_check")
        if check:  # TRL's packed blocks: the real tokens a step of b["batch"] blocks holds
            tokens = check["tokens_per_block"] * b["batch"]
        factor = 8 if name == "dpo" else 6
        n = facts["rm_flop_params"] if name == "rm" else facts["flop_params"]
        entry.update(real_tokens_per_step=round(tokens), tokens_per_s=round(tokens / med, 1),
                     **{f"fraction_of_{factor}NT": round(factor * n * tokens / med / F, 4)})
    return entry


def floor(variant: str, name: str, ceiling: dict, facts: dict, response_len: float | None = None) -> dict:
    """The physical floor of one step: FLOPs over the measured matmul peak, bytes over the copy bandwidth
    (summed over the variant's GPUs)."""
    s = SETTINGS[variant]
    b = s[name]
    gpus = s["gpus"]
    F, BW = ceiling["matmul_flops"] * gpus, ceiling["copy_bytes_per_s"] * gpus
    N = facts["flop_params"]
    if name != "grpo":
        tokens = facts["tokens_per_row"][name] * b["batch"]
        factor = 8 if name == "dpo" else 6  # DPO: + the reference's forward (2 N T)
        n = facts["rm_flop_params"] if name == "rm" else N  # RM: a scalar head, no LM head
        return {"step_s": round(factor * n * tokens / F, 4), "rule": f"{factor} N T / peak"}
    rows, prompts = b["prompts_per_step"] * b["group_size"], b["prompts_per_step"]
    P, R = facts["mean_prompt_tokens"], response_len or b["max_new_tokens"]
    bytes_per = 2 if variant != "cpu" else 4
    # every rank holds the whole weights while it generates (ZeRO-3 gathers them): bytes x gpus over gpus x BW
    kv = facts["kv_bytes_per_token"] * rows * (P + R / 2)  # mean cache length over the decode
    decode = max((N * bytes_per * gpus + kv) / BW, 2 * N * rows / F)  # N: the matrices a decode step reads
    prefill = 2 * N * prompts * P / F  # each prompt once per group (its KV cache shared by the group's samples)
    tokens = prompts * P + rows * R  # training passes: prompts once per group, completions as generated
    gen, ref, upd = prefill + R * decode, 2 * N * tokens / F, 6 * N * tokens / F
    return {"step_s": round(gen + ref + upd, 4), "generation_s": round(gen, 4), "reference_s": round(ref, 4),
            "update_s": round(upd, 4),
            "rule": "2 N prompts P / peak + R x max(bytes/BW, 2 N B / peak) + 2 N T / peak + 6 N T / peak, "
                    "T = prompts P + rows R (prompts once per group), R our rows' measured median response"}


def bench_summary(variant: str, name: str, runs: dict[str, list[dict]], warmup: int, ceiling: dict,
                  facts: dict) -> dict:
    out: dict = {"rows": {row: row_summary(name, rr, warmup, ceiling, facts, variant) for row, rr in runs.items()}}
    rows = out["rows"]
    ours_ok = [r for r in ("ours-mixed", "ours-bf16", "ours-mixed-padded", "ours-bf16-padded", "ours-mixed-packed",
                           "ours-bf16-packed")
               if "median_step_s" in rows.get(r, {})]
    if ours_ok:
        best = min(ours_ok, key=lambda r: rows[r]["median_step_s"])
        rows["ours-best"] = {**rows[best], "is": best}
    pairs = {}
    for a, t in PAIRS:
        if "median_step_s" in rows.get(a, {}) and "median_step_s" in rows.get(t, {}):
            ca = (rows[a]["gradient_checkpointing"] or {}) if isinstance(rows[a]["gradient_checkpointing"], dict) else {}
            ct = (rows[t]["gradient_checkpointing"] or {}) if isinstance(rows[t]["gradient_checkpointing"], dict) else {}
            pairs[f"{a} / {t}"] = {
                "speedup_ours_over_trl": round(rows[t]["median_step_s"] / rows[a]["median_step_s"], 3),
                "peak_memory_ratio_ours_over_trl": round(rows[a]["peak_memory_gb"] / max(rows[t]["peak_memory_gb"], 1e-9), 3),
                **({"concurrent_peak_memory_ratio_ours_over_trl": round(
                    rows[a]["peak_memory_gb_concurrent"] / max(rows[t]["peak_memory_gb_concurrent"], 1e-9), 3)}
                   if "peak_memory_gb_concurrent" in rows[a] and "peak_memory_gb_concurrent" in rows[t] else {}),
                "gradient_checkpointing": {"ours": ca.get("on"), "trl": ct.get("on")},
                "like_with_like_checkpointing": ca.get("on") is not None and ca.get("on") == ct.get("on")}
    out["pairs"] = pairs
    if name == "grpo":
        # our best row's median response, else any ours row's (the CPU variant's only one, ours-fp32, is not an
        # ours-best candidate); without one the floor assumes max_new_tokens
        ours = rows.get("ours-best") or next((r for k, r in rows.items() if k.startswith("ours")), {})
        resp = ours.get("median_response_len")
        out["floor"] = floor(variant, name, ceiling, facts, resp)
    else:
        out["floor"] = floor(variant, name, ceiling, facts)
    return out


def _target(what: str, bench: str, value, threshold: float, higher: bool, using: str) -> dict:
    met = None if value is None else (value >= threshold if higher else value <= threshold)
    return {"target": what, "bench": bench, "value": value, "threshold": threshold,
            "status": "not measured" if met is None else ("met" if met else "not met"), "using": using}


def targets(variant: str, results: dict) -> list[dict]:
    """The issue's targets, each met / not met / not measured (ours: ours-best, the faster of our rows)."""
    out: list[dict] = []

    def row(bench: str, name: str) -> dict:
        return results.get(bench, {}).get("summary", {}).get("rows", {}).get(name, {})

    fractions = {"gpu": {"sft": 0.40, "dpo": 0.35, "rm": 0.35}, "gpu-1.5b": {"sft": 0.50, "dpo": 0.45, "rm": 0.45}}
    for bench, thr in fractions.get(variant, {}).items():
        key = "fraction_of_8NT" if bench == "dpo" else "fraction_of_6NT"
        out.append(_target(f"{bench} fraction of {key[12:]} >= {thr:.0%}", bench, row(bench, "ours-best").get(key),
                           thr, True, f"ours-best ({row(bench, 'ours-best').get('is')})"))
    if variant == "gpu":
        for bench in ("sft", "dpo", "rm"):
            for trl_row, thr in (("trl-best", 1.3), ("trl-default", 2.0)):
                a, t = row(bench, "ours-best"), row(bench, trl_row)
                v = round(t["median_step_s"] / a["median_step_s"], 3) if "median_step_s" in a and "median_step_s" in t else None
                out.append(_target(f"{bench} >= {thr}x {trl_row}", bench, v, thr, True, f"ours-best / {trl_row}"))
        out.append(_target("grpo step <= 2.0 s", "grpo", row("grpo", "ours-best").get("median_step_s"), 2.0, False,
                           "ours-best median"))
    if variant == "gpu-7b":
        for bench, thr, what in (("grpo", 3.0, "grpo >= 3x TRL (step time)"), ("dpo", 1.5, "dpo tokens/s >= 1.5x TRL")):
            a = row(bench, "ours-best")
            trl_rows = [(r, row(bench, r)) for r in ("trl-default", "trl-mixed", "trl-best") if "median_step_s" in row(bench, r)]
            if "median_step_s" in a and trl_rows:
                fastest, t = min(trl_rows, key=lambda x: x[1]["median_step_s"])
                out.append(_target(what, bench, round(t["median_step_s"] / a["median_step_s"], 3), thr, True,
                                   f"ours-best / {fastest} (the fastest TRL row)"))
            else:
                out.append(_target(what, bench, None, thr, True, "ours-best / fastest TRL row"))
    for bench, res in results.items():
        for pair, p in res.get("summary", {}).get("pairs", {}).items():
            if pair.startswith("ours-fp32"):
                continue
            out.append(_target(f"{bench} peak memory <= 1.25x TRL's ({pair})", bench,
                               p["peak_memory_ratio_ours_over_trl"], 1.25, False, pair))
    return out


def model_facts(inputs: dict) -> dict:
    """Parameter counts (on the meta device: no weights), KV bytes per token, real tokens per row."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.data.io import read_records

    variant = inputs["variant"]
    s = SETTINGS[variant]
    model_dir, _ = _paths(inputs, "sft")
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    embed = cfg.vocab_size * cfg.hidden_size
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    non_embedding = n_params - embed * (1 if tied else 2)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (2 if variant != "cpu" else 4)
    tok = AutoTokenizer.from_pretrained(model_dir)
    per_row = {}
    for name, fields in (("sft", [["prompt", "completion"]]), ("dpo", [["prompt", "chosen"], ["prompt", "rejected"]]),
                         ("rm", [["prompt", "chosen"], ["prompt", "rejected"]])):
        rows = read_records(_paths(inputs, name)[1])[:256]
        total = 0
        for r in rows:
            for seq in fields:  # + 1: the end-of-sequence token; truncated at max_length
                total += min(len(tok("".join(r[f] for f in seq), add_special_tokens=False)["input_ids"]) + 1,
                             s[name]["max_length"])
        per_row[name] = total / len(rows)
    prompts = read_records(_paths(inputs, "grpo")[1])
    lengths = [len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in prompts]
    return {"params": n_params, "flop_params": non_embedding + embed, "rm_flop_params": non_embedding,
            "tied_embeddings": tied, "vocab_size": cfg.vocab_size, "tokenizer_size": len(tok),
            "tokens_per_row": per_row, "kv_bytes_per_token": kv_bytes, "prompt_tokens": max(lengths),
            "mean_prompt_tokens": sum(lengths) / len(lengths)}


def environment() -> dict:
    import torch
    import transformers

    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                "cuda": torch.version.cuda}
    for dist in ("trl", "accelerate", "deepspeed", "ray", "liger-kernel", "datasets", "tokenizers"):
        try:  # metadata, not an import: the parent keeps off CUDA and DeepSpeed's accelerator probe
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = "not installed"
    return {"versions": versions, "cpus": os.cpu_count(), "parent_threads": _threads(),
            "nvidia_smi": _smi_names(), "multicast_env": NO_MULTICAST}


def _smi_names() -> list[str]:
    if not _has_nvidia_smi():
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    return [ln.strip() for ln in out.splitlines() if ln.strip()]


def settings_record(variant: str, rows: list[str], args: argparse.Namespace) -> dict:
    s = SETTINGS[variant]
    return {"variant": variant, "small": args.small, **{k: v for k, v in s.items() if k not in BENCHES},
            "benches": {b: s[b] for b in BENCHES}, "rows": {r: ROWS[r] for r in rows}, "ours_best_settings": OURS_BEST,
            "optimizer": {**OPTIMIZER, "ours": "torch.optim.AdamW, fused on CUDA (mixed: on fp32 masters; bf16: on "
                                               "transient fp32 copies), fused on a CPU (fp32); under ZeRO the "
                                               "multi-tensor one, which DeepSpeed wraps; no decay on 1-D params",
                          "trl": "HF Trainer default optim (adamw_torch_fused), no decay on biases and norms"},
            "rounds": args.rounds, "order": "ABBA: the row list, reversed on even rounds", "warmup_steps": args.warmup,
            "trl_grad_ckpt": args.trl_grad_ckpt, "ours_micro_batch_tokens": args.micro_batch_tokens,
            "ours_micro_rows": args.micro_rows or s["grpo"]["micro_rows"],
            "profiled": args.profile, "global_batch": args.global_batch, "ours_lm_head": args.lm_head or "auto",
            "ours_compile_layers": args.compile_layers or "auto", "ours_grad_ckpt": args.grad_ckpt or "auto",
            "ours_rollout_sleep": args.rollout_sleep or "auto", "ours_shard_reference": args.shard_reference,
            "differences": ["optimizer kernel: torch's fused AdamW on both sides on a GPU (ours on fp32 masters or "
                            "copies of the bf16 weights) and on a CPU; under ZeRO ours multi-tensor",
                            "learning-rate schedule: ours cosine (warmup 0), TRL constant (timing only)",
                            "GRPO loss aggregation: ours token_mean with clip_high 0.28, TRL 1.16 defaults",
                            "under DeepSpeed bf16 (gpu-7b) trl-mixed's fp32 model is cast to bf16 with fp32 "
                            "master partitions: the same regime as trl-default",
                            "ours' precision bf16/mixed, fused_kernels and lm_head are passed as set; "
                            "how far each is in effect is the trainers' business (recorded per row)"]}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=list(SETTINGS), default="cpu")
    ap.add_argument("--bench", default=",".join(BENCHES), help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--rows", default="", help="comma-separated rows (" + ",".join(ROWS) + "); default by variant")
    ap.add_argument("--rounds", type=int, default=0, help="ABBA rounds (default: 2; 1 for gpu-7b)")
    ap.add_argument("--warmup", type=int, default=1, help="steps per child process left out of the figures")
    ap.add_argument("--trl-grad-ckpt", choices=["match", "on", "off"], default="match",
                    help="TRL's gradient checkpointing: match ours' logged choice (default), or force it")
    ap.add_argument("--child-timeout", type=float, default=1500, help="seconds before a child is killed")
    ap.add_argument("--out", default="bench/results/side_by_side_cpu.json")
    ap.add_argument("--cpu-root", default="", help="cpu variant: the checkout whose models/sft and data/embedded "
                                                   "(dvc outputs) it reads (default: this one)")
    ap.add_argument("--work", default="", help="folder for tokenizer, data and model (default: a new temporary one); "
                                               "a model an earlier call built there for the same variant is reused")
    ap.add_argument("--gpus", type=int, default=0, help="ranks (default: the variant's); with --parallel, the "
                                                       "1 -> N scaling call (ours rows only, a fixed global batch)")
    ap.add_argument("--parallel", choices=["ddp", "zero2", "zero3"], default="",
                    help="ours' data parallelism on several GPUs (default: zero3)")
    ap.add_argument("--small", action="store_true", help="the variant's code paths on a micro model (smoke test)")
    ap.add_argument("--global-batch", type=int, default=0,
                    help="ours' offline rows: G rows a step, each rank's micro-batch the variant's batch (1 -> N "
                         "scaling at a fixed global batch with the same per-GPU work)")
    ap.add_argument("--lm-head", choices=["auto", "chunked", "liger", "full"], default="",
                    help="ours' rows: the lm_head setting (default: auto, as OURS_BEST)")
    ap.add_argument("--compile-layers", choices=["auto", "on", "off"], default="",
                    help="ours' rows: the compile_layers setting (default: auto)")
    ap.add_argument("--grad-ckpt", choices=["auto", "on", "off"], default="",
                    help="ours' rows: the gradient_checkpointing setting (default: auto; TRL's follows with "
                         "--trl-grad-ckpt match): a memory row with checkpointing on both sides")
    ap.add_argument("--rollout-sleep", choices=["auto", "on", "off"], default="",
                    help="ours' Ray GRPO rows: rl.rollout.sleep (default: auto, on with GPUs)")
    ap.add_argument("--shard-reference", choices=["on", "off"], default="on",
                    help="ours' Ray GRPO rows under ZeRO-3: rl.distribution.shard_reference (default: on)")
    ap.add_argument("--micro-batch-tokens", type=int, default=0,
                    help="ours' packed rows: token budget of a micro-batch (0: each draw is one micro-batch)")
    ap.add_argument("--micro-rows", type=int, default=0,
                    help="ours' GRPO rows: rows of an update micro-batch (0: the variant's, which TRL's rows take as "
                         "per_device_train_batch_size); a memory knob, the optimizer steps are the same")
    ap.add_argument("--profile", action="store_true",
                    help="ours' offline rows (steps 4-6; rank 0 on several GPUs) and grpo's third update on one "
                         "device under torch.profiler: a where-the-time-goes "
                         "run, its step times carry the profiler's overhead")
    ap.add_argument("--profile-phase", choices=list(_WATCHED), default="update",
                    help="grpo with --profile: the RL phase profiled (its third call)")
    ap.add_argument("--sync-census", action="store_true",
                    help="grpo on one GPU: count where the third policy update waits for the device (sync debug "
                         "mode); its step times carry the warnings' cost")
    ap.add_argument("--resummarize", metavar="FILE", help="recompute the summaries of a result file from its runs")
    ap.add_argument("--combine", nargs="+", metavar="FILE",
                    help="one result file at --out from the rows of FILEs (the same variant's benchmarks, run in "
                         "consecutive calls on one warm machine: the 7B variant's AB round)")
    ap.add_argument("--scaling", nargs=2, metavar=("ONE", "MANY"),
                    help="combine two result files (--gpus 1 and --gpus N) into the scaling summary at --out")
    ap.add_argument("--child", choices=["alignflow", "trl", "ceiling", "build"], help=argparse.SUPPRESS)
    ap.add_argument("--task", default="{}", help=argparse.SUPPRESS)
    return ap


def _check_choices(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The rows and benchmarks asked for, each known (else the parser's error)."""
    rows = (args.rows or DEFAULT_ROWS.get(args.variant, GPU_ROWS)).split(",")
    benches = args.bench.split(",")
    for r in rows:
        if r not in ROWS:
            ap.error(f"unknown row {r!r}; rows: {', '.join(ROWS)}")
        if args.global_batch and ROWS[r]["side"] != "alignflow":
            ap.error("--global-batch is for ours' rows (the scaling runs); TRL's rows keep the variant's batch")
    for b in benches:
        if b not in BENCHES:
            ap.error(f"unknown bench {b!r}; benches: {', '.join(BENCHES)}")
    if args.cpu_root and args.variant != "cpu":
        ap.error("--cpu-root is for the cpu variant; the GPU variants build their own model and data")
    return rows, benches


def _prepare(args: argparse.Namespace, rows: list[str], work: Path) -> tuple[dict, dict]:
    """The children's inputs (model, data, tokenizer; the GPU variants' model built once per --work) and the
    result file's header (settings, environment, model facts, the starting matmul ceiling)."""
    s = SETTINGS[args.variant]
    inputs = build_inputs(args.variant, work, args.small)
    inputs["global_batch"] = args.global_batch
    if args.cpu_root:
        root = Path(args.cpu_root).resolve()
        inputs.update(root=str(root), model=str(root / s["model"]))
    header: dict = {"variant": args.variant, "settings": settings_record(args.variant, rows, args),
                    "environment": environment()}
    if args.variant != "cpu":
        record, key = work / "model_build.json", {"variant": args.variant, "small": args.small}
        built = json.loads(record.read_text()) if record.exists() else {}
        if built.get("key") == key and (Path(built.get("model", "/nonexistent")) / "config.json").exists():
            built["reused"] = True  # the same seed and shape: the same weights, not built again
        else:
            built = run_child("build", {"inputs": inputs}, args.child_timeout)
            if "error" in built:
                sys.exit(f"model build failed: {built['error']}")
            record.write_text(json.dumps({**built, "key": key}) + "\n")
        inputs["model"] = built["model"]
        header["model_build"] = built
    if s["gpus"] > 1:
        header["trl_launch"] = {"command": " ".join(trl_launch_command(inputs)[1:]) + " bench/side_by_side.py ...",
                                "deepspeed_config": json.loads(Path(inputs["deepspeed_config"]).read_text()),
                                "launched": not args.small}
    header["model"] = model_facts(inputs)
    header["ceilings"] = {"start": run_child("ceiling", {"inputs": inputs}, args.child_timeout)}
    return inputs, header


class _ResultFile:
    """The result file at ``--out``, rewritten after every child (a call cut off at its limit keeps what ran)."""

    def __init__(self, args: argparse.Namespace, header: dict, started: float):
        self.args, self.header, self.started = args, header, started

    def ceiling(self) -> dict:
        """The matmul and copy ceilings: the max over every measurement so far (start, and end once run)."""
        ceilings = self.header["ceilings"]
        ms = [m for c in ceilings.values() if "error" not in c for m in c["matmul_flops"]]
        bw = [m for c in ceilings.values() if "error" not in c for m in c["copy_bytes_per_s"]]
        return {"matmul_flops": max(ms), "copy_bytes_per_s": max(bw), "measurements": len(ms),
                "when": sorted(k for k, c in ceilings.items() if "error" not in c)}

    def write(self, results: dict, final: bool) -> dict:
        args, ceiling = self.args, self.ceiling()
        summary = summarize(args.variant, results, args.warmup, ceiling, self.header["model"])
        doc = {**self.header, "ceiling": {**ceiling, "matmul_tflops": round(ceiling["matmul_flops"] / 1e12, 2),
                                          "copy_tb_per_s": round(ceiling["copy_bytes_per_s"] / 1e12, 3)},
               "final": final, "results": results, "summary": summary,
               "wall_s": round(time.perf_counter() - self.started, 1)}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(portable(doc), indent=2) + "\n")
        return doc


def _run_bench(name: str, rows: list[str], args: argparse.Namespace, inputs: dict, results: dict,
               out: _ResultFile) -> None:
    """Every row of benchmark ``name`` in ABBA order, one child process a run; ``results[name]`` fills as
    they end."""
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    decided: dict[str, bool] = {}  # ours rows' logged gradient-checkpointing choice on this benchmark
    results[name] = {"runs": runs}
    for rnd, row in schedule(rows, args.rounds):
        side = ROWS[row]["side"]
        task = {"inputs": inputs, "bench": name, "row": row, "micro_batch_tokens": args.micro_batch_tokens,
                "micro_rows": args.micro_rows, "lm_head": args.lm_head, "compile_layers": args.compile_layers,
                "gradient_checkpointing": args.grad_ckpt,
                "rollout_sleep": args.rollout_sleep, "shard_reference": args.shard_reference,
                "profile": {"skip": 2, "active": 3, "phase": args.profile_phase} if args.profile else None, "sync_census": args.sync_census}
        if side == "trl":
            task["trl_grad_ckpt"] = trl_checkpointing(row, decided, args.trl_grad_ckpt)
        res = run_child(side, task, args.child_timeout)
        res["round"] = rnd
        runs[row].append(res)
        if side == "alignflow" and (res.get("gradient_checkpointing") or {}).get("on") is not None:
            decided.setdefault(row, res["gradient_checkpointing"]["on"])
        print(json.dumps({"bench": name, "round": rnd, "row": row, "wall_s": res.get("wall_s"),
                          **({"error": res["error"][-800:]} if "error" in res else
                             {"step_s": [round(x, 4) for x in res["step_s"]],
                              "peak_memory_gb": round(res["peak_memory_gb"], 2),
                              "gradient_checkpointing": (res.get("gradient_checkpointing") or
                                                         task.get("trl_grad_ckpt"))})}), flush=True)
        out.write(results, final=False)
    print(json.dumps({"bench": name, "summary": results[name]["summary"]}), flush=True)


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    import rlhf_core  # noqa: F401  (offline switches)

    if args.child:
        task = json.loads(args.task)
        if task.get("inputs", {}).get("small"):
            make_small(task["inputs"]["variant"])
        if "gpus" in task.get("inputs", {}):
            SETTINGS[task["inputs"]["variant"]].update(gpus=task["inputs"]["gpus"], parallel=task["inputs"]["parallel"])
        if task.get("inputs", {}).get("global_batch"):
            apply_global_batch(task["inputs"]["variant"], task["inputs"]["global_batch"])
        child_main(args.child, task)
        return
    if args.small:
        make_small(args.variant)
    if args.gpus or args.parallel:
        SETTINGS[args.variant].update(**({"gpus": args.gpus} if args.gpus else {}),
                                      **({"parallel": args.parallel} if args.parallel else {}))
    if args.global_batch:
        apply_global_batch(args.variant, args.global_batch)
    if args.resummarize:
        resummarize(Path(args.resummarize), args.warmup)
        return
    if args.scaling:
        scaling(Path(args.scaling[0]), Path(args.scaling[1]), Path(args.out))
        return
    if args.combine:
        combine([Path(p) for p in args.combine], Path(args.out), args.warmup)
        return
    args.rounds = args.rounds or SETTINGS[args.variant]["rounds"]
    rows, benches = _check_choices(ap, args)
    started = time.perf_counter()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix=f"bench-{args.variant}-"))
    work.mkdir(parents=True, exist_ok=True)
    inputs, header = _prepare(args, rows, work)
    print(json.dumps({"settings": header}), flush=True)
    out = _ResultFile(args, header, started)
    results: dict = {}
    for name in benches:
        _run_bench(name, rows, args, inputs, results, out)
    header["ceilings"]["end"] = run_child("ceiling", {"inputs": inputs}, args.child_timeout)
    doc = out.write(results, final=True)
    print(json.dumps({"ceiling": doc["ceiling"], "summary": doc["summary"]}), flush=True)


# A path is a run from a "/" to white space or a quote, taken whole (possessive): each character is
# scanned once. Nested repetition of path segments would be quadratic on long runs of "-/-/".
_PATH = re.compile(r"/[^\s\"']*+")
_PACKAGES_DIRS = ("/site-packages", "/dist-packages")


def _site_packages(match: re.Match) -> str:
    """A path with everything up to its last ``site-packages``/``dist-packages`` folder made generic."""
    path = match.group()
    start, name = max((path.rfind(name), name) for name in _PACKAGES_DIRS)
    return "<site-packages>" + path[start + len(name):] if start > 0 else path  # a folder above it, as in /x/site-packages


def portable(obj: object) -> object:
    """``obj`` with this machine's paths in its strings made generic (``<repo>``, ``<site-packages>``,
    ``<tmp>``), so a committed result file (its tracebacks, the model directory) names no local folder."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v) for v in obj]
    if not isinstance(obj, str):
        return obj
    text = obj.replace(str(REPO), "<repo>")
    text = _PATH.sub(_site_packages, text)
    # /tmp/site: where bench/device_setup.sh installs the carried wheels on a lent GPU
    return text.replace("/tmp/site/", "<site-packages>/").replace(tempfile.gettempdir() + "/", "<tmp>/")


def scaling(one: Path, many: Path, out: Path) -> dict:
    """1 -> N GPU scaling of ours' rows from two result files of one call (the same variant, benchmarks and
    global batch; ``--gpus`` differs): efficiency = tokens/s on N / (N x tokens/s on 1), per benchmark and row,
    from each side's median step."""
    a, b = json.loads(one.read_text()), json.loads(many.read_text())
    ga, gb = a["settings"]["gpus"], b["settings"]["gpus"]
    rows: dict = {}
    for name in sorted(set(a["results"]) & set(b["results"])):
        for row, ra in a["results"][name]["summary"]["rows"].items():
            rb = b["results"][name]["summary"]["rows"].get(row, {})
            if row == "ours-best" or "tokens_per_s" not in ra or "tokens_per_s" not in rb:
                continue
            rows[f"{name} {row}"] = {
                f"tokens_per_s_{ga}gpu": ra["tokens_per_s"], f"tokens_per_s_{gb}gpu": rb["tokens_per_s"],
                f"median_step_s_{ga}gpu": ra["median_step_s"], f"median_step_s_{gb}gpu": rb["median_step_s"],
                "range_step_s": {ga: ra["range_step_s"], gb: rb["range_step_s"]},
                "parallel": {ga: (ra.get("settings") or {}).get("parallel"), gb: (rb.get("settings") or {}).get("parallel")},
                "peak_memory_gb": {ga: ra["peak_memory_gb"], gb: rb["peak_memory_gb"]},
                "global_batch": {g: (r.get("settings") or {}).get("batch_size", 0) * (r.get("settings") or {}).get("grad_accum", 1)
                                 for g, r in ((ga, ra), (gb, rb))},
                "efficiency": round(rb["tokens_per_s"] / (ra["tokens_per_s"] * gb / ga), 3)}
    doc = {"variant": a["variant"], "gpus": [ga, gb], "files": [one.name, many.name], "rows": rows,
           "target": "scaling 1 -> 4 GPUs at a fixed global batch >= 85% (SFT and DPO tokens/s, ZeRO-2)",
           "status": {k: ("met" if v["efficiency"] >= 0.85 else "not met") for k, v in rows.items()},
           "device": a["results"][next(iter(a["results"]))]["summary"]["rows"].get("ours-best", {}).get("device")}
    out.write_text(json.dumps(portable(doc), indent=2) + "\n")
    print(json.dumps(doc), flush=True)
    return doc


def summarize(variant: str, results: dict, warmup: int, ceiling: dict, facts: dict) -> dict:
    """Every benchmark's summary, written into ``results``, and the file's: the ratios of each pair and the targets."""
    for name, res in results.items():
        res["summary"] = bench_summary(variant, name, res["runs"], warmup, ceiling, facts)
    return {"pairs": {n: r["summary"]["pairs"] for n, r in results.items()}, "targets": targets(variant, results)}


def apply_recorded_settings(data: dict) -> None:
    """The variant's SETTINGS as a result file ran them (``--small``, ``--gpus``, ``--global-batch``), before its
    summaries are recomputed."""
    settings, variant = data["settings"], data["variant"]
    if settings.get("small"):
        make_small(variant)
    if settings.get("gpus"):
        SETTINGS[variant]["gpus"] = settings["gpus"]
    if settings.get("global_batch"):
        apply_global_batch(variant, settings["global_batch"])


def combine(paths: list[Path], out: Path, warmup: int) -> dict:
    """One result file from the rows of several (``--combine A B ...``): the 7B variant's AB round split across
    consecutive calls on one warm machine (the issue allows it; one call would not hold both sides). The files
    must share the variant, GPU count and benchmarks; every row's runs are kept as run, the ceiling is the max over
    all the calls' measurements (each call's own kept under ``combined_from``), and the summaries are recomputed."""
    docs = [json.loads(p.read_text()) for p in paths]
    first = docs[0]
    for p, d in zip(paths[1:], docs[1:]):
        if d["variant"] != first["variant"]:
            raise SystemExit(f"--combine: {p.name} is variant {d['variant']!r}, {paths[0].name} {first['variant']!r}")
        if d["settings"].get("gpus") != first["settings"].get("gpus") or set(d["results"]) != set(first["results"]):
            raise SystemExit(f"--combine: {p.name} has other GPUs or benchmarks than {paths[0].name}")
    results: dict = {name: {"runs": {}} for name in first["results"]}
    for p, d in zip(paths, docs):
        for name, res in d["results"].items():
            for row, runs in res["runs"].items():
                if row in results[name]["runs"]:
                    raise SystemExit(f"--combine: row {row} of {name} is in more than one file")
                results[name]["runs"][row] = [{**r, "call": p.name} for r in runs]
    c = {"matmul_flops": max(d["ceiling"]["matmul_flops"] for d in docs),
         "copy_bytes_per_s": max(d["ceiling"]["copy_bytes_per_s"] for d in docs)}
    apply_recorded_settings(first)
    summary = summarize(first["variant"], results, warmup, c, first["model"])
    doc = {**{k: v for k, v in first.items() if k not in ("results", "summary", "ceiling", "wall_s")},
           "combined_from": [{"file": p.name, "ceiling": d["ceiling"], "wall_s": d.get("wall_s")}
                             for p, d in zip(paths, docs)],
           "ceiling": {**c, "matmul_tflops": round(c["matmul_flops"] / 1e12, 2),
                       "copy_tb_per_s": round(c["copy_bytes_per_s"] / 1e12, 3), "rule": "max over the combined calls"},
           "results": results, "summary": summary}
    out.write_text(json.dumps(portable(doc), indent=2) + "\n")
    print(json.dumps({"summary": doc["summary"]}), flush=True)
    return doc


def resummarize(path: Path, warmup: int) -> None:
    """Recompute every summary of a result file from its recorded runs, ceilings and model facts."""
    data = json.loads(path.read_text())
    apply_recorded_settings(data)
    c = data["ceiling"]
    ceiling = {"matmul_flops": c["matmul_flops"], "copy_bytes_per_s": c["copy_bytes_per_s"]}
    data["summary"] = summarize(data["variant"], data["results"], warmup, ceiling, data["model"])
    for name, res in data["results"].items():
        print(json.dumps({"bench": name, "summary": res["summary"]}))
    path.write_text(json.dumps(portable(data), indent=2) + "\n")


if __name__ == "__main__":
    main()
