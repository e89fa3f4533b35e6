"""Rejection sampling: n candidates per prompt from a policy, scored, the best kept.

The building block of RAFT (Dong et al. 2023, "RAFT: Reward rAnked FineTuning") and of
iterative DPO: the best candidate per prompt becomes an SFT example, and best vs. worst a
preference pair. Candidates are scored by a trained reward model or by the task's rule.

Run: ``alignflow rejection`` (config: ``params.yaml`` section ``rejection``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from rlhf_core.config import RejectionConfig
from rlhf_core.data.io import DataError, read_records, require_str
from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.models import load_causal_lm, load_tokenizer, pick_device
from rlhf_core.synthetic import normalize_completion, rule_reward, write_jsonl


@dataclass
class RejectionResult:
    """Where the kept data went and how good it is."""

    output_file: Path
    pairs_file: Path
    metrics: dict[str, float]


@torch.no_grad()
def sample_completions(model: Any, tokenizer: Any, prompts: Sequence[str], *, n: int, temperature: float,
                       top_p: float, max_new_tokens: int, batch_size: int, seed: int,
                       show_progress: bool = False) -> list[list[str]]:
    """``n`` sampled completions per prompt (left-padded batches, KV cache, stop at eos)."""
    model.eval()
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    out: list[list[str]] = []
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="sample", disable=not show_progress, leave=False):
        chunk = [encode_prompt(tokenizer, p) for p in prompts[start:start + batch_size]]
        width = max(len(ids) for ids in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(chunk):
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             temperature=temperature, top_p=top_p, top_k=0, num_return_sequences=n,
                             max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
        out.extend(texts[i * n:(i + 1) * n] for i in range(len(chunk)))
    return out


def rejection_sample(cfg: RejectionConfig, show_progress: bool = True) -> RejectionResult:
    """Sample, score, keep the best; write ``cfg.output_file`` and ``cfg.pairs_file`` atomically."""
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.num_threads)
    records = read_records(cfg.prompts_file, limit=cfg.max_prompts or None)
    prompts = [require_str(r, cfg.prompt_field, cfg.prompts_file) for r in records]
    device = pick_device()
    policy = load_causal_lm(cfg.policy_path, device)
    tokenizer = load_tokenizer(cfg.policy_path)
    candidates = sample_completions(policy, tokenizer, prompts, n=cfg.n_samples, temperature=cfg.temperature,
                                    top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                    seed=cfg.seed, show_progress=show_progress)
    del policy
    flat_prompts = [p for p, cands in zip(prompts, candidates) for _ in cands]
    flat = [normalize_completion(c) for cands in candidates for c in cands]

    # ---- score: the reward model, or the rule against each prompt's label ------------------
    if cfg.scorer == "rule":
        missing = [r.line for r in records if cfg.label_field not in r.data]
        if missing:
            raise DataError(cfg.prompts_file, missing[0], "missing (needed by scorer=rule)", cfg.label_field)
        labels = [str(r[cfg.label_field]) for r in records for _ in range(cfg.n_samples)]
        scores = rule_reward(flat_prompts, flat, labels)
    else:
        from rlhf_core.reward_model import load_reward_model, score

        rm = load_reward_model(cfg.reward_model_path, device)
        scores = score(rm, load_tokenizer(cfg.reward_model_path), flat_prompts, flat, batch_size=cfg.batch_size * 4)

    # ---- keep: best per prompt; best vs worst where they differ -----------------------------
    best_rows, pair_rows = [], []
    k = cfg.n_samples
    for i, prompt in enumerate(prompts):
        cand = [(scores[i * k + j], j, flat[i * k + j]) for j in range(k) if flat[i * k + j]]
        if not cand:
            continue
        best = max(cand, key=lambda t: (t[0], -t[1]))  # ties: the earliest sample
        worst = min(cand, key=lambda t: (t[0], t[1]))
        best_rows.append({cfg.prompt_field: prompt, cfg.completion_field: best[2], "score": round(best[0], 6)})
        if best[0] > worst[0] and best[2] != worst[2]:
            pair_rows.append({cfg.prompt_field: prompt, cfg.chosen_field: best[2], cfg.rejected_field: worst[2],
                              cfg.margin_field: round(best[0] - worst[0], 6)})
    out = write_jsonl(best_rows, Path(cfg.output_file))
    pairs = write_jsonl(pair_rows, Path(cfg.pairs_file))
    metrics = {"rejection/n_prompts": float(len(prompts)), "rejection/n_kept": float(len(best_rows)),
               "rejection/n_pairs": float(len(pair_rows)),
               "rejection/score_mean": sum(scores) / max(len(scores), 1),
               "rejection/best_score_mean": sum(r["score"] for r in best_rows) / max(len(best_rows), 1)}
    if cfg.label_field and all(cfg.label_field in r.data for r in records):
        by_prompt = {p: str(r[cfg.label_field]) for p, r in zip(prompts, records)}
        kept_ok = [normalize_completion(r[cfg.completion_field]) == by_prompt[r[cfg.prompt_field]] for r in best_rows]
        metrics["rejection/kept_accuracy"] = sum(kept_ok) / max(len(kept_ok), 1)
        metrics["rejection/sample_accuracy"] = sum(
            c == lab for c, lab in zip(flat, [by_prompt[p] for p in flat_prompts])) / max(len(flat), 1)
    return RejectionResult(out, pairs, metrics)
