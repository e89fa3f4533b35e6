"""The tables of the benchmark record (``bench/record.py``): for each, its document, result files, header,
rows of cell templates, device and differing settings; and what wrote each kind of result file.

A cell's ``{alias:dotted.path|spec}`` reads the result file named ``alias`` (``record.render_cell``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Table:
    name: str  # the marker's name: <!-- bench:begin NAME -->
    doc: str  # README.md or BENCHMARKS.md
    sources: dict[str, str]  # alias -> a committed result file, from the repository root
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    device: str  # the caption's device (a template too)
    settings: str = ""  # the caption's settings that differ between rows or from the shipped defaults


def acc(alias: str, key: str = "eval/accuracy") -> str:
    """``0.538 ± 0.016``: an accuracy and its standard error."""
    return f"{{{alias}:{key}|.3f}} ± {{{alias}:{key}_stderr|.3f}}"


def median_range(alias: str, path: str, fmt: str = ".3f", unit: str = " s") -> str:
    """``0.465 s (0.436–0.527)``: a side-by-side row's median step and its range."""
    return f"{{{alias}:{path}.median_step_s|{fmt}}}{unit} ({{{alias}:{path}.range_step_s|range:{fmt}}})"


R = "bench/results/"
METRICS = {a: f"metrics/{a}.json" for a in ("sft", "reward", "dpo", "kto", "rejection", "raft", "distill", "rl",
                                            "tool_eval_sft", "tool_eval_rl")}
LOCK_DEVICE = "2 cores of an AMD EPYC with AVX-512 (`make repro`, the committed `dvc.lock`)"

EMBEDDED = Table(
    "embedded-default", "BENCHMARKS.md", METRICS,
    ("stage (each from SFT)", "greedy exact match, or as named"),
    (("SFT, 500 steps", acc("sft")),
     ("reward model, held-out pairwise accuracy ({reward:eval/n_pairs|.0f} pairs)", "{reward:eval/reward_accuracy|.3f}"),
     ("DPO", acc("dpo")),
     ("KTO", acc("kto")),
     ("rejection sampling, kept samples correct", "{rejection:rejection/kept_accuracy|.3f}"),
     ("RAFT", acc("raft")),
     ("distillation", acc("distill")),
     ("GRPO (`rl`)", acc("rl")),
     ("tool task: SFT → GRPO with the calculator ({tool_eval_rl:eval/n_items|.0f} items)",
      "{tool_eval_sft:eval/accuracy_tool|.3f} → {tool_eval_rl:eval/accuracy_tool|.3f}")),
    LOCK_DEVICE)

README_OFFLINE = Table(
    "readme-offline", "README.md", METRICS,
    ("model (each from SFT)", "eval accuracy", "sort", "arithmetic", "vs SFT"),
    (("SFT, 500 steps", acc("sft"), "{sft:eval/accuracy_sort|.3f}", "{sft:eval/accuracy_arithmetic|.3f}", ""),)
    + tuple((label, acc(a), f"{{{a}:eval/accuracy_sort|.3f}}", f"{{{a}:eval/accuracy_arithmetic|.3f}}",
             f"{{{a}:eval/accuracy - sft:eval/accuracy|+.3f}}")
            for label, a in (("DPO, β 0.1, NLL 1.0, lr 3e-5, 200 steps", "dpo"),
                             ("KTO, β 0.1, lr 3e-5, 200 steps (pairs split)", "kto"),
                             ("rejection n = 4 scored by the reward model, then SFT on the kept (RAFT)", "raft"),
                             ("distillation of the DPO model into SFT, 150 steps", "distill")))
    + (("reward model (SFT backbone, scalar head, 300 steps): pairwise accuracy on {reward:eval/n_pairs|.0f} "
        "held-out pairs, mean margin {reward:eval/reward_margin|.1f}", "{reward:eval/reward_accuracy|.3f}", "", "", ""),
       ("rejection sampling: a correct answer kept, best of 4 by the reward model (a random sample: "
        "{rejection:rejection/sample_accuracy|.3f})", "{rejection:rejection/kept_accuracy|.3f}", "", "", "")),
    LOCK_DEVICE)

README_RL = Table(
    "readme-online-rl", "README.md",
    {**METRICS, "ppo": R + "cpu/2026-11-26/rl_ppo_rm.json"},
    ("run (from the SFT model)", "eval accuracy start → end", "reward-model score of greedy answers",
     "final KL to reference", "wall"),
    (("GRPO, rule reward, 40 × 32 prompts × 8 samples (`alignflow rl`, the committed `dvc.lock`)",
      f"{acc('rl', 'eval/accuracy_start').replace('_start_stderr', '_stderr_start')} → {acc('rl')}", "", "", ""),
     ("PPO + critic, reward model, k1 KL in the reward, coef {ppo:metrics.train/kl_coef|.1f} (AMD EPYC host, "
      "`bench/rl_embedded.py`)",
      "{ppo:metrics.eval/accuracy_start|.3f} → {ppo:metrics.eval/accuracy|.3f} ± {ppo:metrics.eval/accuracy_stderr|.3f}",
      "{ppo:metrics.eval/reward_model_score_start|.3f} → {ppo:metrics.eval/reward_model_score|.3f}",
      "{ppo:metrics.train/kl|.2f}", "{ppo:wall_s|.0f} s"),
     ("tool task: SFT, then GRPO with a calculator, 40 × 32 × 8 trajectories (the committed `dvc.lock`)",
      f"{acc('tool_eval_sft', 'eval/accuracy_tool')} → {acc('tool_eval_rl', 'eval/accuracy_tool')}", "", "", "")),
    "2 CPU cores of AMD EPYC hosts (`dvc.lock`; the PPO run another day)")

