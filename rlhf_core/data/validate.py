"""The Great Expectations gate: every dataset is validated before a stage consumes it.

``validate_dataset(path, kind)`` streams the file (a broken or over-long line fails, naming file
and line), detects the file's form, builds a pandas frame per chunk of records (one row per
record), runs a GX expectation suite for the kind and form on each, and returns one report for
the whole file (:mod:`rlhf_core.data.streaming`: memory follows the chunk, not the file). ``ValidationFailed`` carries
the report: which expectation failed, on which field, with example rows as ``file:line``.

Kinds (one per stage input; field names follow the stage config, so renamed fields work), each
in TRL's *standard* form (fields hold text) or *conversational* form (fields hold lists of
``{role, content}`` messages), as :mod:`rlhf_core.data.formats` reads them:

* ``sft`` (SFT, RAFT, distillation): prompt and completion; or a ``messages`` chat with an
  assistant turn;
* ``preference`` (DPO, reward model): prompt, chosen, rejected; or chosen and rejected alone
  (implicit prompt: their common prefix, which must exist; conversational: every message but
  the last, identical in both); chosen differs from rejected; optional ``margin`` a finite number;
* ``prompts`` (evaluation; RL and rejection sampling scored against the label): prompt, and a
  label that is a non-blank string or a finite number;
* ``prompt-only`` (TRL's prompt-only form, for RL and rejection sampling scored by a reward
  model): prompt, and a label only where given, then held to the ``prompts`` rule
  (:func:`prompts_kind` picks between the two);
* ``unpaired`` (desirable/undesirable examples): prompt, completion and a boolean ``desirable_field``
  (TRL's ``label``); or preference pairs in any ``preference`` form, which the unpaired loss splits in two.

Text fields are present, non-blank and within ``max_chars``; message lists are non-empty, each
message an object with a string ``content`` and a role in ``formats.ROLES``; a prompt
conversation does not end with an assistant turn, an answer is exactly one assistant message;
no duplicate examples (found across chunks from 16-byte digests of the key fields).

The form is the file's, not the row's: the first record that shows one (a string or a list in
the deciding field; a prompt field or none for preference pairs) sets it, and every row is held
to it, so a row in another form fails the type checks, naming its line and the line that set
the form. The standard-form suites are the expectations this gate always had.

Checks on values GX has no built-in for (a value's Python type, "finite number", a chat's
structure) are computed into helper columns named ``<field>__<check>`` and validated with
``ExpectColumnValuesToBeInSet``, so all failures come out of one GX report. GX's SQL-backed
custom expectations do not run on pandas, hence helper columns rather than custom classes.

A failure quotes up to three offending rows (:func:`excerpt`): secrets redacted, each value
clipped to ``VALUE_CHARS`` and each excerpt to ``EXCERPT_CHARS`` characters, since the report is
logged to MLflow and a bad row may be huge or carry a credential.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from itertools import chain
from typing import Any, Literal

from rlhf_core.config import DataFields
from rlhf_core.data.formats import ROLES, implicit_prompt, labels_present
from rlhf_core.data.io import DataError, Record, iter_records
from rlhf_core.data.streaming import CHUNK_ROWS, SeenRows, SuiteRunner, chunks
from rlhf_core.data.streaming import _ordered  # noqa: F401  (the data report runs its suite with it)
from rlhf_core.common.redact import redact_secrets

Kind = Literal["sft", "preference", "prompts", "prompt-only", "unpaired"]
KINDS: tuple[str, ...] = ("sft", "preference", "prompts", "prompt-only", "unpaired")
PROMPT_KINDS = ("prompts", "prompt-only")
"""Kinds of prompt files: the same fields and checks, but ``prompt-only`` lets a row go without a label."""
DESIRABLE_FIELD = "desirable"
"""The unpaired kind's boolean field unless the caller names another (the unpaired stage's ``desirable_field``)."""
MAX_CHARS = DataFields.max_field_chars
"""The default per-field limit in characters (a config's ``max_field_chars`` sets it)."""
MAX_LOCATIONS = 100
"""Offending rows listed per failed expectation (``lines``, ``locations``); ``unexpected_count`` counts all."""


def prompts_kind(needs_labels: bool) -> str:
    """The gate's kind for a prompt file: ``prompts`` when its consumer reads the labels (a reward
    function, the rule scorer, exact-match evaluation), ``prompt-only`` when it never does."""
    return "prompts" if needs_labels else "prompt-only"


def eval_kind(path: str | Path, label_field: str) -> str:
    """The gate's kind for a policy stage's eval file: ``prompts`` when every item has a label (exact-match
    accuracy), ``prompt-only`` when none has (the guards judge the held-out reward or a metric command); a mix is
    a :class:`DataError` naming the file, the first unlabelled line and the field."""
    labels: list[Any] = []
    lines: list[int] = []
    try:  # the labels alone are kept: an eval file may be large
        for r in iter_records(path):
            labels.append(r.data.get(label_field))
            lines.append(r.line)
    except DataError:  # unreadable: the validator's report says why
        return "prompts"
    return prompts_kind(labels_present(labels, lines, path, label_field))
N_EXAMPLES = 5
VALUE_CHARS = 60
"""Each field value in a failure excerpt is clipped to this many characters ..."""
EXCERPT_CHARS = 200
"""... and each whole excerpt (one row's fields) to this many."""


def require_eval_labels(path: str | Path, label_field: str, flow: str) -> None:
    """A :class:`DataError` naming the file and the field unless every eval item has a label: ``flow`` compares
    ``eval/accuracy`` across its stages or cycles, which unlabelled items cannot give."""
    if eval_kind(path, label_field) != "prompts":
        raise DataError(path, 0, f"no eval item has this field: the {flow} flow compares eval/accuracy (exact match) "
                        "across its models and needs a label on every eval item. For eval data without labels run "
                        "the policy stages themselves (the guarded stage commands), whose guards gate on "
                        "the held-out reward or guards.metric_command (README: Guards and the promotion gate)",
                        label_field)


@dataclass
class Failure:
    """One failed expectation: its GX type, the field it checks, and offending lines."""

    expectation: str
    field: str
    message: str
    unexpected_count: int
    lines: list[int]
    examples: list[str]
    locations: list[str] = field(default_factory=list)
    """``file:line`` of each offending row (the shard's file for a Hub-layout folder)."""

    def render(self, path: str) -> str:
        locations = self.locations or [f"{path}:{ln}" for ln in self.lines]
        where = ", ".join(locations[:N_EXAMPLES])
        more = f" (+{self.unexpected_count - N_EXAMPLES} more)" if self.unexpected_count > N_EXAMPLES else ""
        head = f"{locations[0]}: field '{self.field}': {self.message}" if locations else \
            f"{path}: field '{self.field}': {self.message}"
        lines = [head, f"    expectation {self.expectation} failed on {self.unexpected_count} row(s): {where}{more}"]
        lines += [f"    e.g. {ex}" for ex in self.examples[:3]]
        return "\n".join(lines)


@dataclass
class ValidationReport:
    """The outcome of one dataset's validation."""

    path: str
    kind: str
    n_rows: int
    n_expectations: int
    failures: list[Failure] = field(default_factory=list)
    form: str = "standard"
    """The file's form (:attr:`Form.name`); shown by :meth:`render`, not in :meth:`to_dict`, whose
    fields DVC's validate stage outputs keep."""

    @property
    def success(self) -> bool:
        return not self.failures

    def render(self) -> str:
        what = f"{self.kind} dataset, {self.form} form"
        if self.success:
            return f"{self.path}: valid {what} ({self.n_rows} rows, {self.n_expectations} expectations passed)"
        body = "\n".join(f.render(self.path) for f in self.failures)
        return f"{self.path}: INVALID {what} ({len(self.failures)} of {self.n_expectations} expectations failed)\n{body}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "n_rows": self.n_rows, "success": self.success,
                "n_expectations": self.n_expectations,
                "failures": [f.__dict__ for f in self.failures]}


