"""The TRL side: one child (or accelerate rank) runs one TRL row of one benchmark on the same model, data and
optimizer settings as ours, and returns its per-step times.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from .settings import OPTIMIZER, ROWS, SETTINGS, trl_options
from .inputs import bench_paths
from .hygiene import apply_backend, backend_state
from .measure import device_sync, process_peak_memory_gb, thread_counts
from .step_profiles import StepProfiles


def _trl_timer(times: list[float], lengths: list[float], rank: int, profiles: StepProfiles | None = None) -> Any:
    """A TrainerCallback that appends each step's seconds to ``times`` and GRPO's mean completion length to
    ``lengths``."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        """Step end to step end (the first from the start of training), like ours' elapsed-time differences:
        the Trainer fetches and collates a step's batches before ``on_step_begin``, so that would leave them out."""

        def on_train_begin(self, args, state, control, **kw):
            device_sync()
            self.t = time.perf_counter()
            if profiles is not None:
                profiles.start()

        def on_step_end(self, args, state, control, **kw):
            device_sync()
            now = time.perf_counter()
            times.append(now - self.t)
            if profiles is not None:
                profiles.mark(times[-1])
            self.t = now
            if rank == 0:  # as it happens: a child cut off at its limit keeps its steps (run_child)
                print(json.dumps({"partial_step": {"perf/step_s": times[-1]}}), flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    return Timer()


def _trl_trainer(name: str, opts: dict, b: dict, common: dict, settings: dict, records: list, model_dir: str,
                 dtype: Any, tok: Any, world: int) -> Any:
    """TRL's trainer for ``name`` (its config first, then the models: under ZeRO-3 ``from_pretrained`` then
    partitions at load); adds what it chose to ``settings``."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    def causal_lm():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=opts["attn"])

    pairs = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in records] if name in ("dpo", "rm") else []
    if name == "grpo":
        rows = b["prompts_per_step"] * b["group_size"]
        accum = rows // (b["micro_rows"] * world)

        def reward(completions, **kw):
            return [len(c) / 1000 for c in completions]

        extra = {"cache_implementation": "static"} if opts["static_cache"] else {}
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
        pack = dict(packing=True, packing_strategy="bfd", padding_free=True) if opts["padding_free"] else {}
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
                                                               attn_implementation=opts["attn"])
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
    model_dir, data = bench_paths(inputs, name)
    gpu = torch.cuda.is_available()
    # TRL 1.16's liger path patches the causal-LM forward: on the reward model's sequence-classification
    # head it fails ("no attribute 'lm_head'", side_by_side_h200_0p5b_rm.json), so its best RM is its default
    opts = task.get("trl_opts") or trl_options(task["row"])
    apply_backend(s["threads"], opts["sdpa"])  # before the model is built: the call's threads, the row's SDPA
    liger = bool(opts["liger"]) and gpu and name != "rm"
    if liger:
        import liger_kernel  # noqa: F401  (trl-best without it would not be TRL's best: fail, not fall back)
    tok = AutoTokenizer.from_pretrained(model_dir)
    times: list[float] = []
    lengths: list[float] = []
    forced = opts.get("grad_ckpt")
    grad_ckpt = bool(task["trl_grad_ckpt"]["on"]) if forced is None else bool(forced)
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
                "gradient_checkpointing": grad_ckpt, "gradient_checkpointing_source": task["trl_grad_ckpt"]["source"] if forced is None else "the row's options",
                "options": opts,
                "optimizer": f"HF default optim, betas {OPTIMIZER['betas']}, eps {OPTIMIZER['eps']}, "
                             f"weight decay {OPTIMIZER['weight_decay']}", "world_size": world}
    if opts["liger"] and not gpu:
        settings["use_liger_kernel_note"] = "off: no CUDA (CPU smoke)"
    elif opts["liger"] and name == "rm":
        settings["use_liger_kernel_note"] = "off: TRL 1.16's liger forward needs an LM head (the RM has none)"
    trainer = _trl_trainer(name, opts, b, common, settings, read_records(data), model_dir,
                           getattr(torch, row["model_dtype"]), tok, world)
    profiles = StepProfiles() if task.get("profile_steps") else None
    trainer.add_callback(_trl_timer(times, lengths, rank, profiles))
    trainer.train()
    if profiles is not None:
        profiles.stop()
    if name == "sft" and opts["padding_free"] and "seq_lengths" in trainer.train_dataset.column_names:
        blocks = trainer.train_dataset["seq_lengths"]  # bfd packing: the examples' lengths in each block
        settings["packing_check"] = {"blocks": len(blocks),
                                     "examples_per_block": round(sum(map(len, blocks)) / len(blocks), 4),
                                     "tokens_per_block": round(sum(map(sum, blocks)) / len(blocks), 2)}
    out = {"step_s": times, "peak_memory_gb": process_peak_memory_gb(), "trl": trl.__version__, "settings": settings,
           "launch": f"accelerate launch --num_processes {world}, DeepSpeed ZeRO-3" if world > 1 else "one process",
           "threads": thread_counts(), "rank": rank, "hygiene": backend_state(),
           **({"step_profiles": profiles.extremes(warmup=task.get("warmup", 0))} if profiles is not None else {})}
    if name == "grpo":
        out.update(response_len=lengths, engine="TRL HF generate (use_vllm=False"
                   + (", static cache)" if opts["static_cache"] else ")"))
    return out