CPU_SBS_FILE = R + "cpu/2026-12-02/side_by_side_cpu_xeon_2026-12-02_fused_adamw.json"


def _cpu_row(label: str, bench: str) -> tuple[str, ...]:
    rows, pair = f"results.{bench}.summary.rows", f"results.{bench}.summary.pairs.ours-fp32 / trl-fp32"
    return (label, median_range("r", f"{rows}.ours-fp32"), median_range("r", f"{rows}.trl-fp32"),
            f"{{r:{pair}.speedup_ours_over_trl|.2f}}×",
            f"{{r:{rows}.ours-fp32.peak_memory_gb|.2f}} / {{r:{rows}.trl-fp32.peak_memory_gb|.2f}} GB")


CPU_SBS = Table(
    "cpu-side-by-side", "BENCHMARKS.md", {"r": CPU_SBS_FILE},
    ("benchmark", "alignflow", "TRL {r:environment.versions.trl|}", "TRL / ours", "peak RSS ours / TRL"),
    (_cpu_row("GRPO step, {r:settings.benches.grpo.prompts_per_step|} prompts × {r:settings.benches.grpo.group_size|} × "
              "≤{r:settings.benches.grpo.max_new_tokens|} tokens", "grpo"),
     _cpu_row("SFT, batch {r:settings.benches.sft.batch|}", "sft"),
     _cpu_row("DPO, {r:settings.benches.dpo.batch|} pairs", "dpo"),
     _cpu_row("Reward model, {r:settings.benches.rm.batch|} pairs", "rm")),
    "Intel Xeon, {r:environment.cpus|} cores, torch {r:environment.versions.torch|}",
    "{r:settings.threads|} torch thread a side, {r:settings.rounds|} ABBA rounds, "
    "{r:results.grpo.summary.rows.ours-fp32.timed_steps|} timed GRPO and "
    "{r:results.sft.summary.rows.ours-fp32.timed_steps|} "
    "timed training steps a side; the call took {r:wall_s|.0f} s")


def _rl_row(label: str, alias: str, rm: bool) -> tuple[str, ...]:
    m = f"{alias}:metrics"
    score = f"{{{m}.eval/reward_model_score_start|.3f}} → {{{m}.eval/reward_model_score|.3f}}" if rm else ""
    return (label, f"{{{alias}:wall_s|.0f}} s", f"{{{m}.eval/accuracy_start|.3f}} → {{{m}.eval/accuracy|.3f}}", score)


RL_EMBEDDED = Table(
    "rl-embedded", "BENCHMARKS.md",
    {"grpo": R + "cpu/2026-11-26/rl_grpo_rule.json", "ppo": R + "cpu/2026-11-26/rl_ppo_rm.json",
     "grpo_gpu": R + "h200/2026-11-26/rl_grpo_rule_h200.json", "ppo_gpu": R + "h200/2026-11-26/rl_ppo_rm_h200.json"},
    ("run", "wall", "eval accuracy start → end", "RM score start → end"),
    (_rl_row("GRPO, rule, 40 × 32 prompts × 8 samples, CPU", "grpo", False),
     _rl_row("PPO + critic, reward model, CPU", "ppo", True),
     _rl_row("GRPO, rule, GPU (bf16 autocast)", "grpo_gpu", False),
     _rl_row("PPO + critic, reward model, GPU (bf16 autocast)", "ppo_gpu", True)),
    "CPU: AMD EPYC, 2 cores (shared), torch 2.13.0; GPU: NVIDIA H200")


def _smoke_row(label: str, key: str) -> tuple[str, ...]:
    r = f"r:results.{key}"
    return (label, f"{{{r}.train_seconds|.1f}} s", f"{{{r}.tokens_per_s|,}} tokens/s",
            f"{{{r}.accuracy|.3f}} ± {{{r}.accuracy_stderr|.3f}}")


GPU_SFT_SMOKE = Table(
    "gpu-sft-smoke", "BENCHMARKS.md", {"r": R + "h200/2026-11-26/gpu_sft_smoke_h200.json"},
    ("precision", "training (500 steps × 128)", "throughput", "eval accuracy"),
    (_smoke_row("fp32", "fp32"), _smoke_row("bf16 autocast", "bf16")),
    "{r:device|}, torch {r:torch|}, transformers {r:transformers|}",
    "MLflow installed: {r:mlflow_installed|}")

