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
from rlhf_core.data.formats import PromptExample, Text, is_conversational, prompt_text, read_prompt_examples
from rlhf_core.data.io import DataError, read_records
from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, pick_device
from rlhf_core.embedded.tasks import normalize_completion, rule_reward, write_jsonl
from rlhf_core.rewards.model import load_reward_model, score
from rlhf_core.rollout.evaluate import judged
from rlhf_core.rewards.sources import FunctionRewardSource


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


def _answer(prompt: Text, text: str) -> Text:
    """A kept completion in its prompt's form: for a conversation, one assistant message (so RAFT's SFT
    and DPO render it with the chat template)."""
    return [{"role": "assistant", "content": text}] if is_conversational(prompt) else text


def _score(cfg: RejectionConfig, examples: list[PromptExample], prompts: list[str], flat: list[str],
           device: torch.device) -> list[float]:
    """Each candidate's score (``cfg.n_samples`` per prompt, in order): the rule against the prompt's label
    (``cfg.label_check``'s function where set; given the ``prompts`` the policy read), or the reward model's, reading each prompt as its own tokenizer
    renders it."""
    k = cfg.n_samples
    if cfg.scorer == "rule":  # the label check (cfg.label_check), else the embedded task's exact match
        labels = [str(e.label) for e in examples for _ in range(k)]
        rule = FunctionRewardSource(cfg.label_check) if cfg.label_check else rule_reward
        return [float(r) for r in rule([p for p in prompts for _ in range(k)], flat, labels)]

    rm = load_reward_model(cfg.reward_model_path, device)
    rm_tokenizer = load_tokenizer(cfg.reward_model_path)
    rm_prompts = [prompt_text(rm_tokenizer, e.prompt) for e in examples for _ in range(k)]
    return score(rm, rm_tokenizer, rm_prompts, flat, batch_size=cfg.batch_size * 4)


def _keep(cfg: RejectionConfig, examples: list[PromptExample], scores: list[float],
          flat: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[tuple[int, str]]]:
    """Rows of the best candidate per prompt (where it scores at least ``cfg.min_score``), rows of best vs worst
    where they differ, and which prompt (index) kept which answer."""
    best_rows, pair_rows, kept = [], [], []
    k = cfg.n_samples
    for i, example in enumerate(examples):
        cand = [(scores[i * k + j], j, flat[i * k + j]) for j in range(k) if flat[i * k + j]]
        if not cand:
            continue
        best = max(cand, key=lambda t: (t[0], -t[1]))  # ties: the earliest sample
        if best[0] < cfg.min_score:
            continue
        worst = min(cand, key=lambda t: (t[0], t[1]))
        prompt = example.prompt
        kept.append((i, best[2]))
        best_rows.append({cfg.prompt_field: prompt, cfg.completion_field: _answer(prompt, best[2]),
                          "score": round(best[0], 6)})
        if best[0] > worst[0] and best[2] != worst[2]:
            pair_rows.append({cfg.prompt_field: prompt, cfg.chosen_field: _answer(prompt, best[2]),
                              cfg.rejected_field: _answer(prompt, worst[2]),
                              cfg.margin_field: round(best[0] - worst[0], 6)})
    return best_rows, pair_rows, kept


def rejection_sample(cfg: RejectionConfig, show_progress: bool = True) -> RejectionResult:
    """Sample, score, keep the best; write ``cfg.output_file`` and ``cfg.pairs_file`` atomically.

    A conversational prompt is sampled as the policy's chat template renders it, and its kept answers
    are written as assistant messages (conversational prompt-completion and preference records)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.num_threads)
    examples = read_prompt_examples(read_records(cfg.prompts_file, limit=cfg.max_prompts or None), cfg.prompts_file,
                                    prompt_field=cfg.prompt_field, label_field=cfg.label_field)
    missing = [e.line for e in examples if e.label is None]
    if cfg.scorer == "rule" and missing:
        raise DataError(cfg.prompts_file, missing[0], "missing (needed by scorer=rule)", cfg.label_field)
    device = pick_device()
    policy = load_causal_lm(cfg.policy_path, device)
    tokenizer = load_tokenizer(cfg.policy_path)
    prompts = [prompt_text(tokenizer, e.prompt) for e in examples]
    candidates = sample_completions(policy, tokenizer, prompts, n=cfg.n_samples, temperature=cfg.temperature,
                                    top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                    seed=cfg.seed, show_progress=show_progress)
    del policy
    flat = [normalize_completion(c) for cands in candidates for c in cands]
    scores = _score(cfg, examples, prompts, flat, device)
    best_rows, pair_rows, kept = _keep(cfg, examples, scores, flat)
    out = write_jsonl(best_rows, Path(cfg.output_file))
    pairs = write_jsonl(pair_rows, Path(cfg.pairs_file))
    metrics = {"rejection/n_prompts": float(len(examples)), "rejection/n_kept": float(len(best_rows)),
               "rejection/n_pairs": float(len(pair_rows)),
               "rejection/score_mean": sum(scores) / max(len(scores), 1),
               "rejection/best_score_mean": sum(r["score"] for r in best_rows) / max(len(best_rows), 1)}
    if cfg.label_field and not missing:
        labels = [str(e.label) for e in examples]  # judged as every evaluation judges (cfg.label_check)
        kept_ok = judged(cfg.label_check, [prompts[i] for i, _ in kept], [text for _, text in kept],
                         [labels[i] for i, _ in kept])
        metrics["rejection/kept_accuracy"] = sum(kept_ok) / max(len(kept_ok), 1)
        owner = [j // cfg.n_samples for j in range(len(flat))]
        sample_ok = judged(cfg.label_check, [prompts[i] for i in owner], flat, [labels[i] for i in owner])
        metrics["rejection/sample_accuracy"] = sum(sample_ok) / max(len(flat), 1)
    return RejectionResult(out, pairs, metrics)
