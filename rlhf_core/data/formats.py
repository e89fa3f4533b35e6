"""TRL's dataset formats, standard and conversational, read into one shape per stage kind.

A field holds either plain text (TRL's *standard* form) or a list of ``{role, content}``
messages (*conversational*). Every stage reads its file through one reader here and gets
examples whose prompt and answer are still in the user's form; :func:`prompt_text` and
:func:`completion_text` then render them for one tokenizer: standard text as it is, a
conversation with the tokenizer's chat template (``PLAIN_CHAT_TEMPLATE`` when it has none),
the prompt with the generation prompt appended, the answer as the rest of the rendered chat.
Downstream code (tokenisation, rollouts, evaluation) sees strings only, so the template is
applied in every stage the same way.

=================  ========================================  ================================
kind               standard                                  conversational
=================  ========================================  ================================
prompt-only        ``prompt: str``                           ``prompt: [messages]`` (not
(RL, rejection,                                              ending with an assistant turn)
evaluation)
prompt-completion  ``prompt: str, completion: str``          ``prompt: [msgs], completion:
(SFT, RAFT,                                                  [one assistant msg]``; or
distill)                                                     ``messages: [msgs]`` (SFT only)
preference         ``prompt, chosen, rejected: str``;        ``prompt: [msgs], chosen /
(DPO, RM)          implicit: ``chosen, rejected`` only       rejected: [one assistant msg]``;
                   (the prompt = their common prefix, cut    implicit: ``chosen / rejected:
                   back to a whitespace)                     [msgs]`` sharing all but the last
unpaired           ``prompt, completion: str,                as prompt-completion, plus the
(KTO)              desirable: bool`` (TRL's ``label``: set   boolean field
                   ``desirable_field: label``)
=================  ========================================  ================================

Field names come from :class:`rlhf_core.config.DataFields` (and ``KTOConfig.desirable_field``).
Errors are :class:`DataError` naming file, line and field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_core.data.chat import ROLES, message_problem, render_chat  # noqa: F401 (ROLES: read from here by validate.py)
from rlhf_core.data.io import DataError, Record

Messages = list[dict[str, Any]]
Text = str | Messages
"""A field's value: standard text, or a conversation."""


def is_conversational(value: Any) -> bool:
    """Whether a field value is in the conversational form (a list, of messages if well formed)."""
    return isinstance(value, list)


def plain_text(value: Any) -> str:
    """A field's words without structure (a tokenizer corpus): text as is, a conversation's contents joined."""
    if is_conversational(value):
        return "".join(m["content"] for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))
    return "" if value is None else str(value)


# --------------------------------------------------------------------------------------
# Field checks (each a DataError naming file, line and field)
# --------------------------------------------------------------------------------------


def check_messages(value: Any, path: str | Path, line: int, field: str) -> Messages:
    """A non-empty list of ``{role, content}`` with known roles and string content."""
    if not isinstance(value, list) or not value:
        raise DataError(path, line, "expected a non-empty list of {role, content} messages", field)
    for j, m in enumerate(value):
        if (problem := message_problem(m)) is not None:
            raise DataError(path, line, f"message {j}: {problem}", field)
    return value


def _text(rec: Record, field: str, path: str | Path) -> Text:
    """A field that is either a non-blank string or a well-formed message list."""
    if field not in rec.data or rec.data[field] is None:
        raise DataError(rec.where(path), rec.line, "missing", field)
    value = rec.data[field]
    if is_conversational(value):
        return check_messages(value, rec.where(path), rec.line, field)
    if not isinstance(value, str):
        raise DataError(rec.where(path), rec.line,
                        f"expected a string or a list of messages, got {type(value).__name__}", field)
    if not value.strip():
        raise DataError(rec.where(path), rec.line, "empty string", field)
    return value


def _prompt(rec: Record, field: str, path: str | Path) -> Text:
    value = _text(rec, field, path)
    if is_conversational(value) and value[-1]["role"] == "assistant":
        raise DataError(rec.where(path), rec.line, "a prompt conversation must not end with an assistant turn", field)
    return value


def _answer(rec: Record, field: str, prompt: Text, path: str | Path) -> Text:
    """A completion/chosen/rejected value in the prompt's form; conversational: one assistant message."""
    value = _text(rec, field, path)
    if is_conversational(value) != is_conversational(prompt):
        form = "a list of messages" if is_conversational(prompt) else "a string"
        raise DataError(rec.where(path), rec.line, f"must be {form}, as the prompt is", field)
    if is_conversational(value) and (len(value) != 1 or value[0]["role"] != "assistant"):
        raise DataError(rec.where(path), rec.line, "expected exactly one assistant message", field)
    return value


