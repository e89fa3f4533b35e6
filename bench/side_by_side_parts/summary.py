"""Summary: medians and ranges, fractions of 6NT, floors, ratios, targets; and the result file's settings,
environment and model facts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from .settings import BENCHES, NO_MULTICAST, OPTIMIZER, OURS_BEST, PAIRS, ROWS, SETTINGS
from .hygiene import MIN_TIMED, compare_rows, same_backend, spread
from .inputs import bench_paths
from .measure import thread_counts
from .processes import has_nvidia_smi


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
    need = 3 if s["gpus"] > 1 else MIN_TIMED[name]  # the hygiene minimum (7B on 4 GPUs: 3)
    entry = {**spread(timed), "range_step_s": [round(min(timed), 4), round(max(timed), 4)],
             "round_medians_s": [round(_median(r["step_s"][warmup:]), 4) for r in ok], "timed_steps": len(timed),
             "enough_timed_steps": len(timed) >= need, "device": ok[0].get("device"),
             "runs_ok": len(ok), "runs_failed": len(row_runs) - len(ok),
             "peak_memory_gb": round(max(r["peak_memory_gb"] for r in ok), 2),
             "settings": ok[0].get("settings"), "launch": ok[0].get("launch"), "threads": ok[0].get("threads"),
             "hygiene": ok[0].get("hygiene")}
    if len({json.dumps(r.get("hygiene"), sort_keys=True) for r in ok}) > 1:
        entry["hygiene_by_run"] = [r.get("hygiene") for r in ok]  # the children of one row differed
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
                "like_with_like_checkpointing": ca.get("on") is not None and ca.get("on") == ct.get("on"),
                "like_with_like_backend": same_backend(rows[a].get("hygiene"), rows[t].get("hygiene"))}
    out["pairs"] = pairs
    out["hygiene"] = compare_rows({r: e.get("hygiene") for r, e in rows.items() if r != "ours-best"})
    if "median_step_s" in rows.get("trl-best", {}) and "median_step_s" in rows.get("trl-default", {}):
        out["trl_best_over_default"] = round(rows["trl-best"]["median_step_s"] / rows["trl-default"]["median_step_s"], 3)
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


# Issue 52's GRPO targets, written for one H200: (what, the value from ours-best's row and the floor, threshold,
# higher is better). On another card the record states the card beside the status.
_GRPO_TARGETS = {
    "gpu": (("grpo step <= 1.3 s", lambda r, f: r.get("median_step_s"), 1.3, False),
            ("grpo fraction of floor >= 50%", lambda r, f: r.get("fraction_of_floor"), 0.5, True),
            ("grpo rollout <= 0.45 s", lambda r, f: (r.get("phase_s") or {}).get("rollout_s"), 0.45, False),
            ("grpo update <= 1.6x its floor",
             lambda r, f: round(r["phase_s"]["update_s"] / f["update_s"], 3)
             if r.get("phase_s") and f.get("update_s") else None, 1.6, False)),
    "gpu-1.5b": (("grpo step <= 3.8 s", lambda r, f: r.get("median_step_s"), 3.8, False),)}


def _grpo_targets(variant: str, summary: dict) -> list[dict]:
    """Issue 52's GRPO targets for ``variant``, from ours-best's row of the GRPO summary (not measured without one)."""
    row, fl = summary.get("rows", {}).get("ours-best", {}), summary.get("floor", {})
    return [{**_target(what, "grpo", value(row, fl), thr, higher, "ours-best"), "written_for": "one NVIDIA H200",
             "device": row.get("device")} for what, value, thr, higher in _GRPO_TARGETS.get(variant, ())]


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
    out += _grpo_targets(variant, results.get("grpo", {}).get("summary", {}))
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
    model_dir, _ = bench_paths(inputs, "sft")
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
        rows = read_records(bench_paths(inputs, name)[1])[:256]
        total = 0
        for r in rows:
            for seq in fields:  # + 1: the end-of-sequence token; truncated at max_length
                total += min(len(tok("".join(r[f] for f in seq), add_special_tokens=False)["input_ids"]) + 1,
                             s[name]["max_length"])
        per_row[name] = total / len(rows)
    prompts = read_records(bench_paths(inputs, "grpo")[1])
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
    return {"versions": versions, "cpus": os.cpu_count(), "parent_threads": thread_counts(),
            "nvidia_smi": _smi_names(), "multicast_env": NO_MULTICAST}


def _smi_names() -> list[str]:
    if not has_nvidia_smi():
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


def summarize(variant: str, results: dict, warmup: int, ceiling: dict, facts: dict) -> dict:
    """Every benchmark's summary, written into ``results``, and the file's: the ratios of each pair and the targets."""
    for name, res in results.items():
        res["summary"] = bench_summary(variant, name, res["runs"], warmup, ceiling, facts)
    return {"pairs": {n: r["summary"]["pairs"] for n, r in results.items()}, "targets": targets(variant, results)}
