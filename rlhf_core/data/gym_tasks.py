"""Datasets drawn from a reasoning-gym task: RL prompts, held-out eval items and SFT answers, disjoint by construction.

``alignflow gym-generate`` (section ``gym_generate``; the real recipe's ``real_generate``) writes into ``out_dir``:

* ``eval.jsonl``: ``eval_size`` held-out items of ``task`` drawn with ``eval_seed`` (prompt-only kind with labels);
* ``eval_<name>.jsonl``: each ``extra_eval`` task's held-out items, drawn with its own seed;
* ``prompts.jsonl``: ``train_size`` training items drawn with ``train_seed`` (RL prompts with labels);
* ``sft.jsonl``: the same training questions, each with its reference answer in the expected format;
* ``manifest.json``: task names, configs, seeds, sizes, the reasoning-gym version, item counts and what was dropped.

Every question gets ``instruction`` appended and is written as one user message when ``conversational`` (the
policy's chat template renders it in every stage, :mod:`rlhf_core.data.formats`). Each label is the item's
:func:`rlhf_core.data.gym_answers.make_label`. A drawn item whose prompt repeats an earlier one of its set is
skipped, and a training item whose prompt is one of the held-out sets' is skipped while drawing, under the data
report's contamination normalisation (:class:`rlhf_core.data.quality.EvalIndex`); the data report still checks the
files at training time, so a hand-edited overlap is refused there. Items are drawn index by index from one
reasoning-gym dataset per seed (an item depends on its seed and index only), so the same config writes the same
bytes. The files are written only once every item is drawn, each atomically, the manifest last.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.config import ConfigError, GymGenerateConfig
from rlhf_core.data.gym_answers import formatted_answer, make_label
from rlhf_core.data.quality import EvalIndex, normalize, text_of

PACKAGE = "reasoning-gym"
DRAWS_PER_ITEM = 4
"""Indices tried per item wanted (plus :data:`DRAW_MARGIN`) before a task is called too small for its size."""
DRAW_MARGIN = 100


def reasoning_gym() -> Any:
    """The ``reasoning_gym`` module, or a :class:`ConfigError` saying how to install it."""
    try:
        import reasoning_gym as rg  # lazy: reasoning_gym (the real-model extra)
    except ImportError:
        raise ConfigError(f"{PACKAGE} is not installed: run `make setup-real` (the real-model extra) to write "
                          "reasoning-gym datasets or score their answers") from None
    return rg


def open_task(task: str, task_config: dict[str, Any], seed: int, size: int, where: str) -> Any:
    """reasoning-gym's dataset ``task`` of ``size`` items; an unknown name or a config the task rejects is a
    :class:`ConfigError` naming ``where`` (``section.task``)."""
    rg = reasoning_gym()
    from reasoning_gym.factory import DATASETS  # lazy: reasoning_gym (the real-model extra)

    if task not in DATASETS:
        close = difflib.get_close_matches(task, sorted(DATASETS), n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"{len(DATASETS)} tasks, e.g. {', '.join(sorted(DATASETS)[:5])}"
        raise ConfigError(f"{where}: unknown reasoning-gym task {task!r} ({hint})")
    try:
        return rg.create_dataset(task, seed=seed, size=size, **task_config)
    except Exception as exc:  # noqa: BLE001 - any rejection of the config (TypeError, AssertionError, ValueError)
        raise ConfigError(f"{where.rsplit('.', 1)[0]}.task_config: task {task!r} rejects {task_config!r}: "
                          f"{type(exc).__name__}: {exc}") from None


def prompt_of(question: str, instruction: str, conversational: bool) -> Any:
    """A prompt record's prompt: the question with the instruction appended, as one user message or plain text."""
    text = question + instruction
    return [{"role": "user", "content": text}] if conversational else text


def _key(prompt: Any) -> str:
    """A prompt as the data report's contamination and repeat checks compare it."""
    return normalize(text_of(prompt))


@dataclass
class Draw:
    """Items drawn from one dataset: the records written, and how many were skipped and why."""

    records: list[dict[str, Any]] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    repeats: int = 0
    in_heldout: int = 0
    tried: int = 0


