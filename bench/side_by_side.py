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

      .venv/bin/python bench/side_by_side.py --variant cpu

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
* ``trl-ours-backend``: trl-default with ours' attention-backend settings (cuDNN's SDPA off, as ours' trainers
  set it on a GPU): published beside trl-default, so a ratio can be read both as TRL ships and like with like.
* ``trl-best`` with ``--trl-best-from FILE``: trl-default plus the options of the winner of the TRL search
  recorded in FILE (``--search``, below); trl-default itself where no configuration beat it.
  A TRL row whose options equal an earlier row's of ``--rows`` (trl-best where the winner is cuDNN's SDPA off, as
  trl-ours-backend) is not run again: it reports that row's processes (``shared_runs``, each run ``same_run_as``).
* ``trl-best`` without it (legacy): trl-default plus ``use_liger_kernel=True`` (liger-kernel from ``bench/device_wheels.sh``),
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
    # GRPO's four hygiene rows (ours, trl-default, trl-ours-backend, trl-best; three processes where the search's
    # winner is trl-ours-backend's setting: shared_runs) do not fit one call: one ABBA round a call on one warm
    # machine (--rounds 1 --waive-hygiene, the second call's rows reversed, and --trl-grad-ckpt off in both: the
    # second call's TRL rows run before ours, with no choice of ours to match), then here
    python bench/side_by_side.py --variant gpu --combine-rounds r1.json r2.json --out grpo.json
    # nvidia-h100-x1: 1.5B (151,936 vocab), likewise one benchmark per call
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-1.5b --rounds 2 \
        --bench sft --out $OUT/side_by_side_1p5b_sft.json
    # nvidia-h100-x4: 7B, one AB round of one pair per call (below the hygiene minimums: --waive-hygiene)
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-7b --waive-hygiene \
        --bench grpo --rows ours-bf16,trl-default --out $OUT/side_by_side_7b_grpo.json
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-7b --waive-hygiene \
        --bench dpo --rows ours-bf16,trl-default --out $OUT/side_by_side_7b_dpo.json
    # nvidia-h100-x4: 1 -> 4 GPU scaling at a fixed global batch (ours, ZeRO-2), then the summary
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-1.5b --bench sft,dpo \
        --rows ours-bf16 --rounds 1 --waive-hygiene --gpus 1 --work /tmp/bw15 --out $OUT/scaling_1gpu.json && \
      python bench/side_by_side.py --variant gpu-1.5b --bench sft,dpo --rows ours-bf16 --rounds 1 --waive-hygiene --gpus 4 \
        --parallel zero2 --work /tmp/bw15 --out $OUT/scaling_4gpu.json && \
      python bench/side_by_side.py --scaling $OUT/scaling_1gpu.json $OUT/scaling_4gpu.json --out $OUT/scaling.json