ZERO3_RESUME = Table(
    "zero3-resume", "BENCHMARKS.md", {"r": R + "h100x2/2026-11-27/gpu_zero3_resume_h100x2.json"},
    ("check", "result"),
    (("rank 1 SIGKILLed right after the step-{r:kill_at|} checkpoint",
      "the call failed {r:kill.seconds_to_fail|} s later (`RankFailed`)"),
     ("the same call again (Prefect's retry)",
      "resumed at step {r:retry_first_step|}; final weights max \\|diff\\| to the uninterrupted run's "
      "{r:max_abs_diff_vs_whole.killed|}, md5 {r:md5.killed|} against {r:md5.whole|}"),
     ("AdamW state at the resume vs the uninterrupted run's step {r:kill_at|}",
      "{r:optimizer_at_resume_vs_whole.tensors|} tensors, max \\|diff\\| {r:optimizer_at_resume_vs_whole.exp_avg|} "
      "(first moments), {r:optimizer_at_resume_vs_whole.exp_avg_sq|} (second)"),
     ("the step-{r:kill_at|} checkpoint finished on one GPU",
      "final loss relative gap {r:one_gpu_relative_loss_gap|}; weights max \\|diff\\| "
      "{r:max_abs_diff_vs_whole.single|.1e}")),
    "{r:gpus|} × {r:device|}, torch {r:torch|}",
    "{r:model_params|,}-parameter model, {r:steps|} steps")

HASH_REGISTRY = Table(
    "hash-registry", "BENCHMARKS.md",
    {"h": R + "cpu/2026-11-27/hash_cache_cpu.json", "g": R + "cpu/2026-11-27/registry_cost_cpu.json"},
    ("run", "time"),
    (("`dvc_md5` cold (every byte read) of a {h:bytes|/1e9:.1f} GB folder, {h:files|} files",
      "{h:cold.median_s|.1f} s ({h:cold.min_s|.1f}–{h:cold.max_s|.1f}), {h:cold_throughput_mb_s|.0f} MB/s"),
     ("`dvc_md5` warm, from the hash cache",
      "{h:warm.median_s|*1000:.1f} ms ({h:warm.min_s|*1000:.2f}–{h:warm.max_s|*1000:.2f})"),
     ("register by copy (`tracking.model_storage: copy`)",
      "{g:copy.seconds|.1f} s, {g:copy.mlartifacts_bytes_added|/1e9:.1f} GB added"),
     ("register by reference, md5 already cached",
      "{g:reference_warm_hash.*.seconds|median:.2f} s (median of {g:reference_warm_hash|len:d}), "
      "{g:reference_warm_hash.0.mlartifacts_bytes_added|} bytes"),
     ("`keep_model_versions` deleting a copied version",
      "{g:retention.seconds|.1f} s, {g:retention.mlartifacts_bytes_freed|/1e9:.1f} GB freed")),
    "{h:machine.cpu|}, {h:machine.cores|} cores",
    "page cache dropped before each run: {h:page_cache_dropped_before_each_run|}")

HOSTILE = Table(
    "hostile-input", "BENCHMARKS.md",
    {"r": R + "cpu/2026-12-04/redact_scaling_cpu.json", "v": R + "cpu/2026-12-04/validate_big_cpu.json",
     "c": R + "cpu/2026-12-05/chat_render_cost_cpu.json"},
    ("what", "result"),
    (("redaction of 400k characters, every adversarial family ({r:rows|len:d})",
      "the slowest family's median {r:rows.*.median_s.1|max:.3f} s; 200k → 400k characters: "
      "{r:rows.*.ratio|min:.1f}–{r:rows.*.ratio|max:.1f}× a family"),
     ("the dataset gate on a {v:file.bytes|/1e9:.0f} GB preference file ({v:file.rows|,} rows)",
      "{v:large_file.seconds|.1f} s, {v:large_file.throughput_mb_s|.2f} MB/s, peak RSS {v:large_file.peak_rss_mb|.1f} MB "
      "({v:large_file.baseline_rss_mb|.1f} MB baseline); faults found at lines {v:large_file.failures.0.lines.0|} and "
      "{v:large_file.failures.1.lines.0|}"),
     ("`alignflow validate` on a file with one 2 MB record",
      "{v:cli_30_rows_vs_2mb_record.huge.median_s|.2f} s ({v:cli_30_rows_vs_2mb_record.huge.range_s|range:.2f}) against "
      "{v:cli_30_rows_vs_2mb_record.small.median_s|.2f} s for 30 rows; exit status {v:huge_record_cli.rc|}"),
     ("a chat rendered with its time and nesting bounded",
      "{c:render_chat.median_us|.1f} µs against {c:apply_chat_template.median_us|.1f} µs unbounded")),
    "{c:machine|}")

def _sync_row(path: str) -> tuple[str, ...]:
    r = f"r:paths.{path}"
    return (path, f"{{{r}.perf/weight_sync_bytes.median|,.0f}}",
            f"{{{r}.perf/weight_sync_s.median|*1000:.1f}} ms ({{{r}.perf/weight_sync_s.min|*1000:.1f}}–"
            f"{{{r}.perf/weight_sync_s.max|*1000:.1f}})", f"{{{r}.perf/weight_sync_s.steps|}}",
            f"{{{r}.series.rollout/reward_mean|len:d}} rewards, last {{{r}.series.rollout/reward_mean.7|.4f}}",
            f"{{{r}.series.rollout/logprob_mismatch|max:.1e}}")