def draw(items: Iterator[dict[str, Any]], task: str, size: int, cfg: GymGenerateConfig,
         heldout: list[EvalIndex], where: str) -> Draw:
    """The first ``size`` items of ``items`` whose prompt repeats no earlier one and is in none of ``heldout``."""
    out, seen = Draw(), set()
    for item in items:
        out.tried += 1
        prompt = prompt_of(item["question"], cfg.instruction, cfg.conversational)
        key = _key(prompt)
        if key in seen:
            out.repeats += 1
            continue
        if any(index.exact_match(text_of(prompt)) for index in heldout):
            out.in_heldout += 1
            continue
        seen.add(key)
        try:
            label = make_label(task, item["answer"], item.get("metadata") or {})
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out.records.append({"prompt": prompt, "label": label})
        out.answers.append(str(item["answer"]))
        if len(out.records) == size:
            return out
    raise ConfigError(f"{where}: task {task!r} gave {len(out.records)} distinct items in {out.tried} draws, fewer "
                      f"than the {size} asked for ({out.repeats} repeats, {out.in_heldout} in the held-out sets): "
                      "widen its task_config or ask for fewer")


def _items(task: str, task_config: dict[str, Any], seed: int, size: int, where: str) -> Iterator[dict[str, Any]]:
    ds = open_task(task, task_config, seed, DRAWS_PER_ITEM * size + DRAW_MARGIN, where)
    return (ds[i] for i in range(len(ds)))


def _jsonl(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)


def _sft_records(train: Draw, conversational: bool) -> list[dict[str, Any]]:
    """The training questions with their reference answers in the expected format (prompt-completion form)."""
    out = []
    for record, answer in zip(train.records, train.answers):
        text = formatted_answer(answer)
        completion = [{"role": "assistant", "content": text}] if conversational else " " + text
        out.append({"prompt": record["prompt"], "completion": completion})
    return out


def write_gym_datasets(cfg: GymGenerateConfig, section: str = GymGenerateConfig.section) -> dict[str, Path]:
    """Draw every set of ``cfg`` and write them (module docstring); returns name -> path, the manifest included.
    Errors name ``section``'s field."""
    heldout = {"eval": draw(_items(cfg.task, cfg.task_config, cfg.eval_seed, cfg.eval_size, f"{section}.task"),
                            cfg.task, cfg.eval_size, cfg, [], f"{section}.eval_size")}
    for i, extra in enumerate(cfg.extra_eval):
        where = f"{section}.extra_eval[{i}]"
        items = _items(extra["task"], extra.get("task_config") or {}, extra["seed"], extra["size"], f"{where}.task")
        heldout[f"eval_{extra['name']}"] = draw(items, extra["task"], extra["size"], cfg, [], f"{where}.size")
    indexes = [EvalIndex(text_of(r["prompt"]) for r in d.records) for d in heldout.values()]
    train = draw(_items(cfg.task, cfg.task_config, cfg.train_seed, cfg.train_size, f"{section}.task"),
                 cfg.task, cfg.train_size, cfg, indexes, f"{section}.train_size")
    files = {"prompts": train.records, "sft": _sft_records(train, cfg.conversational),
             **{name: d.records for name, d in heldout.items()}}
    manifest = _manifest(cfg, train, heldout, indexes[0], {name: len(r) for name, r in files.items()})
    out = Path(cfg.out_dir)
    paths = {name: write_text_atomic(out / f"{name}.jsonl", _jsonl(records)) for name, records in files.items()}
    paths["manifest"] = write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return paths


def _manifest(cfg: GymGenerateConfig, train: Draw, heldout: dict[str, Draw], eval_index: EvalIndex,
              counts: dict[str, int]) -> dict[str, Any]:
    """What the files were drawn from and what was skipped (the data report's n-gram check of the training
    prompts against eval.jsonl is counted, not enforced here: a task's fixed wording can share 13 words)."""
    return {
        "package": PACKAGE, "version": importlib.metadata.version(PACKAGE),
        "task": cfg.task, "task_config": cfg.task_config, "train_seed": cfg.train_seed, "eval_seed": cfg.eval_seed,
        "train_size": cfg.train_size, "eval_size": cfg.eval_size, "instruction": cfg.instruction,
        "conversational": cfg.conversational,
        "extra_eval": [{**e, "task_config": e.get("task_config") or {}} for e in cfg.extra_eval],
        "items": counts,
        "dropped": {"train_in_heldout": train.in_heldout, "train_repeats": train.repeats,
                    **{f"{name}_repeats": d.repeats for name, d in heldout.items()}},
        "train_eval_ngram_overlaps": sum(eval_index.ngram_overlap(text_of(r["prompt"])) for r in train.records),
    }