class ValidationFailed(ValueError):
    """A dataset that failed its Great Expectations suite; ``.report`` has the details."""

    def __init__(self, report: ValidationReport):
        self.report = report
        super().__init__(report.render())


def excerpt(line: int | str, values: dict[str, Any], note: str | None = None) -> str:
    """``line N: field='value', ...`` for a report (``line`` a number, or a ``file:line`` location): each
    value redacted, then clipped; a ``note`` (which message of a list is bad) comes first, redacted too.

    Excerpts land in ``validation_report.json``, the MLflow run and the error on stderr, and a
    failing row is as likely as any to carry a credential (a URL with ``?token=``): redaction
    comes before clipping so a cut can never leave part of a secret behind.
    """
    shown = ", ".join(f"{k}=<missing>" if _type_name(v) == "missing" else
                      f"{k}={_clip(redact_secrets(str(v), k), VALUE_CHARS)!r}" for k, v in values.items())
    where = f"line {line}" if isinstance(line, int) else line
    if note:
        where = f"{where}: {redact_secrets(note)}"
    return _clip(f"{where}: {shown}", EXCERPT_CHARS)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --------------------------------------------------------------------------------------
# Forms
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Form:
    """How one file holds its examples, and the record that showed it."""

    conversational: bool = False
    """Fields hold lists of messages (TRL's conversational form), not text."""
    messages: bool = False
    """SFT's ``messages`` chat (one field holding the whole conversation)."""
    implicit: bool = False
    """Preference pairs without a prompt field: the prompt is what chosen and rejected share."""
    pairs: bool = False
    """An unpaired file holding preference pairs instead."""
    origin: str = ""
    """``line N`` (``file:N`` in a folder) of the record that set the form; empty if none did."""

    @property
    def name(self) -> str:
        if self.messages:
            return "conversational (messages)"
        name = "conversational" if self.conversational else "standard"
        name += ", implicit prompt" if self.implicit else ""
        return name + (", preference pairs" if self.pairs else "")

    @property
    def note(self) -> str:
        """Appended to a type failure: which form the row breaks, and where that form came from."""
        return f" (the file's {self.name} form, set by {self.origin})" if self.origin else ""