LORA_SYNC = Table(
    "lora-sync-cpu", "BENCHMARKS.md", {"r": R + "cpu/2026-12-07/lora_sync_vllm_cpu.json"},
    ("LoRA sync to vLLM", "bytes a sync (median)", "seconds a sync: median (min–max)", "syncs", "GRPO curve",
     "engine vs trainer log-prob mismatch (max)"),
    (_sync_row("adapters"), _sync_row("merged")),
    "CPU, {r:setup.cpus|} cores (shared with one other CPU-bound job), {r:setup.engine|}",
    "{r:setup.model|}, LoRA rank {r:setup.lora_rank|}, {r:setup.policy_ranks|} policy ranks, "
    "{r:setup.rollout_replicas|} vLLM replica ({r:setup.placement|}, weights through the {r:setup.weight_path|}), "
    "{r:setup.steps|} GRPO steps a path, same seed")


def _fp8_row(name: str) -> tuple[str, ...]:
    f = "f:rollout." + name
    lp = "f:logprobs_vs_bf16_trainer." + name
    return (name, f"{{{f}.median_s|.3f}} s ({{{f}.range_s|range:.3f}})", f"{{{f}.generated_tokens_per_s|,.0f}}",
            f"{{{lp}.mean_abs|.2e}} / {{{lp}.max_abs|.3f}}", f"{{{lp}.mismatch_kl|.2e}}",
            f"{{f:weight_sync.{name}.seconds|*1000:.1f}} ms, {{f:weight_sync.{name}.bytes|,d}} bytes")


FP8_ROLLOUT = Table(
    "gpu-fp8-rollout", "BENCHMARKS.md", {"f": R + "h100/2026-12-07/gpu_fp8_rollout.json"},
    ("static engine", "rollout: median (range)", "generated tokens/s", "log-prob vs bf16 trainer: mean / max abs",
     "mismatch KL", "weight sync"),
    (_fp8_row("bf16"), _fp8_row("fp8")),
    "{f:gpu|}, torch {f:torch|}",
    "Qwen2-0.5B-shaped random weights, 32k vocab, {f:prompts|} prompts × {f:group|} samples × {f:new_tokens|} new "
    "tokens, {f:reps|} timed calls each after a warm-up (ABBA), CUDA graphs and compiled layer halves; FP8 over bf16 "
    "{f:speedup_fp8_over_bf16|.2f}×")


def _lora_row(engine: str, path: str) -> tuple[str, ...]:
    r = f"l:engines.{engine}.{path}"
    return (f"{engine}, {path}", f"{{{r}.bytes_per_sync|,d}}",
            f"{{{r}.sync_s_median|*1000:.1f}} ms ({{{r}.sync_s_range|range:*1000:.1f}})",
            f"{{{r}.logprobs_vs_merged_trainer.mean_abs|.2e}} / {{{r}.logprobs_vs_merged_trainer.max_abs|.3f}}")


LORA_SYNC_GPU = Table(
    "gpu-lora-sync", "BENCHMARKS.md", {"l": R + "h100/2026-12-07/gpu_lora_sync_1p5b.json"},
    ("engine, sync", "bytes a sync", "seconds a sync: median (min–max)",
     "engine vs merged trainer log-prob: mean / max abs"),
    tuple(_lora_row(e, p) for e in ("hf", "static") for p in ("adapters", "merged")),
    "{l:gpu|}, torch {l:torch|}",
    "{l:model|}, LoRA rank {l:lora_rank|} (alpha {l:lora_alpha|}) on every linear layer but the LM head, "
    "{l:syncs_timed|} syncs a path after a warm-up, in one process (the learner's engine_weights to host memory, then "
    "the engine's update_weights)")


def sbs(alias: str, bench: str, ours: str, trl: str, frac: str = "") -> tuple[str, ...]:
    """A side-by-side pair of one call: ours (median, range, tokens/s, fraction), TRL's, the ratios."""
    rows = f"{alias}:results.{bench}.summary.rows"
    pair = f"{alias}:results.{bench}.summary.pairs.{ours} / {trl}"
    extra = f", {{{rows}.{ours}.tokens_per_s|k:.1f}} tokens/s ({{{rows}.{ours}.fraction_of_{frac}|.0%}} of {frac})" \
        if frac else f" ({{{rows}.{ours}.fraction_of_floor|.0%}} of the floor)"
    return (median_range(alias, f"results.{bench}.summary.rows.{ours}", ".3f") + extra,
            f"{trl}: " + median_range(alias, f"results.{bench}.summary.rows.{trl}", ".3f"),
            f"{{{pair}.speedup_ours_over_trl|.2f}}×", f"{{{pair}.peak_memory_ratio_ours_over_trl|.2f}}×",
            f"{{{pair}.gradient_checkpointing.ours|}} / {{{pair}.gradient_checkpointing.trl|}}")


SBS_HEADER = ("trainer", "call", "alignflow", "TRL", "TRL / ours", "peak memory ours / TRL", "checkpointing ours / TRL")

