"""Measure what the guards compare: a parent and a child model answering the same held-out items.

For each eval item (the stage's eval file, its first ``max_items``) a model answers greedily (the same
answers as ``eval/accuracy``); the probe records per item whether the answer is correct (when the item has a
label), its held-out reward score (the stage's reward, or the reward model of ``guards.reward_model_path``),
its length in characters and its slice (skill), and, along the child's answer, the next-token entropy and
``KL(child || reference)`` summed over the answer's tokens (its eos included), computed exactly over the
vocabulary. :mod:`rlhf_core.promotion.guards` turns the two records into guards.

A stage with an environment (``rl.environment.spec``: multi-turn tool use) is probed as its own eval answers
(:func:`probe_with_environment`): greedily multi-turn with the same environment, turn limit and token budgets,
correct where the reward of the trajectory (the rule reward reads the final answer) is 1; length, entropy and KL
count the policy's own tokens, never the tool's observations (the training loss's mask). A single-turn probe of
such a model measures a task it was not trained for (after RL the tool model always calls the tool, and
single-turn, without the tool's reply, it answers nothing right).

The parent's record is cached under ``<project>/.alignflow/probes/`` keyed on the DVC md5s of the model and
eval file, the settings, the reward's identity and, for a multi-turn probe, the environment's (so a single-turn
record never stands in for a multi-turn one): in a cycle flow each child becomes the next parent, and every stage
of the align flow shares the SFT parent, so the parent is answered once.

The child's greedy answers are not generated again when the stage's final eval already made them with the same
settings (:func:`reusable_answers`: same eval file, items, token budget, batch size, device and fp32 weights):
the probe then only scores them (entropy, KL, reward). A multi-turn probe generates its own: the stage's eval keeps
only its first trajectories.

Run: called by :func:`rlhf_core.stages.guard.check_stage_guards` after every policy stage.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.data.formats import prompt_text, read_prompt_examples
from rlhf_core.data.io import read_records
from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
from rlhf_core.rollout.environments import OBSERVATION, rollout_with_environment, tool_conversations
from rlhf_core.rollout.evaluate import _question, greedy_answers, judged
from rlhf_core.promotion.guards import ProbeRecord
from rlhf_core.embedded.tasks import parse_prompt

RewardFn = Callable[[list[str], list[str], list[Any]], Sequence[float]]


@dataclass
class EvalItems:
    """The held-out items both models answer: rendered prompts, labels (None where absent) and slices."""

    prompts: list[str]
    labels: list[Any]
    slices: list[str | None]
    examples: list[Any] = field(default_factory=list)
    """The items as read (:class:`rlhf_core.data.formats.PromptExample`: a conversation stays a list of messages,
    which a multi-turn probe in chat mode renders tool turns into)."""
    source: str = ""
    """The eval file they come from (named in errors)."""
    label_check: str = ""
    """How an answer is judged against its label (:attr:`rlhf_core.config.DataFields.label_check`)."""

    @property
    def has_labels(self) -> bool:
        return bool(self.labels) and all(label is not None for label in self.labels)


def read_eval_items(eval_file: str | Path, tokenizer: Any, *, prompt_field: str, label_field: str, slice_field: str,
                    max_items: int, label_check: str = "") -> EvalItems:
    """The first ``max_items`` items of ``eval_file``; an item's slice is its ``slice_field`` or, for the embedded
    task, the skill its prompt asks for."""
    records = read_records(eval_file, limit=max_items)
    examples = read_prompt_examples(records, eval_file, prompt_field=prompt_field, label_field=label_field)
    slices: list[str | None] = []
    for record, example in zip(records, examples):
        if record.get(slice_field) is not None:
            slices.append(str(record[slice_field]))
        else:
            problem = parse_prompt(_question(example.prompt))
            slices.append(problem.skill if problem is not None else None)
    return EvalItems([prompt_text(tokenizer, e.prompt) for e in examples], [e.label for e in examples], slices,
                     list(examples), str(eval_file), label_check)


@torch.no_grad()
def scored_statistics(model: Any, seqs: Sequence[list[int]], positions: Sequence[list[int]], pad_id: int, *,
                      reference: Any = None, batch_size: int = 16) -> tuple[float, int, list[float]]:
    """Over the listed ``positions`` of each token sequence (position t predicts token t+1): the summed next-token
    entropy of ``model`` and how many positions that is, and per sequence the summed ``KL(model || reference)``
    (empty without ``reference``); both exact over the vocabulary."""
    device = next(model.parameters()).device
    kls: list[float] = []
    entropy_sum, count = 0.0, 0
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start:start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, s in enumerate(chunk):  # right padding: positions keep their meaning
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        ref_logp = (torch.log_softmax(reference(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
                    if reference is not None else None)
        for i, where in enumerate(positions[start:start + batch_size]):
            at = torch.tensor(where, dtype=torch.long, device=device)
            lp = logp[i, at]  # (scored positions, vocab)
            entropy_sum += float(-(lp.exp() * lp).sum())
            count += len(where)
            if ref_logp is not None:
                # KL(p || q) = sum_v p_v (log p_v - log q_v), per position, summed over the scored positions
                kls.append(float((lp.exp() * (lp - ref_logp[i, at])).sum()))
    return entropy_sum, count, kls


def answer_statistics(model: Any, tokenizer: Any, prompts: Sequence[str], answers: Sequence[str], *,
                      reference: Any = None, batch_size: int = 64) -> tuple[list[float], float, list[float] | None]:
    """Per answer: its length in characters (what a reader sees, and free of any decode/re-encode round trip);
    over all answer positions: the mean next-token entropy of ``model``; per
    answer: summed ``KL(model || reference)`` over its positions (None without ``reference``).

    Each sequence is ``prompt + answer + eos``; position t predicts token t+1, so the answer's positions are
    ``len(prompt) - 1 .. len(prompt) + len(answer) - 1`` (the last one predicts eos): every answer, even an
    empty one, has at least one."""
    seqs, positions = [], []
    for prompt, answer in zip(prompts, answers):
        p_ids = encode_prompt(tokenizer, prompt)
        a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        seqs.append(p_ids + a_ids + [tokenizer.eos_token_id])
        positions.append(list(range(len(p_ids) - 1, len(p_ids) + len(a_ids))))
    entropy_sum, count, kls = scored_statistics(model, seqs, positions, tokenizer.pad_token_id, reference=reference,
                                                batch_size=batch_size)
    lengths = [float(len(answer)) for answer in answers]
    return lengths, entropy_sum / max(count, 1), (kls if reference is not None else None)


PROBE_BATCH_SIZE = 256
"""Generation batch size of the probe: the trainers' final eval's (:func:`rlhf_core.rollout.evaluate.evaluate_exact_match`),
so their answers are the same (left padding to another width could round a logit otherwise)."""


def probe(model: Any, tokenizer: Any, items: EvalItems, *, reward_fn: RewardFn | None, reference: Any = None,
          max_new_tokens: int = 12, batch_size: int = PROBE_BATCH_SIZE,
          answers: list[str] | None = None) -> tuple[ProbeRecord, list[str]]:
    """One model's :class:`ProbeRecord` on ``items`` and its greedy answers (``answers``: already made by the
    stage's final eval, see :func:`reusable_answers`; else generated here)."""
    if answers is None:
        answers = greedy_answers(model, tokenizer, items.prompts, max_new_tokens=max_new_tokens,
                                 batch_size=batch_size)
    elif len(answers) != len(items.prompts):
        raise ValueError(f"probe: {len(answers)} answers given for {len(items.prompts)} items")
    correct = ([float(ok) for ok in judged(items.label_check, items.prompts, answers, items.labels)]
               if items.has_labels else None)
    reward = [float(r) for r in reward_fn(list(items.prompts), answers, list(items.labels))] if reward_fn else None
    was_training = model.training
    model.eval()
    lengths, entropy, kls = answer_statistics(model, tokenizer, items.prompts, answers, reference=reference,
                                              batch_size=min(batch_size, 16))  # whole-vocab log-probs per position
    model.train(was_training)
    kl = sum(kls) / len(kls) if kls else None
    return ProbeRecord(correct, reward, lengths, entropy, kl, list(items.slices)), answers