def _record_form(data: Any, kind: str, fields: DataFields) -> Form | None:
    """The form one record shows, or ``None`` when its deciding field is neither text nor a list.

    The rules are the readers' (:mod:`rlhf_core.data.formats`): a ``messages`` field makes an SFT
    chat; an unpaired record with both chosen and rejected is a pair; a pair without a prompt
    field has an implicit prompt; the prompt (chosen, when implicit) decides text or messages."""
    if kind == "sft" and fields.messages_field in data:
        return Form(conversational=True, messages=True)
    pairs = kind == "preference" or (kind == "unpaired" and fields.chosen_field in data
                                     and fields.rejected_field in data)
    implicit = pairs and fields.prompt_field not in data
    value = data.get(fields.chosen_field if implicit else fields.prompt_field)
    if not isinstance(value, (str, list)):
        return None
    return Form(conversational=isinstance(value, list), implicit=implicit, pairs=pairs and kind == "unpaired")


def detect_form(records: Iterable[Record], kind: str, fields: DataFields) -> Form:
    """The form of the first record that shows one (standard when none does)."""
    for rec in records:
        form = _record_form(rec.data, kind, fields)
        if form is not None:
            origin = f"line {rec.line}" if rec.source is None else f"{rec.source}:{rec.line}"
            return Form(form.conversational, form.messages, form.implicit, form.pairs, origin)
    return Form()


def _columns(kind: str, form: Form, f: DataFields) -> list[tuple[str, str]]:
    """``(field, role)`` of each text or messages field: role ``text`` (standard form) or, for a
    message list, ``prompt`` / ``answer`` / ``chat`` / ``implicit`` (what its turns must be)."""
    if form.messages:
        return [(f.messages_field, "chat")]
    if kind in PROMPT_KINDS:
        names, roles = [f.prompt_field], ["prompt"]
    elif kind == "sft" or (kind == "unpaired" and not form.pairs):
        names, roles = [f.prompt_field, f.completion_field], ["prompt", "answer"]
    elif form.implicit:
        names, roles = [f.chosen_field, f.rejected_field], ["implicit", "implicit"]
    else:
        names, roles = [f.prompt_field, f.chosen_field, f.rejected_field], ["prompt", "answer", "answer"]
    return list(zip(names, roles if form.conversational else ["text"] * len(names)))