GPU_SBS = Table(
    "gpu-side-by-side", "BENCHMARKS.md",
    {"a": R + "h200/2026-12-02/side_by_side_h200_0p5b_bf16_packed_vs_trl_default.json",
     "b": R + "h200/2026-12-02/side_by_side_h200_0p5b_grpo_vs_trl_best.json",
     "c": R + "h200/2026-12-02/side_by_side_h200_0p5b_grpo_vs_trl_default_best.json",
     "d": R + "h200/2026-12-03/side_by_side_h200_1p5b_dpo_rm_ckpt_on.json",
     "e": R + "h200/2026-12-03/side_by_side_h200_1p5b_dpo_rm_ckpt_on_round2.json"},
    SBS_HEADER,
    (("SFT 0.5B", "a") + sbs("a", "sft", "ours-bf16-packed", "trl-default", "6NT"),
     ("DPO 0.5B, reference every step", "a") + sbs("a", "dpo", "ours-bf16-packed", "trl-default", "8NT"),
     ("Reward model 0.5B", "a") + sbs("a", "rm", "ours-bf16-packed", "trl-default", "6NT"),
     ("GRPO step 0.5B", "b") + sbs("b", "grpo", "ours-bf16-packed", "trl-best"),
     ("GRPO step 0.5B", "c") + sbs("c", "grpo", "ours-bf16-packed", "trl-default"),
     ("GRPO step 0.5B", "c") + sbs("c", "grpo", "ours-bf16-packed", "trl-best"),
     ("DPO 1.5B, checkpointing on both", "d") + sbs("d", "dpo", "ours-bf16-packed", "trl-default", "8NT"),
     ("DPO 1.5B, checkpointing on both", "e") + sbs("e", "dpo", "ours-bf16-packed", "trl-default", "8NT"),
     ("Reward model 1.5B, checkpointing on both", "d") + sbs("d", "rm", "ours-bf16-packed", "trl-default", "6NT"),
     ("Reward model 1.5B, checkpointing on both", "e") + sbs("e", "rm", "ours-bf16-packed", "trl-default", "6NT")),
    "{a:environment.nvidia_smi.0|}, one card a call",
    "ours `precision: bf16`, packed rows; timed steps a row: {a:results.sft.summary.rows.trl-default.timed_steps|} "
    "(a), {b:results.grpo.summary.rows.trl-best.timed_steps|} (b), "
    "{c:results.grpo.summary.rows.ours-bf16-packed.timed_steps|} ours / "
    "{c:results.grpo.summary.rows.trl-default.timed_steps|} TRL (c), {d:results.dpo.summary.rows.trl-default.timed_steps|} "
    "(d, e)")

GPU_MIXED = Table(
    "gpu-mixed-h100", "BENCHMARKS.md",
    {"a": R + "h100/2026-11-28/side_by_side_h100_0p5b_sft_mixed_vs_trl_mixed.json",
     "b": R + "h100/2026-11-28/side_by_side_h100_0p5b_sft_mixed_vs_trl_mixed_best.json",
     "c": R + "h100/2026-11-28/side_by_side_h100_0p5b_dpo_rm_mixed_vs_trl_mixed.json",
     "d": R + "h100/2026-11-28/side_by_side_h100_0p5b_dpo_rm_mixed_vs_trl_mixed_best.json"},
    SBS_HEADER,
    (("SFT (padded)", "a") + sbs("a", "sft", "ours-mixed", "trl-mixed", "6NT"),
     ("SFT (padded)", "b") + sbs("b", "sft", "ours-mixed", "trl-mixed-best", "6NT"),
     ("DPO (`packing: true`)", "c") + sbs("c", "dpo", "ours-mixed-packed", "trl-mixed", "8NT"),
     ("DPO (`packing: true`)", "d") + sbs("d", "dpo", "ours-mixed-packed", "trl-mixed-best", "8NT"),
     ("Reward model (`packing: true`)", "c") + sbs("c", "rm", "ours-mixed-packed", "trl-mixed", "6NT"),
     ("Reward model (`packing: true`)", "d") + sbs("d", "rm", "ours-mixed-packed", "trl-mixed-best", "6NT")),
    "{a:environment.nvidia_smi.0|}, one card a call",
    "ours `precision: mixed` (fp32 masters); TRL an fp32 model under `bf16=True`")

SEVEN_B = Table(
    "gpu-7b", "BENCHMARKS.md",
    {"a": R + "h200x4/2026-11-27/side_by_side_h200x4_7b_dpo.json",
     "b": R + "h200x4/2026-11-29/side_by_side_h200x4_7b_grpo_c2c3.json",
     "c": R + "h200x4/2026-11-29/side_by_side_h200x4_7b_grpo_c2c4_trl_ckpt_off.json"},
    SBS_HEADER,
    (("DPO, {a:settings.benches.dpo.batch|} pairs × ≤{a:settings.benches.dpo.max_length|} tokens", "a")
     + sbs("a", "dpo", "ours-bf16", "trl-default", "8NT"),
     ("GRPO step, TRL with its default checkpointing", "b") + sbs("b", "grpo", "ours-bf16", "trl-default"),
     ("GRPO step, TRL without checkpointing", "c") + sbs("c", "grpo", "ours-bf16", "trl-default")),
    "{a:settings.gpus|} × {a:environment.nvidia_smi.0|}",
    "timed steps a row: {a:results.dpo.summary.rows.ours-bf16.timed_steps|} (a), "
    "{b:results.grpo.summary.rows.ours-bf16.timed_steps|} (b, c); (b) combines {b:combined_from.0.file|} and "
    "{b:combined_from.1.file|}, (c) {c:combined_from.0.file|} and {c:combined_from.1.file|} (`--combine`)")