# --------------------------------------------------------------------------------------
# Examples per stage kind
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptExample:
    """A prompt (RL, rejection sampling, evaluation) and its checkable answer, if any."""

    prompt: Text
    label: str | None
    line: int


@dataclass(frozen=True)
class CompletionExample:
    """A prompt and the answer to train on (SFT, RAFT, distillation)."""

    prompt: Text
    completion: Text
    line: int


@dataclass(frozen=True)
class PairExample:
    """A prompt, a preferred and a dispreferred answer (DPO, reward model)."""

    prompt: Text
    chosen: Text
    rejected: Text
    margin: float | None
    line: int


@dataclass(frozen=True)
class UnpairedExample:
    """A prompt, an answer and whether it is desirable (KTO)."""

    prompt: Text
    completion: Text
    desirable: bool
    line: int


def read_prompt_examples(records: Sequence[Record], path: str | Path, *, prompt_field: str = "prompt",
                         label_field: str = "label") -> list[PromptExample]:
    """Prompt-only records; the label (any scalar, kept as a string) is optional."""
    out = []
    for rec in records:
        label = rec.data.get(label_field)
        out.append(PromptExample(_prompt(rec, prompt_field, path), None if label is None else str(label), rec.line))
    return out


def labels_present(labels: Sequence[Any], lines: Sequence[int], path: str | Path, label_field: str) -> bool:
    """True when every item has a label, False when none has; a mix is a :class:`DataError` naming the file, the
    first line without one and the field (half-labelled data would make accuracy mean something else)."""
    missing = [line for label, line in zip(labels, lines) if label is None]
    if missing and len(missing) < len(labels):
        raise DataError(path, missing[0], f"missing, while {len(labels) - len(missing)} of the {len(labels)} items "
                        "have one: label every eval item (exact-match accuracy) or none (the guards then judge "
                        "the held-out reward or guards.metric_command)", label_field)
    return not missing


def read_completion_examples(records: Sequence[Record], path: str | Path, *, prompt_field: str = "prompt",
                             completion_field: str = "completion") -> list[CompletionExample]:
    """Prompt-completion records (a ``messages`` chat is SFT's own path: :func:`tokenize_messages`)."""
    out = []
    for rec in records:
        prompt = _prompt(rec, prompt_field, path)
        out.append(CompletionExample(prompt, _answer(rec, completion_field, prompt, path), rec.line))
    return out


def implicit_prompt(chosen: Text, rejected: Text, path: str | Path, line: int,
                    fields: tuple[str, str] = ("chosen", "rejected")) -> tuple[Text, Text, Text]:
    """``(prompt, chosen answer, rejected answer)`` of an implicit-prompt pair.

    Conversational: the prompt is every message but the last, identical in both, and each last
    message is the assistant's answer. Standard: the longest common prefix, cut back to its last
    whitespace so no word is split (as TRL's ``extract_prompt``). An error when there is none.
    """
    if is_conversational(chosen) != is_conversational(rejected):
        raise DataError(path, line, f"'{fields[0]}' and '{fields[1]}' must both be strings or both be message lists",
                        fields[1])
    if is_conversational(chosen):
        for value, name in ((chosen, fields[0]), (rejected, fields[1])):
            if len(value) < 2 or value[-1]["role"] != "assistant":
                raise DataError(path, line, "implicit prompt: expected the prompt's messages, then one assistant "
                                            "answer last", name)
        if chosen[:-1] != rejected[:-1]:
            raise DataError(path, line, f"implicit prompt: '{fields[0]}' and '{fields[1]}' have different prompts "
                                        "(every message but the last must be identical)", fields[1])
        return chosen[:-1], chosen[-1:], rejected[-1:]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    prefix = chosen[:n]
    cut = max(prefix.rfind(" "), prefix.rfind("\n")) + 1
    if not prefix[:cut].strip():
        raise DataError(path, line, f"implicit prompt: '{fields[0]}' and '{fields[1]}' share no prompt prefix "
                                    "ending at whitespace (give an explicit prompt field)", fields[0])
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _margin(rec: Record, field: str, path: str | Path) -> float | None:
    value = rec.data.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(rec.where(path), rec.line, f"must be a number, got {type(value).__name__}", field)
    try:
        margin = float(value)
    except OverflowError:  # an integer past float range
        margin = math.inf
    if not math.isfinite(margin):
        raise DataError(rec.where(path), rec.line, "must be a finite number", field)
    return margin