# --------------------------------------------------------------------------------------
# Helper columns: one value per row and check
# --------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "missing"
    return type(value).__name__


def _is_finite_number(value: Any) -> bool:
    """A number (not a bool) that is finite as a float: NaN, infinities and integers past float range
    (``10**400``, which the readers could not turn into a float) are not."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _well_formed(value: Any) -> bool:
    """A non-empty list of objects, each with a string ``content`` (roles are checked apart)."""
    return bool(value) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)


def _turns_ok(value: list, role: str) -> bool:
    """What the turns of a message list must be, by the field's role."""
    last = value[-1]["role"] if value else None
    if role == "prompt":
        return last != "assistant"
    if role == "answer":
        return len(value) == 1 and last == "assistant"
    if role == "implicit":
        return len(value) >= 2 and last == "assistant"
    return any(m["role"] == "assistant" for m in value)  # chat: something to train on


def _first_bad_message(col: str, value: list) -> str | None:
    """``messages[1].role='asistant'``: the first message that breaks the message checks, or None."""
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"{col}[{i}] is {_type_name(m)}, not an object"
        if m.get("role") not in ROLES:
            return f"{col}[{i}].role={_clip(repr(m.get('role')), VALUE_CHARS)}"
        if not isinstance(m.get("content"), str):
            return f"{col}[{i}].content is {_type_name(m.get('content'))}, not a string"
    return None


def _message_cells(col: str, role: str, value: Any) -> dict[str, Any]:
    """The frame cells of one message-list field. A check that cannot apply (not a list; roles
    unknown) passes, so each bad value is reported once, by the check that names its fault. The
    ``__detail`` cell names the first bad message; a failure's excerpt shows it."""
    is_list = isinstance(value, list)
    dicts = is_list and all(isinstance(m, dict) for m in value)
    roles_ok = not dicts or all(m.get("role") in ROLES for m in value)
    return {
        f"{col}__detail": _first_bad_message(col, value) if is_list else None,
        col: None if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False, default=str),
        f"{col}__type": _type_name(value),
        f"{col}__messages": not is_list or _well_formed(value),
        f"{col}__roles": roles_ok,
        f"{col}__turns": not (dicts and roles_ok and value) or _turns_ok(value, role),
        f"{col}__chars": sum(len(m["content"]) for m in value if isinstance(m.get("content"), str)) if dicts else 0,
    }


def _text_cells(col: str, value: Any) -> dict[str, Any]:
    return {col: value if isinstance(value, str) else (None if value is None else str(value)),
            f"{col}__type": _type_name(value),
            f"{col}__nonblank": not isinstance(value, str) or bool(value.strip())}


def _has_implicit_prompt(data: Any, f: DataFields, conversational: bool) -> bool:
    """Whether chosen and rejected share the prompt the reader would cut (True where it cannot
    tell: a field missing, of the wrong type or malformed is reported by its own checks)."""
    chosen, rejected = data.get(f.chosen_field), data.get(f.rejected_field)
    if conversational:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            return True
        return not (_well_formed(chosen) and _well_formed(rejected)) or chosen[:-1] == rejected[:-1]
    if not (isinstance(chosen, str) and isinstance(rejected, str) and chosen.strip() and rejected.strip()):
        return True
    try:  # the reader's own rule: the common prefix, cut back to a whitespace
        implicit_prompt(chosen, rejected, "", 0, (f.chosen_field, f.rejected_field))
    except DataError:
        return False
    return True


