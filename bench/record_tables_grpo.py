"""The benchmark record's tables of the GRPO step toward its floor (issue 52 part 4) and of the engine's exactness
(``bench/record.py`` renders them with :data:`record_tables.TABLES`): the GRPO side by side with TRL under the
hygiene rules (0.5B, two ABBA rounds; 1.5B), issue 52's GRPO targets, the before/after processes of one warm GPU,
the engine's log-probs against the trainer's in the same call, the sampler A/B, TRL's GRPO search and the
batch-invariant forward on a GPU.
"""

from __future__ import annotations

from record_tables import R, Table, trl_search_table

H100_1207 = R + "h100/2026-12-07/"
AB = H100_1207 + "side_by_side_h100_0p5b_grpo_floor_ab_{}.json"
OURS = "results.grpo.summary.rows.ours-bf16-packed"


HYGIENE = H100_1207 + "side_by_side_h100_0p5b_grpo_hygiene_final.json"
ONE_5B = H100_1207 + "side_by_side_h100_1p5b_grpo_summary.json"


def _pooled_row(label: str, alias: str, row: str, rounds: int, ours: str = "ours-bf16-packed") -> tuple[str, ...]:
    """One row of a GRPO side by side: median (min–max) over its ``rounds`` rounds, max/min, each round's median,
    TRL / ours, peak memory and checkpointing."""
    r = f"{alias}:results.grpo.summary.rows.{row}"
    ratio = "—" if row == ours else f"{{{alias}:results.grpo.summary.pairs.{ours} / {row}.speedup_ours_over_trl|.2f}}×"
    each = " / ".join(f"{{{r}.round_medians_s.{i}|.3f}}" for i in range(rounds)) + " s"
    return (label, f"{{{r}.median_step_s|.3f}} s ({{{r}.range_step_s|range:.3f}})", f"{{{r}.max_over_min|.2f}}",
            each, ratio, f"{{{r}.peak_memory_gb|.1f}} GB", f"{{{r}.gradient_checkpointing.on|}}")


def _phases_row(label: str, alias: str, ours: str = "ours-bf16-packed") -> tuple[str, ...]:
    """Ours' phases (medians of the timed steps), its share of the floor and its generated tokens/s."""
    r = f"{alias}:results.grpo.summary.rows.{ours}"
    return (label, f"rollout {{{r}.phase_s.rollout_s|.3f}} s, log-probs {{{r}.phase_s.logprob_s|.3f}} s, update "
            f"{{{r}.phase_s.update_s|.3f}} s", "", f"{{{r}.fraction_of_floor|.0%}} of the floor "
            f"({{{r}.floor_s|.3f}} s)", "", f"{{{r}.generated_tokens_per_s|,.0f}} generated tokens/s", "")


COLUMNS = ("row", "step: median (min–max)", "max / min", "each round's median", "TRL / ours", "peak memory",
           "gradient checkpointing")

GRPO_HYGIENE = Table(
    "gpu-hygiene-grpo", "BENCHMARKS.md", {"h": HYGIENE}, COLUMNS,
    (_pooled_row("ours-bf16-packed", "h", "ours-bf16-packed", 2),
     _pooled_row("trl-default (cuDNN SDPA on, torch's default)", "h", "trl-default", 2),
     _pooled_row("trl-ours-backend (cuDNN SDPA off, as ours)", "h", "trl-ours-backend", 2),
     _pooled_row("trl-best: the GRPO search's winner, {h:trl_best_from.winner|}, the same processes as "
                 "trl-ours-backend", "h", "trl-best", 2),
     _phases_row("ours-bf16-packed: phases (medians)", "h")),
    "{h:environment.nvidia_smi.0|}, both rounds' calls on one warm machine",
    "GRPO 64 prompts × 8 × 256 new tokens, Qwen2-0.5B shape, 32k vocab, one policy update a step; "
    "{h:settings.rounds|} ABBA rounds, one a call (`--rounds 1 --waive-hygiene`, the second call's rows reversed, "
    "pooled by `--combine-rounds`), {h:results.grpo.summary.rows.trl-default.timed_steps|} timed steps a row after "
    "{h:settings.warmup_steps|} warm-up steps a call; threads {h:hygiene.threads|} and "
    "`PYTORCH_CUDA_ALLOC_CONF={h:hygiene.PYTORCH_CUDA_ALLOC_CONF|}` in every child; gradient checkpointing off on "
    "both sides (`--trl-grad-ckpt off`); TRL generates with HF `generate`, ours with its static-cache engine; a row "
    "whose max/min exceeds 1.5 is flagged: none is")