def _async_row(label: str, alias: str) -> tuple[str, ...]:
    s = f"{alias}:summary"
    return (label, f"{{{s}.median_step_s|.2f}} s", f"{{{s}.phase_s.perf/rollout_s|.2f}} s",
            f"{{{s}.phase_s.perf/logprob_s|.2f}} s", f"{{{s}.phase_s.perf/update_s|.2f}} s",
            f"{{{s}.weight_sync_s_each|min:.4f}}–{{{s}.weight_sync_s_each|max:.4f}} s")


ASYNC = Table(
    "gpu-async-grpo", "BENCHMARKS.md",
    {"a": R + "h200x2/2026-11-27/gpu_grpo_h200x2_disagg_stale0_collective_exitfix.json",
     "b": R + "h200x2/2026-11-27/gpu_grpo_h200x2_disagg_stale1_collective_exitfix.json",
     "c": R + "h200x2/2026-11-27/gpu_grpo_h200x2_disagg_stale0_object_store_exitfix.json"},
    ("run", "step (median)", "rollout", "log-probs", "update", "weight sync each"),
    (_async_row("sync, `distribution.weight_sync: collective`", "a"),
     _async_row("async (`off_policy.max_staleness: {b:summary.max_staleness|}`), collective", "b"),
     _async_row("sync, `distribution.weight_sync: object_store`", "c")),
    "{a:summary.gpus_seen|} × {a:summary.gpu|}, torch {a:summary.torch|}",
    "{a:summary.prompts|} prompts × {a:summary.group|} × {a:summary.new_tokens|} new tokens")


def _engine_row(label: str, key: str) -> tuple[str, ...]:
    e = f"a:engines.{key}"
    return (label, f"`{key}`", f"{{{e}.median_s|.3f}} s", f"{{{e}.ms_per_decode_step|.2f}} ms",
            f"{{{e}.generated_tokens_per_s|k:.1f}} tokens/s")


ENGINE = Table(
    "gpu-engine", "BENCHMARKS.md",
    {"a": R + "h200/2026-11-29/gpu_engine_h200_flash_compiled.json",
     "b": R + "h200/2026-12-01/gpu_engine_h200_triton_decode.json"},
    ("engine", "row of the file", "median of the calls", "a decode step", "generated"),
    (_engine_row("HF `generate`", "hf_generate"),
     _engine_row("our static-cache engine, the code before flash decode and compiled layers", "static_before"),
     _engine_row("static cache, CUDA graph, without compiled layers", "static_uncompiled"),
     _engine_row("static cache, CUDA graph, SDPA decode", "static_sdpa"),
     _engine_row("static cache, CUDA graph, flash decode over filled keys, compiled layer halves", "static_cuda_graphs"),
     ("decode phase of a call: our Triton flash-decoding kernel against torch's flash op (b)", "",
      "{b:phases_s_a_call.static_cuda_graphs.decode|.3f} s against {b:phases_s_a_call.static_torch_flash.decode|.3f} s",
      "", "")),
    "{a:gpu|}, torch {a:torch|}",
    "{a:rows|} rows × {a:new_tokens|} new tokens; (a) reports `static_cuda_graphs` over `hf_generate` as "
    "{a:speedup_static_graphs_over_hf_generate|.2f}×")


def _scaling_row(label: str, key: str) -> tuple[str, ...]:
    d, z = f"d:rows.{key}", f"z:rows.{key}"
    return (label, f"{{{d}.median_step_s_1gpu|.3f}} s ({{{d}.range_step_s.1|range:.3f}})",
            f"{{{d}.median_step_s_4gpu|.3f}} s ({{{d}.range_step_s.4|range:.3f}})",
            f"{{{z}.median_step_s_4gpu|.3f}} s ({{{z}.range_step_s.4|range:.3f}})",
            f"{{{d}.efficiency|.0%}} / {{{z}.efficiency|.0%}}",
            f"{{{d}.peak_memory_gb.1|.1f}} / {{{d}.peak_memory_gb.4|.1f}} / {{{z}.peak_memory_gb.4|.1f}} GB")


SCALING = Table(
    "gpu-scaling", "BENCHMARKS.md",
    {"d": R + "h200x4/2026-11-29/scaling_h200x4_1p5b_sft_dpo_ddp_c1.json",
     "z": R + "h200x4/2026-11-29/scaling_h200x4_1p5b_sft_dpo_zero2_c1c4.json"},
    ("trainer", "1 GPU", "4 GPUs DDP", "4 GPUs ZeRO-2", "efficiency DDP / ZeRO-2", "peak a GPU 1 / DDP / ZeRO-2"),
    (_scaling_row("SFT", "sft ours-bf16"), _scaling_row("DPO", "dpo ours-bf16")),
    "{d:gpus.1|} × {d:device|}",
    "global batch {d:rows.sft ours-bf16.global_batch.1|} rows on 1 and on 4 GPUs; target: {d:target|}")


def _mmm(alias: str, path: str) -> str:
    """``0.1925 s (0.1710–0.3100)``: a row's median step and its min–max."""
    return (f"{{{alias}:{path}.median_step_s|.4f}} s ({{{alias}:{path}.min_step_s|.4f}}–"
            f"{{{alias}:{path}.max_step_s|.4f}})")