def _row(data: Any, kind: str, form: Form, f: DataFields, desirable_field: str) -> dict[str, Any]:
    """One frame row: the fields' values (text, or messages as JSON) and every helper column."""
    row: dict[str, Any] = {}
    for col, role in _columns(kind, form, f):
        value = data.get(col)
        row.update(_text_cells(col, value) if role == "text" else _message_cells(col, role, value))
    if kind == "preference" or form.pairs:
        margin = data.get(f.margin_field)
        row[f"{f.margin_field}__finite"] = margin is None or _is_finite_number(margin)
    if form.implicit:
        row[f"{f.prompt_field}__absent"] = f.prompt_field not in data
        row[f"{f.rejected_field}__same_prompt"] = _has_implicit_prompt(data, f, form.conversational)
    if kind in PROMPT_KINDS:
        label = data.get(f.label_field)
        row[f.label_field] = None if label is None else str(label)
        # prompt-only: an absent label passes here; a present one is held to the prompts kind's rule.
        row[f"{f.label_field}__type_ok"] = (label is None and kind == "prompt-only") or \
            isinstance(label, str) and bool(label.strip()) or _is_finite_number(label)
    if kind == "unpaired" and not form.pairs:
        flag = data.get(desirable_field)
        row[desirable_field] = None if flag is None else str(flag)
        row[f"{desirable_field}__bool"] = flag is None or isinstance(flag, bool)
    return row


# --------------------------------------------------------------------------------------
# Suites
# --------------------------------------------------------------------------------------

TURNS = {"prompt": "a prompt conversation must not end with an assistant turn",
         "answer": "must be exactly one assistant message",
         "chat": "needs an assistant turn to train on",
         "implicit": "must be the prompt's messages, then one assistant answer last (implicit prompt)"}
"""What a message list's ``__turns`` check asks, by the field's role."""


def _text_field_expectations(gx: Any, col: str, max_chars: int, note: str = "") -> list[tuple[Any, str, str]]:
    E = gx.expectations
    return [
        (E.ExpectColumnValuesToNotBeNull(column=col), col, "missing"),
        # "missing" is reported once, by the not-null expectation, not again as a wrong type.
        (E.ExpectColumnValuesToBeInSet(column=f"{col}__type", value_set=["str", "missing"]), col,
         "must be a string" + note),
        (E.ExpectColumnValuesToBeInSet(column=f"{col}__nonblank", value_set=[True]), col, "empty or blank string"),
        (E.ExpectColumnValueLengthsToBeBetween(column=col, min_value=1, max_value=max_chars), col,
         f"length outside [1, {max_chars}] characters"),
    ]


def _message_field_expectations(gx: Any, col: str, role: str, max_chars: int,
                                 note: str) -> list[tuple[Any, str, str]]:
    E = gx.expectations

    def check(name: str, message: str) -> tuple[Any, str, str]:
        return E.ExpectColumnValuesToBeInSet(column=f"{col}__{name}", value_set=[True]), col, message

    return [
        (E.ExpectColumnValuesToNotBeNull(column=col), col, "missing"),
        (E.ExpectColumnValuesToBeInSet(column=f"{col}__type", value_set=["list", "missing"]), col,
         "must be a list of {role, content} messages" + note),
        check("messages", "must be a non-empty list of messages, each an object with a string 'content'"),
        check("roles", f"every message needs a role, one of {', '.join(ROLES)}"),
        check("turns", TURNS[role]),
        (E.ExpectColumnValuesToBeBetween(column=f"{col}__chars", min_value=0, max_value=max_chars), col,
         f"messages' content longer than {max_chars} characters in total"),
    ]


