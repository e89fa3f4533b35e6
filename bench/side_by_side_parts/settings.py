"""Variants (model shape, data shape, batch and steps of every benchmark), the rows (one side in one setting)
and the settings both sides share. ``--small``, ``--gpus`` and ``--global-batch`` edit :data:`SETTINGS` in place,
in the parent and again in every child.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHES = ("grpo", "sft", "dpo", "rm")
# NVLink multicast off in every process (rlhf_core.trainers.ray_launcher sets the same for Ray actors)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
QWEN_VOCAB = 151_936

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
                          temperature=1.0, beta=0.04, lr=1e-6, micro_rows=128, steps=5),
                sft=dict(data="sft.jsonl", batch=32, max_length=512, lr=1e-5, steps=8),
                dpo=dict(data="pairs.jsonl", batch=32, max_length=512, lr=1e-6, steps=8, beta=0.1),
                rm=dict(data="pairs.jsonl", batch=32, max_length=512, lr=1e-6, steps=8)),
    "gpu-1.5b": dict(model="Qwen2.5-1.5B shape, vocab 151,936", shape=QWEN25_1_5B, vocab=QWEN_VOCAB, tie=True,
                     shard="", threads=8, seed=0, gpus=1, rounds=2,
                     words=dict(prompt=128, completion=384, response=256),
                     grpo=dict(prompts="prompts.jsonl", prompts_per_step=64, group_size=8, max_new_tokens=256,
                               temperature=1.0, beta=0.04, lr=1e-6, micro_rows=32, steps=5),
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
    # steps: the fewest that meet the hygiene minimums at 2 warm-up steps and 2 rounds
    s["grpo"].update(prompts_per_step=4, group_size=4, max_new_tokens=16, micro_rows=4, steps=5)
    for name in ("sft", "dpo", "rm"):
        s[name].update(batch=4, max_length=128, steps=6)


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
    # trl-default with ours' attention-backend settings (cuDNN's SDPA off, hygiene.SDPA["ours"])
    "trl-ours-backend": dict(side="trl", model_dtype="bfloat16", bf16=True, best=False, regime="bf16",
                             opts={"sdpa": "ours"}),
}
# The TRL search (``--search``, SFT at 0.5B): trl-default and one change or a pair of changes at a time. Its
# winner, the fastest by median, is trl-best of a later call (``--trl-best-from``); trl-default if none beats it.
# In the order run (a call cut off by --deadline-s keeps the first): every single change, then the pairs with liger.
SEARCH = {
    "trl-default": {},
    "trl-liger": {"liger": True},
    "trl-cudnn-off": {"sdpa": "ours"},
    "trl-padding-free": {"padding_free": True},
    "trl-eager": {"attn": "eager"},
    "trl-ckpt-on": {"grad_ckpt": True},
    "trl-liger-cudnn-off": {"liger": True, "sdpa": "ours"},
    "trl-liger-padding-free": {"liger": True, "padding_free": True},
    "trl-liger-ckpt-on": {"liger": True, "grad_ckpt": True},
}
# The GRPO search (``--search --bench grpo``): TRL's GRPO step generates with HF ``generate``, so its options differ
# from SFT's (no padding-free; a static KV cache for ``generate`` instead). TRL's checkpointing off unless a row sets it.
SEARCH_GRPO = {
    "trl-default": {},
    "trl-cudnn-off": {"sdpa": "ours"},
    "trl-static-cache": {"static_cache": True},
    "trl-liger": {"liger": True},
    "trl-eager": {"attn": "eager"},
    "trl-ckpt-on": {"grad_ckpt": True},
    "trl-static-cache-cudnn-off": {"static_cache": True, "sdpa": "ours"},
}
SEARCHES = {"sft": SEARCH, "grpo": SEARCH_GRPO}
for _name, _opts in {**SEARCH, **SEARCH_GRPO}.items():
    ROWS.setdefault(_name, dict(side="trl", model_dtype="bfloat16", bf16=True, best=False, regime="bf16",
                                opts=_opts, search=True))


def trl_options(row: str, searched: dict | None = None) -> dict:
    """A TRL row's options: liger, padding-free SFT, attention implementation, SDPA backends (a key of
    hygiene.SDPA), gradient checkpointing (None: ``--trl-grad-ckpt``'s choice) and GRPO's static cache. The
    legacy ``best`` rows: liger + padding-free + static cache; ``trl-best`` with ``searched`` (the search's
    winner): trl-default plus the winner's options."""
    spec = ROWS[row]
    best = bool(spec.get("best"))
    opts = {"liger": best, "padding_free": best, "attn": "sdpa", "sdpa": "torch-default", "grad_ckpt": None,
            "static_cache": best}
    if row == "trl-best" and searched is not None:
        opts.update(liger=False, padding_free=False, static_cache=False)
        opts.update(searched)
    opts.update(spec.get("opts", {}))
    return opts


def shared_runs(rows: list[str], searched: dict | None = None) -> dict[str, str]:
    """TRL rows of ``rows`` that would run exactly what an earlier TRL row of the list runs (the same dtype,
    regime and :func:`trl_options`; e.g. trl-best where the search's winner is cuDNN's SDPA off, which is
    trl-ours-backend): ``{row: the earlier row}``. Such a row is not run again; it reports the earlier row's runs."""
    keys = ("side", "model_dtype", "bf16", "regime")
    same: dict[str, str] = {}
    for i, row in enumerate(rows):
        if ROWS[row]["side"] != "trl":
            continue
        for earlier in rows[:i]:
            if earlier not in same and all(ROWS[earlier].get(k) == ROWS[row].get(k) for k in keys) \
                    and trl_options(earlier, searched) == trl_options(row, searched):
                same[row] = earlier
                break
    return same


DEFAULT_ROWS = {"cpu": "ours-fp32,trl-fp32"}
GPU_ROWS = "ours-mixed,ours-bf16,trl-default,trl-mixed,trl-best"
# (ours, TRL) pairs compared; ours-best is the faster of ours-mixed and ours-bf16
PAIRS = (("ours-mixed", "trl-mixed"), ("ours-bf16", "trl-default"), ("ours-best", "trl-best"),
         ("ours-mixed-padded", "trl-mixed"), ("ours-bf16-padded", "trl-default"), ("ours-best", "trl-default"),
         ("ours-mixed-packed", "trl-mixed"), ("ours-bf16-packed", "trl-default"),
         ("ours-mixed", "trl-mixed-best"), ("ours-mixed-packed", "trl-mixed-best"), ("ours-bf16-packed", "trl-best"),
         ("ours-fp32", "trl-fp32"), ("ours-bf16", "trl-ours-backend"), ("ours-best", "trl-ours-backend"),
         ("ours-bf16-packed", "trl-ours-backend"))
# Our "best" settings, passed through the config on every ours row
OURS_BEST = dict(fused_kernels="auto", lm_head="auto", packing=False, gradient_checkpointing="auto")
OPTIMIZER = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=1.0)


def schedule(rows: list[str], rounds: int) -> list[tuple[int, str]]:
    """ABBA: (round, row) in run order, the row list reversed on every second round."""
    return [(r, row) for r in range(rounds) for row in (rows if r % 2 == 0 else rows[::-1])]