GRPO_1P5B = Table(
    "gpu-grpo-1p5b", "BENCHMARKS.md", {"g": ONE_5B}, COLUMNS,
    (_pooled_row("ours-bf16-packed", "g", "ours-bf16-packed", 1),
     _pooled_row("trl-ours-backend (cuDNN SDPA off, as ours)", "g", "trl-ours-backend", 1),
     _phases_row("ours-bf16-packed: phases (medians)", "g")),
    "{g:environment.nvidia_smi.0|}, one call",
    "GRPO 64 prompts × 8 × 256 new tokens, Qwen2.5-1.5B shape (vocab 151,936), one policy update a step; one round "
    "(`--rounds 1 --waive-hygiene`), {g:results.grpo.summary.rows.ours-bf16-packed.timed_steps|} timed steps a row "
    "after {g:settings.warmup_steps|} warm-up steps; threads {g:hygiene.threads|}; gradient checkpointing off on "
    "both sides; the summary recomputed from the call's file by `--combine` with the current targets")


def _target_row(alias: str, index: int, spec: str, unit: str = "") -> tuple[str, ...]:
    """One of a file's ``summary.targets`` (by position; its own ``target`` text names it in the row)."""
    t = f"{alias}:summary.targets.{index}"
    return (f"{{{t}.target|}}", f"{{{t}.value|{spec}}}{unit}", f"{{{t}.status|}}", f"{{{t}.device|}}")


GRPO_TARGETS = Table(
    "gpu-grpo-targets", "BENCHMARKS.md", {"h": HYGIENE, "g": ONE_5B},
    ("issue 52's target (written for one H200)", "measured", "status", "card that ran"),
    (_target_row("h", 9, ".3f", " s"), _target_row("h", 10, ".0%"), _target_row("h", 11, ".3f", " s"),
     _target_row("h", 12, ".2f", "× its floor"), _target_row("g", 3, ".3f", " s")),
    "{h:environment.nvidia_smi.0|}: the two calls of the tables above",
    "ours-best's medians: the step and the rollout in seconds, the update as a multiple of its floor; the floor is "
    "`bench/side_by_side.py`'s formula with each call's measured ceilings")


def _ab_row(label: str, alias: str) -> tuple[str, ...]:
    """One process of the A/B: its median step (range), phases (medians), share of the floor, tokens/s, memory."""
    phase = f"{alias}:{OURS}.phase_s"
    return (label, f"{{{alias}:{OURS}.median_step_s|.3f}} s ({{{alias}:{OURS}.range_step_s|range:.3f}})",
            f"{{{phase}.rollout_s|.3f}} s", f"{{{phase}.logprob_s|.3f}} s", f"{{{phase}.update_s|.3f}} s",
            f"{{{alias}:{OURS}.fraction_of_floor|.0%}} of {{{alias}:{OURS}.floor_s|.3f}} s",
            f"{{{alias}:{OURS}.generated_tokens_per_s|,.0f}}", f"{{{alias}:{OURS}.peak_memory_gb|.1f}} GB")


GRPO_FLOOR_AB = Table(
    "gpu-grpo-floor-ab", "BENCHMARKS.md",
    {"b1": AB.format("1_before"), "a2": AB.format("2_after"), "a3": AB.format("3_after"), "b4": AB.format("4_before")},
    ("process (ABBA)", "step: median (range)", "rollout", "log-probs", "update", "share of the floor",
     "generated tokens/s", "peak memory"),
    (_ab_row("1: before", "b1"), _ab_row("2: after", "a2"), _ab_row("3: after", "a3"), _ab_row("4: before", "b4")),
    "{b1:environment.nvidia_smi.0|}, torch {b1:environment.versions.torch|}, one warm machine (process 4 in a later "
    "call on it)",
    "GRPO 64 prompts × 8 × 256 new tokens, Qwen2-0.5B shape, 32k vocab, ours-bf16-packed; "
    "{b1:results.grpo.summary.rows.ours-bf16-packed.timed_steps|} timed steps a process after "
    "{b1:settings.warmup_steps|} warm-up steps (`bench/ab_processes.sh`, `--rounds 1 --waive-hygiene` a process); "
    "before: rlhf_core of c25f56c; after: of 5543fca (the decoder kept across rollouts, one device read a "
    "mini-batch in the update, the fused Triton sampler); phases are medians of the timed steps")