def _search_row(config: str, options: str) -> tuple[str, ...]:
    c = f"search.configs.{config}"
    return (config, options, _mmm("s", c), f"{{s:{c}.max_over_min|.2f}}",
            f"{{s:{c}.median_step_s ÷ s:search.configs.trl-default.median_step_s|.2f}}×")


def trl_search_table(path: str, configs: tuple[tuple[str, str], ...], name: str = "trl-search",
                     bench: str = "SFT 32 × ≤512 tokens", bench_key: str = "sft") -> Table:
    """Issue 52 item 3: the TRL search's configurations at 0.5B (``side_by_side.py --search``; SFT, or GRPO with
    ``--bench grpo``), each one child of one call, and the winner (trl-best of the hygiene rows)."""
    return Table(
        name, "BENCHMARKS.md", {"s": path},
        ("TRL configuration", "options over trl-default", "median step (min–max)", "max / min", "median / trl-default's"),
        tuple(_search_row(c, o) for c, o in configs)
        + (("winner (trl-best)", "{s:search.winner|}", "", "", "{s:search.winner_over_default|.2f}×"),),
        "{s:environment.nvidia_smi.0|}",
        bench + f", one round of {{s:settings.benches.{bench_key}.steps|}} steps a configuration, "
        "{s:settings.warmup_steps|} warm-up steps dropped; TRL {s:environment.versions.trl|}, liger-kernel "
        "{s:environment.versions.liger-kernel|}; gradient checkpointing off unless named; {s:search.note|}")


def _hygiene_row(label: str, alias: str, bench: str, ours: str, missing: str = "") -> tuple[str, ...]:
    """One benchmark of one call: each row's median (min–max) and max/min, then TRL / ours for each TRL row;
    ``missing``: a TRL row the call did not run, and why."""
    rows = f"results.{bench}.summary.rows"
    pairs = f"{alias}:results.{bench}.summary.pairs"
    trl = ("trl-default", "trl-ours-backend", "trl-best")
    cells = tuple(missing if r == missing.split(":")[0] else
                  _mmm(alias, f"{rows}.{r}") + f", max/min {{{alias}:{rows}.{r}.max_over_min|.2f}}"
                  for r in (ours,) + trl)
    ratios = " / ".join("—" if t == missing.split(":")[0] else f"{{{pairs}.{ours} / {t}.speedup_ours_over_trl|.2f}}×"
                        for t in trl)
    return (label, alias) + cells + (ratios,)


def hygiene_table(sources: dict[str, str], rows: tuple[tuple[str, ...], ...], other_cards: str = "") -> Table:
    """Issue 52 item 2: ours against TRL as shipped, TRL with ours' attention backends and the searched trl-best,
    each call's rows in ABBA order under one thread count and allocator (``side_by_side.py``'s hygiene)."""
    first = next(iter(sources))
    return Table(
        "gpu-hygiene", "BENCHMARKS.md", sources,
        ("trainer", "call", "alignflow", "trl-default", "trl-ours-backend", "trl-best",
         "TRL / ours: default / ours' backend / best"),
        tuple(_hygiene_row(*r) for r in rows),
        f"{{{first}:environment.nvidia_smi.0|}}, one card a call{other_cards}",
        f"threads {{{first}:hygiene.threads|}} and `PYTORCH_CUDA_ALLOC_CONF={{{first}:hygiene.PYTORCH_CUDA_ALLOC_CONF|}}` "
        f"in every child; {{{first}:settings.rounds|}} ABBA rounds, {{{first}:settings.warmup_steps|}} warm-up steps "
        "a child dropped; trl-ours-backend and ours with cuDNN's SDPA off, trl-default with torch's default (on); "
        "trl-best the search's winner (table above); a row whose max/min exceeds 1.5 is flagged")


H200_1206 = R + "h200/2026-12-06/"
TRL_SEARCH = trl_search_table(H200_1206 + "side_by_side_h200_0p5b_trl_search.json", (
    ("trl-default", "none (sdpa, cuDNN SDPA on, padded batches, no liger, checkpointing off)"),
    ("trl-liger", "`use_liger_kernel`"),
    ("trl-cudnn-off", "cuDNN SDPA off (ours' backend)"),
    ("trl-padding-free", "`padding_free` (bfd packing)"),
    ("trl-eager", "`attn_implementation=\"eager\"`"),
    ("trl-ckpt-on", "gradient checkpointing on (TRL's own default)"),
    ("trl-liger-cudnn-off", "liger, cuDNN SDPA off"),
    ("trl-liger-padding-free", "liger, padding-free"),
    ("trl-liger-ckpt-on", "liger, gradient checkpointing on")))

GPU_HYGIENE = hygiene_table(
    {"a": H200_1206 + "side_by_side_h200_0p5b_sft_hygiene.json",
     "b": H200_1206 + "side_by_side_h200_0p5b_dpo_rm_hygiene.json",
     "pa": H200_1206 + "side_by_side_h200_0p5b_sft_hygiene_profiles.json",
     "pb": H200_1206 + "side_by_side_h200_0p5b_dpo_rm_hygiene_profiles.json",
     "c": R + "h100/2026-12-07/side_by_side_h100_0p5b_rm_hygiene.json",
     "pc": R + "h100/2026-12-07/side_by_side_h100_0p5b_rm_hygiene_profiles.json"},
    (("SFT 0.5B", "a", "sft", "ours-bf16-packed"),
     ("DPO 0.5B, reference every step", "b", "dpo", "ours-bf16-packed"),
     ("Reward model 0.5B, one round: {b:results.rm.summary.rows.trl-default.timed_steps|} timed steps a row, below "
      "the minimum (the call's deadline stopped it)", "b",
      "rm", "ours-bf16-packed", "trl-best: not run (the call's --deadline-s)"),
     ("Reward model 0.5B, the whole call, on an H100", "c", "rm", "ours-bf16-packed")),
    "; (c) on {c:environment.nvidia_smi.0|}")