def _suite(kind: str, form: Form, f: DataFields, desirable_field: str, max_chars: int,
           gx: Any) -> list[tuple[Any, str, str]]:
    """``(expectation, field, message)`` of every check of this kind and form, in report order.

    The standard forms' suites are the ones this gate always had (DVC tracks their reports)."""
    E = gx.expectations
    cols = _columns(kind, form, f)
    suite: list[tuple[Any, str, str]] = []
    for col, role in cols:
        suite += _text_field_expectations(gx, col, max_chars, form.note) if role == "text" else \
            _message_field_expectations(gx, col, role, max_chars, form.note)
    if form.implicit:
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{f.prompt_field}__absent", value_set=[True]),
                      f.prompt_field, (f"present, but {form.origin or 'the first row'} has none: give every row a "
                                       "prompt field or none (implicit prompt)")))
        what = "share no prompt prefix ending at whitespace" if not form.conversational else \
            "have different prompts (every message but the last must be identical)"
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{f.rejected_field}__same_prompt", value_set=[True]),
                      f.rejected_field, f"implicit prompt: '{f.chosen_field}' and '{f.rejected_field}' {what}"))
    if kind == "preference" or form.pairs:
        suite.append((E.ExpectSelectColumnValuesToBeUniqueWithinRecord(
            column_list=[f.chosen_field, f.rejected_field]), f.chosen_field,
            f"'{f.chosen_field}' equals '{f.rejected_field}'"))
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{f.margin_field}__finite", value_set=[True]),
                      f.margin_field, "must be a finite number when present"))
    if kind == "prompts":
        suite.append((E.ExpectColumnValuesToNotBeNull(column=f.label_field), f.label_field, "missing"))
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{f.label_field}__type_ok", value_set=[True]),
                      f.label_field, "must be a non-blank string or a finite number"))
    if kind == "prompt-only":
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{f.label_field}__type_ok", value_set=[True]),
                      f.label_field, "must be a non-blank string or a finite number when present"))
    if kind == "unpaired" and not form.pairs:
        # TRL's unpaired files call this field `label`, which is our prompts' answer field: say how to map it.
        hint = "" if desirable_field == "label" else " (a TRL file calls it 'label': set desirable_field=label)"
        suite.append((E.ExpectColumnValuesToNotBeNull(column=desirable_field), desirable_field, "missing" + hint))
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{desirable_field}__bool", value_set=[True]),
                      desirable_field, "must be true or false"))
    # Duplicates across the whole file, chunk by chunk: a helper column (see _frame), not GX's
    # uniqueness expectations, which see one frame only.
    keys = [col for col, _ in cols]
    suite.append((E.ExpectColumnValuesToBeInSet(column=_unique_column(keys), value_set=[True]), "+".join(keys),
                  "duplicate rows"))
    return suite


# --------------------------------------------------------------------------------------
# Running a suite, chunk by chunk
# --------------------------------------------------------------------------------------


def validate_dataset(path: str | Path, kind: str, fields: DataFields | None = None,
                     max_chars: int | None = None, *, desirable_field: str | None = None,
                     chunk_rows: int = CHUNK_ROWS) -> ValidationReport:
    """Validate ``path`` as a ``kind`` dataset with Great Expectations; never writes anything.

    The file is streamed: ``chunk_rows`` records at a time become one frame for the suite, and the
    failures are merged (:class:`_Tally`), so memory follows the chunk, not the file. Limits come from
    ``fields``: ``max_line_bytes`` (the reader) and ``max_field_chars`` (the suite, unless ``max_chars``
    is given). ``desirable_field`` (the unpaired kind's boolean) defaults to ``fields.desirable_field``
    when ``fields`` is the unpaired stage's config, else ``"desirable"``."""
    import great_expectations as gx  # lazy: great_expectations (light CLI start)

    # GX sets this module's logger to INFO itself; its temp-folder notice is noise on stderr.
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    fields = fields or DataFields()
    max_chars = fields.max_field_chars if max_chars is None else max_chars
    desirable_field = desirable_field or getattr(fields, "desirable_field", DESIRABLE_FIELD)
    # A broken line raises DataError naming file:line when the stream reaches it.
    form, records = _form_and_records(path, kind, fields, chunk_rows)
    report = ValidationReport(str(path), kind, 0, 0, form=form.name)
    suite_items = _suite(kind, form, fields, desirable_field, max_chars, gx)
    tallies = [_Tally() for _ in suite_items]
    runner, seen = None, SeenRows()
    for chunk in chunks(records, chunk_rows):
        runner = runner or SuiteRunner(gx, kind, suite_items)
        # The frame's index is the record's position: a folder's shards each count lines from 1.
        first = report.n_rows + 1
        df = _frame(chunk, first, kind, form, fields, desirable_field, seen)
        for tally, res, (_exp, col, _msg) in zip(tallies, runner.run(df), suite_items):
            if not res.success:
                tally.add(res, col, df, chunk, first, path)
        report.n_rows += len(chunk)
    if not report.n_rows:
        report.failures.append(Failure("table_not_empty", "*", "dataset has no rows", 0, [], []))
        report.n_expectations = 1
        return report
    report.n_expectations = len(suite_items)
    report.failures = [t.failure(col, msg) for t, (_exp, col, msg) in zip(tallies, suite_items) if t.failed]
    return report