def _exact_row(label: str, alias: str) -> tuple[str, ...]:
    phases = f"{alias}:last_call_phases_s"
    return (label, f"{{{alias}:generate_walls_s.2|.3f}} s", f"{{{phases}.decode|.3f}} s",
            f"{{{alias}:mean_abs_diff|.2e}} / {{{alias}:max_abs_diff|.4f}}", f"{{{alias}:mismatch_kl_k3|.2e}}",
            f"{{{alias}:tokens|,d}}", "{" + alias + ":kept_decoder|}")


ROLLOUT_EXACTNESS = Table(
    "gpu-rollout-exactness", "BENCHMARKS.md",
    {"b": H100_1207 + "gpu_rollout_exactness_h100_0p5b_before.json",
     "a": H100_1207 + "gpu_rollout_exactness_h100_0p5b_after.json"},
    ("engine code", "third generate call", "its decode phase", "engine − trainer log-prob: mean / max abs",
     "mismatch KL (k3)", "sampled tokens", "decoder kept"),
    (_exact_row("before (c25f56c)", "b"), _exact_row("after (5543fca)", "a")),
    "{b:device|}, in the call of the A/B's processes 1 and 2, on the model they built",
    "512 rows × 256 new tokens, bf16; three generate calls with every weight moved in place before the second and "
    "third; the third call's sampled tokens scored by the trainer's forward (`bench/gpu_rollout_exactness.py`)")


def _engine_row(label: str, key: str) -> tuple[str, ...]:
    e = f"e:engines.{key}"
    return (label, f"{{{e}.median_s|.3f}} s", f"{{e:phases_s_a_call.{key}.decode|.3f}} s",
            f"{{{e}.ms_per_decode_step|.3f}} ms", f"{{{e}.generated_tokens_per_s|,.0f}}")


SAMPLER_AB = Table(
    "gpu-sampler-ab", "BENCHMARKS.md", {"e": H100_1207 + "gpu_engine_h100_sampler_ab.json"},
    ("static engine", "generate: median of the calls", "decode phase", "a decode step", "generated tokens/s"),
    (_engine_row("fused Triton inverse-CDF sampler (`SETTINGS.sampler` auto)", "static_cuda_graphs"),
     _engine_row("torch's log-softmax, cumsum and searchsorted", "static_cuda_graphs_torch_sampler")),
    "{e:gpu|}, torch {e:torch|}",
    "{e:rows|} rows × {e:new_tokens|} new tokens, CUDA graphs, compiled layer halves, Triton decode attention; "
    "5 calls each, the first included; the fused sampler's engine over torch's: "
    "{e:speedup_default_sampler_over_torch_sampler|.3f}×")

TRL_SEARCH_GRPO = trl_search_table(H100_1207 + "side_by_side_h100_0p5b_grpo_trl_search.json", (
    ("trl-default", "none (sdpa, cuDNN SDPA on, HF `generate` with its dynamic cache, no liger, checkpointing off)"),
    ("trl-cudnn-off", "cuDNN SDPA off (ours' backend)"),
    ("trl-static-cache", "`cache_implementation=\"static\"` for `generate`"),
    ("trl-liger", "`use_liger_kernel`")),
    name="trl-search-grpo", bench="GRPO 64 prompts × 8 × 256 new tokens (`--search --bench grpo`; eager attention and "
    "checkpointing on were listed but not reached before the call's --deadline-s)", bench_key="grpo")


def _parity_row(label: str, check: str) -> tuple[str, ...]:
    return (label,) + tuple(f"{{p:{side}.{check}.bit_identical|}} ({{p:{side}.{check}.tokens_differing|,d}} of "
                            f"{{p:{side}.{check}.tokens|,d}} differ, max {{p:{side}.{check}.max_abs_diff|.3g}})"
                            for side in ("off", "on"))