REAL_EVALS = ("base", "sft", "rl", "raft", "base_second", "sft_second", "rl_second", "raft_second", "base_gsm",
              "raft_gsm")
REAL_MODELS = {"base": "imported", "sft": "SFT", "rl": "GRPO", "raft": "RAFT"}
REAL_TASKS = {"": "arithmetic (the task)", "_second": "letter counting", "_gsm": "gsm_symbolic"}
REAL_WALLS = R + "cpu/2026-12-07/real_recipe_walls_epyc.json"

README_REAL = Table(
    "readme-real", "README.md",
    {**{e: f"metrics/real_eval_{e}.json" for e in REAL_EVALS}, "walls": REAL_WALLS},
    ("model", "held-out task ({base:eval/n_items|.0f} items each)", "accuracy", "format rate",
     "accuracy among well-formatted"),
    tuple((REAL_MODELS[e.split("_")[0]], REAL_TASKS[e[len(e.split("_")[0]):]], acc(e), f"{{{e}:eval/format_rate|.3f}}",
           acc(e, "eval/accuracy_formatted")) for e in REAL_EVALS),
    "{walls:host} (`make real-recipe` from a fresh clone: {walls:total_wall_s|.0f} s in all, of which the run "
    "was stopped {walls:paused_s|.0f} s; {walls:conditions|})",
    "greedy; each model its chat template's prompt; judged by reasoning-gym's scorer (`label_check`)")


TABLES: tuple[Table, ...] = (EMBEDDED, README_OFFLINE, README_RL, CPU_SBS, RL_EMBEDDED, GPU_SFT_SMOKE, TRL_SEARCH,
                             GPU_HYGIENE, GPU_SBS, GPU_MIXED,
                             SEVEN_B, ASYNC, ENGINE, SCALING, ZERO3_RESUME, HASH_REGISTRY, HOSTILE, README_REAL,
                             LORA_SYNC, FP8_ROLLOUT, LORA_SYNC_GPU)

# what wrote a result file: the first prefix of its name that matches
PRODUCERS: tuple[tuple[str, str], ...] = (
    ("ab_", "bench/ab_processes.sh (side_by_side.py processes)"),
    ("side_by_side_", "bench/side_by_side.py"),
    ("scaling_", "bench/side_by_side.py --gpus, --scaling"),
    ("prof_", "bench/side_by_side.py --profile"),
    ("pyspy_", "py-spy over bench/side_by_side.py"),
    ("gpu_engine_", "bench/gpu_engine.py"),
    ("gpu_rollout_exactness", "bench/gpu_rollout_exactness.py"),
    ("gpu_grpo_", "bench/gpu_grpo.py"),
    ("gpu_liger_probe", "bench/gpu_liger_probe.py"),
    ("gpu_lm_head_check", "bench/gpu_lm_head_check.py"),
    ("gpu_varlen_check", "bench/gpu_lm_head_check.py --parts packed"),
    ("gpu_nosync_check", "bench/gpu_lm_head_check.py --parts nosync"),
    ("gpu_profile", "bench/gpu_profile.py"),
    ("gpu_fp8", "bench/gpu_fp8.py"),
    ("gpu_lora_sync", "bench/gpu_lora_sync.py"),
    ("parity_probe", "bench/parity_probe.py"),
    ("lora_sync_vllm_cpu", "bench/lora_sync_cpu.py --sync adapters, then --sync merged"),
    ("gpu_sft_profile", "bench/gpu_sft_profile.py"),
    ("gpu_sft_smoke", "bench/gpu_sft_smoke.py"),
    ("gpu_zero3_resume", "bench/gpu_zero3_resume.py"),
    ("hash_cache", "bench/hash_cache.py"),
    ("registry_cost", "bench/registry_cost.py"),
    ("redact_scaling", "bench/redact_scaling.py"),
    ("validate_big", "bench/validate_big.py"),
    ("chat_render_cost", "bench/chat_render_cost.py"),
    ("opt_host", "bench/opt_host.py"),
    ("real_recipe_walls", "bench/real_recipe_walls.py (after make real-recipe)"),
    ("rl_embedded_cpu.md", "notes on bench/rl_embedded.py runs"),
    ("rl_async_cpu.md", "notes on bench/rl_embedded.py runs"),
    ("rl_", "bench/rl_embedded.py"),
    ("reproduce_", "alignflow reproduce"),
    ("logs_", "bench/side_by_side.py (per-rank logs)"),
    ("nvidia_smi_topo", "nvidia-smi topo -m"),
    ("kto_seeds", "alignflow kto --set seed=S"),
    ("h200_session", "a device call's log"),
)