def _pair(rec: Record, path: str | Path, prompt_field: str, chosen_field: str,
          rejected_field: str) -> tuple[Text, Text, Text]:
    """``(prompt, chosen, rejected)`` of one preference record, its prompt explicit or implicit."""
    if prompt_field in rec.data:
        prompt = _prompt(rec, prompt_field, path)
        chosen, rejected = _answer(rec, chosen_field, prompt, path), _answer(rec, rejected_field, prompt, path)
    else:
        prompt, chosen, rejected = implicit_prompt(_text(rec, chosen_field, path), _text(rec, rejected_field, path),
                                                   rec.where(path), rec.line, (chosen_field, rejected_field))
    if chosen == rejected:
        raise DataError(rec.where(path), rec.line, f"'{chosen_field}' equals '{rejected_field}'", rejected_field)
    return prompt, chosen, rejected


def read_pair_examples(records: Sequence[Record], path: str | Path, *, prompt_field: str = "prompt",
                       chosen_field: str = "chosen", rejected_field: str = "rejected",
                       margin_field: str = "margin") -> list[PairExample]:
    """Preference records with an explicit prompt field, or without one (implicit prompt)."""
    return [PairExample(*_pair(rec, path, prompt_field, chosen_field, rejected_field),
                        _margin(rec, margin_field, path), rec.line) for rec in records]


def read_unpaired_examples(records: Sequence[Record], path: str | Path, *, prompt_field: str = "prompt",
                           completion_field: str = "completion", desirable_field: str = "desirable",
                           chosen_field: str = "chosen", rejected_field: str = "rejected") -> list[UnpairedExample]:
    """KTO records: unpaired (boolean ``desirable_field``), or preference pairs split in two (as
    TRL's ``unpair_preference_dataset``)."""
    out: list[UnpairedExample] = []
    for rec in records:
        if chosen_field in rec.data and rejected_field in rec.data:
            prompt, chosen, rejected = _pair(rec, path, prompt_field, chosen_field, rejected_field)
            out += [UnpairedExample(prompt, chosen, True, rec.line), UnpairedExample(prompt, rejected, False, rec.line)]
            continue
        prompt = _prompt(rec, prompt_field, path)
        completion = _answer(rec, completion_field, prompt, path)
        if desirable_field not in rec.data:
            raise DataError(rec.where(path), rec.line, f"missing (or give {chosen_field}/{rejected_field} pairs)", desirable_field)
        flag = rec.data[desirable_field]
        if not isinstance(flag, bool):
            raise DataError(rec.where(path), rec.line, f"must be true or false, got {flag!r}", desirable_field)
        out.append(UnpairedExample(prompt, completion, flag, rec.line))
    return out


# --------------------------------------------------------------------------------------
# Rendering for one tokenizer
# --------------------------------------------------------------------------------------


def prompt_text(tokenizer: Any, prompt: Text) -> str:
    """What the model reads before its answer: standard text as it is; a conversation rendered
    with the chat template and the generation prompt (``<|assistant|>``-style header) appended."""
    return render_chat(tokenizer, prompt, True) if is_conversational(prompt) else prompt


def completion_text(tokenizer: Any, prompt: Text, completion: Text) -> str:
    """The answer as the model writes it after :func:`prompt_text`: standard text as it is; for a
    conversation, the rendered chat of prompt + answer minus the rendered prompt (so the template's
    end-of-turn markers are part of the answer and carry loss), ending at the eos token where the
    turn holds one."""
    if not is_conversational(prompt):
        return completion
    head = prompt_text(tokenizer, prompt)
    full = render_chat(tokenizer, list(prompt) + list(completion), False)
    if not full.startswith(head):
        raise ValueError("chat template is not prefix-stable: the rendered prompt with its generation prompt is "
                         "not a prefix of the rendered conversation")
    answer = full[len(head):]
    # Generation stops at eos, so what a template puts after it (ChatML's and the plain template's
    # newline) is never written by the model; a reward model trained on it would read its score at a
    # token that rollouts never reach.
    eos = getattr(tokenizer, "eos_token", None)
    end = answer.rfind(eos) if eos else -1
    return answer[:end + len(eos)] if end >= 0 else answer