PARITY_GPU = Table(
    "gpu-parity-probe", "BENCHMARKS.md", {"p": H100_1207 + "parity_probe_h100_bf16.json"},
    ("a batch of 64 left-padded rows against", "plain forward: bit-identical", "batch-invariant forward: bit-identical"),
    (_parity_row("each row alone", "batch_vs_alone"),
     _parity_row("half the rows ended early", "batch_vs_rows_ended_early"),
     _parity_row("prefill + token-by-token decode over the cache", "batch_vs_cached_decode"),
     ("forward of the batch: median", "{p:off.forward_s.median|.4f} s", "{p:on.forward_s.median|.4f} s "
      "({p:on_over_off_forward|.2f}× the plain one)")),
    "{p:device|}, torch {p:torch|}, {p:dtype|}",
    "the 0.5B bench model (random weights, 32k vocab); prompts of 3–{p:shape.prompt_width|} tokens, "
    "{p:shape.response|} more; blocks of {p:block_rows|} rows (`bench/parity_probe.py --device cuda`)")

PARITY_RUN = H100_1207 + "gpu_grpo_h100_0p5b_{}_parity_{}_call2.json"


def _parity_grpo_row(engine: str, alias: str, off: str | None) -> tuple[str, ...]:
    """One run of ``bench/gpu_grpo.py`` (medians of steps 2..N), and with ``off`` its phases over that run's."""
    s = f"{alias}:summary"
    ratio = "—" if off is None else " / ".join(
        f"{{{s}.{key} ÷ {off}:summary.{key}|.1f}}×" for key in
        ("median_step_s", "phase_s.perf/rollout_s", "phase_s.perf/logprob_s", "phase_s.perf/update_s"))
    return (engine, f"{{{s}.parity|}}", f"{{{s}.logprob_mismatch_max_all_steps|.3g}}",
            f"{{{s}.median_step_s|.3f}} s",
            ", ".join(f"{{{alias}:steps.{i}.perf/step_s|.3f}}" for i in (1, 2, 3)) + " s",
            f"{{{s}.phase_s.perf/rollout_s|.3f}} s",
            f"{{{s}.phase_s.perf/logprob_s|.3f}} s", f"{{{s}.phase_s.perf/update_s|.3f}} s",
            f"{{{s}.peak_gpu_memory_gb_this_process|.1f}} GB", ratio)


PARITY_GRPO = Table(
    "gpu-parity-grpo", "BENCHMARKS.md",
    {"son": PARITY_RUN.format("static", "on"), "soff": PARITY_RUN.format("static", "off"),
     "hon": PARITY_RUN.format("hf", "on"), "hoff": PARITY_RUN.format("hf", "off")},
    ("engine", "parity", "rollout/logprob_mismatch: largest of the 4 steps", "step (median of steps 2..4)", "steps 2, 3, 4",
     "rollout", "log-probs", "update", "peak memory", "on over off: step / rollout / log-probs / update"),
    (_parity_grpo_row("static", "son", "soff"), _parity_grpo_row("static", "soff", None),
     _parity_grpo_row("HF generate", "hon", "hoff"), _parity_grpo_row("HF generate", "hoff", None)),
    "{son:summary.gpu|}, torch {son:summary.torch|}, the four runs one after another in one call",
    "GRPO {son:summary.prompts|} prompts × {son:summary.group|} × {son:summary.new_tokens|} new tokens, Qwen2-0.5B "
    "shape, random weights, 32k vocab, precision auto (bf16 weights); parity on: the model's own modules in the "
    "trainer (no compiled layers, no liger) and eager decode; off: compiled layers, and the static engine's CUDA graphs "
    "(`bench/gpu_grpo.py --engine static|hf [--parity] --prompts 32 --new-tokens 128 --steps 4`)")

TABLES: tuple[Table, ...] = (GRPO_HYGIENE, GRPO_1P5B, GRPO_TARGETS, GRPO_FLOOR_AB, ROLLOUT_EXACTNESS, SAMPLER_AB, TRL_SEARCH_GRPO, PARITY_GPU, PARITY_GRPO)