Options for ours' rows: ``--micro-batch-tokens N`` (packed rows: a token budget per micro-batch; at 1.5B 8,192 lets
``gradient_checkpointing: auto`` choose off), ``--lm-head`` (ours' ``lm_head``, default auto), ``--grad-ckpt`` (ours'
``gradient_checkpointing``, default auto; TRL's matches it), ``--global-batch G``
(a step of G rows, each rank's micro-batch the variant's batch: the 1 -> N scaling pair at a fixed global batch
with the same work per GPU), ``--profile``
(torch.profiler over steps 4-6 of each offline row, rank 0's under Ray ranks, and over the third call of each RL
phase ``--profile-phase`` names (update by default; reference, rollout) of the grpo bench on one device: device busy
time, kernel time by category, the idle gaps between kernels and what the host ran during the largest; a
where-the-time-goes run, not a timing), ``--sync-census`` (grpo on one GPU: every wait of the host for the device
in the third policy update, counted by where it was made; ``bench/ab_processes.sh`` runs old and new trees in
turn)::

    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu-1.5b --rounds 2 --bench dpo,rm \
        --rows ours-mixed-packed --micro-batch-tokens 8192 --out $OUT/side_by_side_1p5b_packed.json
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu --rounds 1 --waive-hygiene --bench sft \
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

The TRL search (``--search``; SFT, one round of 10 steps a configuration, TRL's gradient checkpointing off unless
a configuration turns it on): trl-default, cuDNN SDPA off, eager attention, padding-free (bfd packing), gradient
checkpointing on, liger, liger with cuDNN off / padding-free / checkpointing (``settings.SEARCH``; with ``--bench grpo``
``settings.SEARCH_GRPO``: a static KV cache for TRL's ``generate`` in place of padding-free); the file's
``search`` block ranks them by median and names the winner, never slower than trl-default::

    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu --search --deadline-s 540 \
        --out $OUT/trl_search_0p5b_sft.json
    source bench/device_setup.sh && python bench/side_by_side.py --variant gpu --bench sft --deadline-s 540 \
        --rows ours-bf16,trl-default,trl-ours-backend,trl-best --trl-best-from <that file> --out $OUT/sft.json

Hygiene, enforced (``side_by_side_parts/hygiene.py``): a call below the minimums -- 2 warm-up steps a child,
8 timed steps a row offline and 5 on GRPO over all its rounds, 2 ABBA rounds (the search: 1) -- is refused
before any child starts, unless ``--waive-hygiene`` (recorded in the file). Every child runs with the call's
thread count (OMP/MKL and torch's intra-op threads, ours too) and ``PYTORCH_CUDA_ALLOC_CONF`` (``--alloc-conf``)
and its row's SDPA backends; each row records the settings in effect at the end of its run and the summary
says whether threads and allocator matched across rows and whether each pair ran the same attention backends.
Each row gives its median, min and max step; a row whose max/min exceeds 1.5 is flagged, and one more child of
it runs with every step profiled (the slowest and the fastest step's top kernels and host ops, in
``<out>_profiles.json`` beside the result). ``--deadline-s`` launches no child that would end past it (the
longest child so far as the estimate) and still writes the file, with what it skipped. ``--rounds`` ABBA rounds
(default 2; 1 for gpu-7b, which needs ``--waive-hygiene``), the first ``--warmup`` (default 2) steps of every
child dropped; ONE matmul ceiling per call, the max of 3 measurements at the start and 3 at the end (all
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
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # side_by_side_parts, also where this file is loaded as a module (tests)

from side_by_side_parts.settings import (BENCHES, DEFAULT_ROWS, GPU_ROWS, ROWS, SETTINGS,  # noqa: E402
                                         apply_global_batch, make_small, schedule, shared_runs)
from side_by_side_parts.inputs import build_inputs  # noqa: E402
from side_by_side_parts.hygiene import MIN_WARMUP, Deadline, enforce, plan_problems  # noqa: E402
from side_by_side_parts.search import load_winner  # noqa: E402
from side_by_side_parts.settings import SEARCHES, trl_options  # noqa: E402
from rlhf_core.common.offline import GPU_ENV  # noqa: E402
from side_by_side_parts.profiling import WATCHED  # noqa: E402
from side_by_side_parts.processes import child_main, run_child, trl_checkpointing, trl_launch_command  # noqa: E402
from side_by_side_parts.summary import environment, model_facts, settings_record  # noqa: E402
from side_by_side_parts.results import ResultFile, combine, portable, resummarize, scaling  # noqa: E402
from result_paths import result_path  # noqa: E402


def _phases(value: str) -> str:
    """``--profile-phase``: RL phases of :data:`WATCHED`, comma-separated."""
    unknown = [p for p in value.split(",") if p not in WATCHED]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(WATCHED)}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=list(SETTINGS), default="cpu")
    ap.add_argument("--bench", default=",".join(BENCHES), help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--rows", default="", help="comma-separated rows (" + ",".join(ROWS) + "); default by variant")
    ap.add_argument("--rounds", type=int, default=0, help="ABBA rounds (default: 2; 1 for gpu-7b)")
    ap.add_argument("--warmup", type=int, default=MIN_WARMUP, help="steps per child process left out of the figures")
    ap.add_argument("--steps", type=int, default=0, help="steps per child of every benchmark run (default: the "
                                                         "variant's; --search: 10)")
    ap.add_argument("--waive-hygiene", action="store_true",
                    help="run below the hygiene minimums (warm-up, timed steps, ABBA rounds); the file records it")
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="launch no child that would end past this many seconds from the start; write what ran")
    ap.add_argument("--alloc-conf", default=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", GPU_ENV["PYTORCH_CUDA_ALLOC_CONF"]),
                    help="PYTORCH_CUDA_ALLOC_CONF of every child (both sides)")
    ap.add_argument("--no-profile-flagged", action="store_true",
                    help="no extra profiled child for a row whose max/min step exceeds the hygiene flag")
    ap.add_argument("--search", action="store_true",
                    help="the TRL search: TRL's configurations of SEARCHES[bench] on --bench (sft or grpo; default sft), ranked; "
                         "its winner is trl-best of calls given --trl-best-from this file")
    ap.add_argument("--trl-best-from", metavar="FILE", default="",
                    help="trl-best: the winner of the search recorded in FILE (else liger + padding-free)")
    ap.add_argument("--trl-grad-ckpt", choices=["match", "on", "off"], default="match",
                    help="TRL's gradient checkpointing: match ours' logged choice (default), or force it")
    ap.add_argument("--child-timeout", type=float, default=1500, help="seconds before a child is killed")
    ap.add_argument("--out", default=str(result_path("side_by_side_cpu.json", "cpu")),
                    help="default: bench/results/cpu/<UTC date>/side_by_side_cpu.json")
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
    ap.add_argument("--profile-phase", type=_phases, default="update",
                    help=f"grpo with --profile: the RL phases profiled, comma-separated ({','.join(WATCHED)}), each "
                         "over its third call")
    ap.add_argument("--sync-census", action="store_true",
                    help="grpo on one GPU: count where the third policy update waits for the device (sync debug "
                         "mode); its step times carry the warnings' cost")
    ap.add_argument("--resummarize", metavar="FILE", help="recompute the summaries of a result file from its runs")
    ap.add_argument("--combine", nargs="+", metavar="FILE",
                    help="one result file at --out from the rows of FILEs (the same variant's benchmarks, run in "
                         "consecutive calls on one warm machine: the 7B variant's AB round)")
    ap.add_argument("--combine-rounds", nargs="+", metavar="FILE",
                    help="one result file at --out from calls of one ABBA round each (the same rows, every second "
                         "call's order reversed), their runs as the rounds of one call")
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


def _task(name: str, row: str, args: argparse.Namespace, inputs: dict, decided: dict[str, bool]) -> dict:
    """One child's task: the benchmark, the row, ours' overrides, TRL's options and checkpointing."""
    task = {"inputs": inputs, "bench": name, "row": row, "micro_batch_tokens": args.micro_batch_tokens,
            "micro_rows": args.micro_rows, "lm_head": args.lm_head, "compile_layers": args.compile_layers,
            "gradient_checkpointing": args.grad_ckpt, "warmup": args.warmup,
            "rollout_sleep": args.rollout_sleep, "shard_reference": args.shard_reference,
            "profile": {"skip": 2, "active": 3, "phase": args.profile_phase} if args.profile else None,
            "sync_census": args.sync_census}
    if ROWS[row]["side"] == "trl":
        task["trl_grad_ckpt"] = trl_checkpointing(row, decided, args.trl_grad_ckpt)
        task["trl_opts"] = trl_options(row, args.trl_best["options"] if args.trl_best else None)
    return task


def _child(side: str, task: dict, args: argparse.Namespace, deadline: Deadline, walls: list[float],
           what: str) -> dict | None:
    """Run one child unless the deadline forbids it (None then); its wall joins ``walls``, the estimate of the
    next (the longest so far, plus the time the end of the call needs)."""
    if not deadline.allows((max(walls) if walls else 0.0) + 30, what):
        return None
    res = run_child(side, task, min(args.child_timeout, max(deadline.left() - 20, 1)))
    walls.append(res.get("wall_s") or 0.0)
    return res


def _profile_flagged(name: str, args: argparse.Namespace, inputs: dict, results: dict, deadline: Deadline,
                     walls: list[float], decided: dict[str, bool]) -> None:
    """One more child of each flagged offline row with every step profiled: the slowest and the fastest step's
    profile go to ``<out>_profiles.json`` beside the result file (grpo rows: --profile instead)."""
    if args.no_profile_flagged or name == "grpo":
        return
    rows = results[name].get("summary", {}).get("rows", {})
    flagged = [r for r, e in rows.items() if e.get("flagged") and r in ROWS and r != "ours-best"]
    path = Path(args.out).with_name(Path(args.out).stem + "_profiles.json")
    done = json.loads(path.read_text()) if path.exists() else {}
    for row in flagged:
        task = {**_task(name, row, args, inputs, decided), "profile_steps": True}
        res = _child(ROWS[row]["side"], task, args, deadline, walls, f"{name} {row} profile")
        if res is None:
            results[name].setdefault("flagged_profiles", {})[row] = "not taken: deadline"
            continue
        done[f"{name} {row}"] = {"step_profiles": res.get("step_profiles"), "error": res.get("error", "")[-800:],
                                 "note": "a profiled child: its step times carry the profiler's overhead"}
        path.write_text(json.dumps(portable(done), indent=2) + "\n")
        results[name].setdefault("flagged_profiles", {})[row] = path.name


def _run_bench(name: str, rows: list[str], args: argparse.Namespace, inputs: dict, results: dict,
               out: ResultFile, deadline: Deadline, walls: list[float]) -> None:
    """Every row of benchmark ``name`` in ABBA order, one child process a run; ``results[name]`` fills as
    they end; then a profiled child of each flagged row."""
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    decided: dict[str, bool] = {}  # ours rows' logged gradient-checkpointing choice on this benchmark
    same = shared_runs(rows, args.trl_best["options"] if args.trl_best else None)
    results[name] = {"runs": runs, **({"shared_runs": same} if same else {})}
    for rnd, row in schedule([r for r in rows if r not in same], args.rounds):
        side = ROWS[row]["side"]
        task = _task(name, row, args, inputs, decided)
        res = _child(side, task, args, deadline, walls, f"{name} round {rnd} {row}")
        if res is None:
            continue
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
    for row, earlier in same.items():  # the same processes, reported under both names
        runs[row] = [{**r, "same_run_as": earlier} for r in runs[earlier]]
    _profile_flagged(name, args, inputs, results, deadline, walls, decided)
    out.write(results, final=False)
    print(json.dumps({"bench": name, "summary": results[name]["summary"]}), flush=True)


def _plan(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str], dict]:
    """Rows, benchmarks and the hygiene record of this call; refused (SystemExit) below the minimums unless
    --waive-hygiene. --search: SEARCHES[bench]'s rows (sft by default), one round, 10 steps, TRL's checkpointing off unless set."""
    if args.search:
        args.bench = args.bench if args.bench != ",".join(BENCHES) else "sft"
        if args.bench not in SEARCHES:
            ap.error(f"--search runs on one benchmark of {', '.join(SEARCHES)}, got --bench {args.bench}")
        args.rows = args.rows or ",".join(SEARCHES[args.bench])
        args.rounds = args.rounds or 1
        args.steps = args.steps or 10
        args.trl_grad_ckpt = "off" if args.trl_grad_ckpt == "match" else args.trl_grad_ckpt
    args.rounds = args.rounds or SETTINGS[args.variant]["rounds"]
    args.trl_best = load_winner(Path(args.trl_best_from)) if args.trl_best_from else None
    rows, benches = _check_choices(ap, args)
    if args.steps:
        for b in benches:
            SETTINGS[args.variant][b]["steps"] = args.steps
    problems = plan_problems({b: SETTINGS[args.variant][b]["steps"] for b in benches}, args.warmup, args.rounds,
                             search=args.search)
    return rows, benches, {**enforce(problems, args.waive_hygiene), "threads": SETTINGS[args.variant]["threads"],
                           "PYTORCH_CUDA_ALLOC_CONF": args.alloc_conf, "search": args.search}


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
        for bench, steps in task.get("inputs", {}).get("steps", {}).items():
            SETTINGS[task["inputs"]["variant"]][bench]["steps"] = steps
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
    if args.combine or args.combine_rounds:
        combine([Path(p) for p in args.combine or args.combine_rounds], Path(args.out), args.warmup,
                as_rounds=bool(args.combine_rounds))
        return
    started = time.perf_counter()
    rows, benches, hygiene = _plan(ap, args)
    deadline, walls = Deadline(args.deadline_s, started), []
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix=f"bench-{args.variant}-"))
    work.mkdir(parents=True, exist_ok=True)
    inputs, header = _prepare(args, rows, work)
    inputs.update(alloc_conf=args.alloc_conf, steps={b: SETTINGS[args.variant][b]["steps"] for b in benches})
    header.update(hygiene=hygiene, trl_best_from=args.trl_best or "not given: trl-best is liger + padding-free")
    print(json.dumps({"settings": header}), flush=True)
    out = ResultFile(args, header, started)
    results: dict = {}
    for name in benches:
        _run_bench(name, rows, args, inputs, results, out, deadline, walls)
    if deadline.allows(30, "end ceiling"):
        header["ceilings"]["end"] = run_child("ceiling", {"inputs": inputs}, args.child_timeout)
    header["deadline"] = deadline.record()
    doc = out.write(results, final=True)
    print(json.dumps({"ceiling": doc["ceiling"], "summary": doc["summary"]}), flush=True)


if __name__ == "__main__":
    main()
