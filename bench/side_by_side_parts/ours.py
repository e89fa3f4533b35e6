"""The alignflow side: one child runs one ours row of one benchmark (GRPO in one process or on Ray ranks with
colocated replicas; SFT, DPO and reward-model training in one process or on data-parallel Ray ranks) and returns
its per-step times. The functions handed to Ray (:func:`in_actor`, :func:`rank_main`) are pickled by reference:
Ray gives its workers the driver script's folder, bench/, on ``sys.path``.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .settings import OPTIMIZER, OURS_BEST, ROWS, SETTINGS
from .inputs import bench_paths, reward_file
from .hygiene import apply_backend, backend_state
from .measure import child_logging, device_sync, peak_writer, process_peak_memory_gb, thread_counts
from .profiling import ForwardingProfiler, ProfilingSink, Sink, UpdateProfile, UpdateSyncCensus
from .step_profiles import step_profiling_sink


def in_actor(factory: str, peak_dir: str, *args, **kwargs):
    """A Ray actor's role, built by ``rlhf_core.trainers.rl_on_ray.<factory>`` after the log capture and the peak
    writer start (looked up by name in the actor, where the launcher is not patched)."""
    from rlhf_core.trainers import rl_on_ray

    child_logging()
    peak_writer(peak_dir)
    return getattr(rl_on_ray, factory)(*args, **kwargs)


RANK0_PROFILE = "rank0.profile"  # ``--profile`` under Ray ranks: rank 0's summary, in the child's peak folder


def rank_main(train: str, peak_dir: str, cfg, sink=None, show_progress: bool = False, profile: dict | None = None):
    """One data-parallel rank of an offline trainer (``module:function``), with log capture and peak writer;
    with ``profile`` (``--profile`` on several GPUs), rank 0 (the rank given a sink) runs under torch.profiler
    and leaves its summary in ``peak_dir`` (:data:`RANK0_PROFILE`)."""
    import importlib

    child_logging()
    flush = peak_writer(peak_dir)
    module, fn = train.split(":")
    if profile and sink is not None and peak_dir:
        sink = ForwardingProfiler(profile, sink)
    try:
        return getattr(importlib.import_module(module), fn)(cfg, sink=sink, show_progress=show_progress)
    finally:
        flush()
        if isinstance(sink, ForwardingProfiler):
            sink.close()
            (Path(peak_dir) / RANK0_PROFILE).write_text(json.dumps(sink.summary))


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
    apply_backend(s["threads"], "ours")  # the call's threads (on a GPU the trainers leave torch's default)
    work = Path(tempfile.mkdtemp(prefix=f"bench-ours-{name}-"))
    common = _ours_settings(task, work)
    sink = ProfilingSink(task["profile"]) if task.get("profile") and name != "grpo" and gpus == 1 else Sink()
    if task.get("profile_steps") and name != "grpo" and gpus == 1:
        sink = step_profiling_sink()
    run = _ours_grpo if name == "grpo" else _ours_offline
    result = run(task, common, sink, work)
    result["hygiene"] = backend_state()
    if hasattr(sink, "profiles"):
        sink.close()
        result["step_profiles"] = sink.profiles.extremes(warmup=task.get("warmup", 0))
    return result


def settings_of(cfg: Any, names: tuple[str, ...]) -> dict:
    """The named settings of ``cfg`` under the result file's flat names (an rl section's field by its old name)."""
    from rlhf_core.config import RENAMED, config_params

    params = config_params(cfg)
    return {k: params[RENAMED.get(k, k)] for k in names}


def _ours_grpo(task: dict, common: dict, sink: Any, work: Path) -> dict:
    """One GRPO run of ours (one process, or Ray ranks with colocated replicas): its step times and phases."""
    import torch

    from rlhf_core.config import RLConfig, build_config
    from rlhf_core.trainers.rl import train_rl

    inputs = task["inputs"]
    s, gpus, peak_dir = SETTINGS[inputs["variant"]], inputs["gpus"], os.environ.get("BENCH_PEAK_DIR", "")
    # ZeRO-3 partitions the weights, so its rollout replicas live on Ray even on one GPU (placement none, where the
    # engine samples from this process's policy, is refused under zero3: RLConfig); --gpus 1 --parallel zero3 then
    # runs the eight-GPU variants' path on one device
    on_ray = gpus > 1 or inputs["parallel"] == "zero3"
    b = s["grpo"]
    model, data = bench_paths(inputs, "grpo")
    rows = b["prompts_per_step"] * b["group_size"]
    values = {"model_path": model, "prompts_file": data, "eval_file": data, "reward.function": reward_file(work),
              "algorithm.estimator": "grpo", "max_steps": b["steps"], "rollout.prompts_per_step": b["prompts_per_step"],
              "rollout.group_size": b["group_size"], "rollout.max_new_tokens": b["max_new_tokens"],
              "rollout.temperature": b["temperature"], "kl.coef": b["beta"], "lr": b["lr"],
              "algorithm.mini_batch_size": rows, "micro_batch_size": task.get("micro_rows") or b["micro_rows"],
              "algorithm.ppo_epochs": 1, "batch_size": rows, "max_length": b["max_new_tokens"] + 64,
              "warmup_steps": 0, "eval_items": 1, "eval_at_start": False, "log_rollouts_every": 0,
              "rollout.engine": "static", "distribution.placement": "colocated" if on_ray else "none",
              "distribution.rollout_workers": s.get("rollout_workers", gpus), "lora_rank": s.get("lora_rank", 0),
              **common}
    if on_ray:  # the memory switches (--rollout-sleep, --shard-reference) as the command line sets them
        values.update({"rollout.sleep": task.get("rollout_sleep") or "auto",
                       "distribution.shard_reference": task.get("shard_reference", "on") == "on"})
    cfg = build_config(RLConfig, "rl", values)
    device_sync()
    watches = ([UpdateProfile({**task["profile"], "phase": phase}) for phase in task["profile"]["phase"].split(",")]
               if task.get("profile") and not on_ray else [])
    if not watches and task.get("sync_census") and not on_ray:
        watches = [UpdateSyncCensus({"skip": 2})]
    for watch in watches:
        watch.install()
    if on_ray:
        from rlhf_core.trainers import rl_on_ray

        for factory in ("_learner", "_reference", "RolloutReplica"):
            setattr(rl_on_ray, factory, functools.partial(in_actor, factory, peak_dir))
        rl_on_ray.train_rl_on_ray(cfg, sink, show_progress=False)
    else:
        train_rl(cfg, sink, show_progress=False)
    steps = [m for _, m in sink.rows if "perf/step_s" in m]
    return {"step_s": [m["perf/step_s"] for m in steps],
            "phase_s": {k: [m[k] for m in steps] for k in ("perf/rollout_s", "perf/reward_s", "perf/logprob_s",
                                                         "perf/update_s", "perf/weight_sync_s")},
            "response_len": [m["rollout/response_length"] for m in steps], "peak_memory_gb": process_peak_memory_gb(),
            # engine vs learner log-probs of the sampled tokens: a weight sync that scrambled weights shows here
            "logprob_mismatch": [m.get("rollout/logprob_mismatch") for m in steps],
            "engine": "alignflow StaticCacheEngine" + (" + CUDA graphs" if torch.cuda.is_available() else ""),
            "launch": f"Ray, colocated, {inputs['parallel']}" if on_ray else "one process",
            "settings": settings_of(cfg, ("precision", "gradient_checkpointing", "fused_kernels",
                                                      "compile_layers", "lm_head", "packing", "num_workers", "parallel",
                                                      "micro_batch_size", "mini_batch_size", "kl_coef",
                                                      "lora_rank", "rollout_workers", "rollout_sleep",
                                                      "shard_reference")),
            **{watch.key: watch.summary for watch in watches},
            "threads": thread_counts()}


def _ours_offline(task: dict, common: dict, sink: Any, work: Path) -> dict:
    """One SFT, DPO or reward-model run of ours: the time between logged steps."""
    from rlhf_core.models import attention
    from rlhf_core.config import DPOConfig, RewardConfig, SFTConfig

    inputs, name = task["inputs"], task["bench"]
    gpus, peak_dir = inputs["gpus"], os.environ.get("BENCH_PEAK_DIR", "")
    b = SETTINGS[inputs["variant"]][name]
    model, data = bench_paths(inputs, name)
    held_out = bench_paths(inputs, "grpo")[1]  # prompt + label rows: the end-of-run eval (not timed) reads 1
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

        train_data_parallel(functools.partial(rank_main, TRAINERS[name], peak_dir, profile=task.get("profile")),
                            cfg, sink, show_progress=False)
        written = Path(peak_dir) / RANK0_PROFILE if peak_dir else None
        if written is not None and written.exists():
            profile = {"rank": 0, **json.loads(written.read_text())}
    else:
        rank_main(TRAINERS[name], "", cfg, sink)
    elapsed = [m["perf/elapsed_s"] for _, m in sink.rows if "perf/elapsed_s" in m]
    sink.close()
    if isinstance(sink, ProfilingSink):
        profile = sink.summary
    return {"step_s": [b2 - a for a, b2 in zip([0.0] + elapsed, elapsed)], "peak_memory_gb": process_peak_memory_gb(),
            **({"profile": profile} if profile else {}),
            "launch": f"Ray, {gpus} ranks, {inputs['parallel']}" if gpus > 1 else "one process",
            # decoder-layer attention calls by path in this process (packed rows on a GPU: varlen); one rank's
            # under Ray ranks live in other processes, so both stay 0 there
            "attention_layer_calls": dict(attention.calls),
            "settings": settings_of(cfg, ("precision", "gradient_checkpointing", "fused_kernels",
                                                      "compile_layers", "lm_head", "packing", "micro_batch_tokens",
                                                      "num_workers", "parallel", "batch_size", "grad_accum",
                                                      "max_length", "weight_decay")),
            "threads": thread_counts()}