def _form_and_records(path: str | Path, kind: str, fields: DataFields,
                      peek: int) -> tuple[Form, Iterator[Record]]:
    """The file's form and an iterator over all its records. Reads ahead until a record shows the form,
    holding at most ``peek`` records; past that (no form in the first ``peek``) a second pass looks on."""
    records = iter_records(path, fields.max_line_bytes)
    head: list[Record] = []
    for rec in records:
        head.append(rec)
        if _record_form(rec.data, kind, fields) is not None:
            return detect_form(head[-1:], kind, fields), chain(head, records)
        if len(head) >= peek:
            return detect_form(iter_records(path, fields.max_line_bytes), kind, fields), chain(head, records)
    return Form(), iter(head)


def _frame(chunk: Sequence[Record], first: int, kind: str, form: Form, f: DataFields, desirable_field: str,
           seen: SeenRows) -> Any:
    """One chunk's frame, indexed by position from ``first``: every row's cells and helper columns,
    with the duplicate check's ``__unique`` column filled from ``seen`` (every earlier chunk's keys)."""
    import pandas as pd  # lazy: pandas (light CLI start)

    rows = [_row(r.data, kind, form, f, desirable_field) for r in chunk]
    keys = [col for col, _ in _columns(kind, form, f)]
    unique = _unique_column(keys)
    for row, ok in zip(rows, seen.unique_flags([tuple(row[k] for k in keys) for row in rows])):
        row[unique] = ok
    return pd.DataFrame(rows, index=range(first, first + len(rows)))


def _unique_column(keys: Sequence[str]) -> str:
    """The helper column of the duplicate check over the key fields ``keys``."""
    return "+".join(keys) + "__unique"


@dataclass
class _Tally:
    """One expectation's failures merged over chunks: counts summed, the first offending rows kept."""

    failed: bool = False
    expectation: str = ""
    count: int = 0
    lines: list[int] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    def add(self, res: Any, col: str, df: Any, chunk: Sequence[Record], first: int, path: str | Path) -> None:
        """Fold in a failed GX result on ``df``, the frame of ``chunk`` (positions from ``first``)."""
        info = res.result or {}
        rows = sorted({int(i) for i in info.get("unexpected_index_list") or []})
        self.failed, self.expectation = True, res.expectation_config.type
        self.count += int(info.get("unexpected_count") or len(rows))
        rows = rows[:max(0, MAX_LOCATIONS - len(self.lines))]
        recs = [chunk[i - first] for i in rows]
        locations = [f"{r.where(path)}:{r.line}" for r in recs]
        shown = [k for k in df.columns if "__" not in k and k in col.split("+")]
        details = [f"{k}__detail" for k in shown if f"{k}__detail" in df.columns]
        for i, r, loc in list(zip(rows, recs, locations))[:max(0, 3 - len(self.examples))]:
            named = [df.at[i, d] for d in details if isinstance(df.at[i, d], str)]
            self.examples.append(excerpt(r.line if r.source is None else loc, {k: df.at[i, k] for k in shown},
                                         note=named[0] if named else None))
        self.lines += [r.line for r in recs]
        self.locations += locations

    def failure(self, col: str, msg: str) -> Failure:
        return Failure(self.expectation, col, msg, self.count, self.lines, self.examples, self.locations)


def check_dataset(path: str | Path, kind: str, fields: DataFields | None = None, *,
                  desirable_field: str | None = None) -> ValidationReport:
    """Validate and raise ``ValidationFailed`` unless the dataset passes."""
    report = validate_dataset(path, kind, fields, desirable_field=desirable_field)
    if not report.success:
        raise ValidationFailed(report)
    return report