@dataclass(frozen=True)
class ProbeEnvironment:
    """The multi-turn setting of a stage with an environment (``rl.environment.spec``): the probe answers with the same
    environment, turn limit and token budgets as the stage's own eval
    (:func:`rlhf_core.rollout.environments.evaluate_with_environment`)."""

    make_env: Callable[[], Any]
    """A fresh environment per trajectory (:func:`rlhf_core.rollout.environments.environment_factory`)."""
    identity: dict[str, Any] | None
    """What the answers depend on besides the model (spec, its file's md5, limits): a part of the parent probe
    cache's key; None (an environment server, whose replies may change): never cache."""
    max_turns: int
    max_trajectory_tokens: int
    max_new_tokens: int
    tool_messages: str = "text"
    """How observations join a trajectory (``rl.environment.tool_messages``;
    :class:`rlhf_core.rollout.environments.ToolMessages`)."""
    prompt_field: str = "prompt"


def policy_spans(actions: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of the policy's own tokens (``actions`` 1; observation tokens 0)."""
    spans, start = [], None
    for j, a in enumerate([*actions, OBSERVATION]):
        if a != OBSERVATION and start is None:
            start = j
        elif a == OBSERVATION and start is not None:
            spans.append((start, j))
            start = None
    return spans


def trajectory_statistics(model: Any, tokenizer: Any, batch: Any, *, reference: Any = None,
                          batch_size: int = 16) -> tuple[list[float], float, list[float] | None]:
    """:func:`answer_statistics` of multi-turn trajectories (a :class:`rlhf_core.rollout.engine.RolloutBatch` with
    ``action_mask``), over the policy's own tokens only, as the training loss counts them: per trajectory the
    characters of its policy spans (a tool call counts, the tool's observation does not); the mean entropy over
    the positions that predict a policy token; per trajectory the KL summed over those positions.

    The sequence is ``prompt + response`` exactly as sampled (no re-tokenisation); response token j sits at
    ``len(prompt) + j`` and is predicted at the position before it. The eos is scored where the trajectory
    sampled one (a trajectory cut by the budget has none)."""
    seqs, positions, lengths = [], [], []
    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        k = int(batch.response_mask[i].sum())
        ids, actions = batch.response_ids[i, :k].tolist(), batch.action_mask[i, :k].tolist()
        spans = policy_spans(actions)
        seqs.append(prompt + ids)
        positions.append([len(prompt) + j - 1 for lo, hi in spans for j in range(lo, hi)])
        lengths.append(float(sum(len(tokenizer.decode(ids[lo:hi], skip_special_tokens=True)) for lo, hi in spans)))
    entropy_sum, count, kls = scored_statistics(model, seqs, positions, tokenizer.pad_token_id, reference=reference,
                                                batch_size=batch_size)
    return lengths, entropy_sum / max(count, 1), (kls if reference is not None else None)


def probe_with_environment(model: Any, tokenizer: Any, items: EvalItems, env: ProbeEnvironment, *,
                           reward_fn: RewardFn, reference: Any = None,
                           batch_size: int = PROBE_BATCH_SIZE) -> tuple[ProbeRecord, list[str]]:
    """One model's :class:`ProbeRecord` on ``items`` answered greedily multi-turn with ``env``'s tool, and its
    trajectories' text (observations included). The answers are generated here (the stage's final eval keeps
    only a few trajectories); generation and scoring are :func:`rlhf_core.rollout.environments.evaluate_with_environment`'s
    (HF engine, same batch size, greedy): per item the reward of the trajectory plus the environment's own, correct
    where that is >= 1 (the rule reward's 0/1 on the final answer). Length, entropy and KL count the policy's
    tokens only (:func:`trajectory_statistics`)."""
    labels = [None if y is None else str(y) for y in items.labels]
    # chat mode renders tool turns into the conversations, as the stage's eval does
    conversations = tool_conversations(env.tool_messages, tokenizer, items.examples, items.source, env.prompt_field)
    was_training = model.training
    model.eval()
    batch, env_rewards = rollout_with_environment(
        HFGenerateEngine(model, tokenizer, batch_size=batch_size), tokenizer, items.prompts, labels,
        SamplingParams(n=1, temperature=0.0, max_new_tokens=env.max_new_tokens), env.make_env,
        max_turns=env.max_turns, max_trajectory_tokens=env.max_trajectory_tokens, conversations=conversations)
    scores = [float(r) + float(e) for r, e in zip(reward_fn(list(items.prompts), batch.completions, labels),
                                                  env_rewards)]
    correct = [float(s >= 1.0) for s in scores] if items.has_labels else None
    lengths, entropy, kls = trajectory_statistics(model, tokenizer, batch, reference=reference,
                                                  batch_size=min(batch_size, 16))  # whole-vocab log-probs
    model.train(was_training)
    kl = sum(kls) / len(kls) if kls else None
    return ProbeRecord(correct, scores, lengths, entropy, kl, list(items.slices)), list(batch.completions)


def reusable_answers(record: dict[str, Any] | None, model: Any, *, eval_file: str | Path, max_items: int,
                     max_new_tokens: int, prompt_field: str, n_items: int) -> list[str] | None:
    """The stage's final-eval answers (a :class:`rlhf_core.rollout.evaluate.GreedyAnswers` as a dict) when they are what the
    probe would generate with the saved ``model``: same eval file and items, token budget, batch size and prompt
    field, on the same device type with fp32 weights on both sides and no unmerged adapters; else None."""
    if not record:
        return None
    param = next(model.parameters())
    same = (Path(record["eval_file"]).resolve() == Path(eval_file).resolve() and record["max_items"] == max_items
            and record["max_new_tokens"] == max_new_tokens and record["batch_size"] == PROBE_BATCH_SIZE
            and record["prompt_field"] == prompt_field and record["device"] == param.device.type
            and record["dtype"] == str(param.dtype) == str(torch.float32) and not record["adapters"]
            and len(record["answers"]) == n_items)
    return list(record["answers"]) if same else None


def probe_key(model_md5: str, eval_md5: str, settings: dict[str, Any]) -> str:
    """The parent probe cache's key: what the record depends on."""
    blob = json.dumps({"model": model_md5, "eval": eval_md5, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_cached(path: Path) -> tuple[ProbeRecord, list[str]] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return ProbeRecord(**data["record"]), list(data["answers"])
    except (ValueError, KeyError, TypeError):  # a torn or older file: answer again
        return None


def save_cached(path: Path, record: ProbeRecord, answers: list[str]) -> None:
    write_text_atomic(path, json.dumps({"record": asdict(record), "answers": answers}))
