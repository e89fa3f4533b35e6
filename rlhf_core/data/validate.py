"""The Great Expectations gate: every dataset is validated before a stage consumes it.

``validate_dataset(path, kind)`` reads the file (a broken line fails here, naming file and
line), builds a pandas frame whose index is the source line, runs a GX expectation suite
for the dataset kind, and returns a report. ``ValidationFailed`` carries the report: which
expectation failed, on which field, with example rows as ``file:line``.

Suites (one per kind; field names follow the stage config, so renamed fields work):

* ``sft``: prompt and completion present, strings, non-blank, within length bounds, the
  pair unique — or, for chat data, a well-formed ``messages`` list with an assistant turn;
* ``preference``: prompt, chosen, rejected present, strings, non-blank, bounded; chosen
  differs from rejected; no duplicate triple; optional ``margin`` a finite number;
* ``prompts``: prompt present, string, non-blank, bounded, unique; label present and a
  string or finite number.

Checks on values GX has no built-in for (a value's Python type, "finite number", a chat's
structure) are computed into helper columns named ``<field>__<check>`` and validated with
``ExpectColumnValuesToBeInSet``, so all failures come out of one GX report. GX's SQL-backed
custom expectations do not run on pandas, hence helper columns rather than custom classes.

A failure quotes up to three offending rows (:func:`excerpt`): secrets redacted, each value
clipped to ``VALUE_CHARS`` and each excerpt to ``EXCERPT_CHARS`` characters, since the report is
logged to MLflow and a bad row may be huge or carry a credential.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlhf_core.config import DataFields
from rlhf_core.data.io import read_records
from rlhf_core.redact import redact_secrets

Kind = Literal["sft", "preference", "prompts"]
KINDS: tuple[str, ...] = ("sft", "preference", "prompts")
MAX_CHARS = 20000
N_EXAMPLES = 5
VALUE_CHARS = 60
"""Each field value in a failure excerpt is clipped to this many characters ..."""
EXCERPT_CHARS = 200
"""... and each whole excerpt (one row's fields) to this many."""


@dataclass
class Failure:
    """One failed expectation: its GX type, the field it checks, and offending lines."""

    expectation: str
    field: str
    message: str
    unexpected_count: int
    lines: list[int]
    examples: list[str]

    def render(self, path: str) -> str:
        where = ", ".join(f"{path}:{ln}" for ln in self.lines[:N_EXAMPLES])
        more = f" (+{self.unexpected_count - N_EXAMPLES} more)" if self.unexpected_count > N_EXAMPLES else ""
        head = f"{path}:{self.lines[0]}: field '{self.field}': {self.message}" if self.lines else \
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

    @property
    def success(self) -> bool:
        return not self.failures

    def render(self) -> str:
        if self.success:
            return f"{self.path}: valid {self.kind} dataset ({self.n_rows} rows, {self.n_expectations} expectations passed)"
        body = "\n".join(f.render(self.path) for f in self.failures)
        return f"{self.path}: INVALID {self.kind} dataset ({len(self.failures)} of {self.n_expectations} expectations failed)\n{body}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "n_rows": self.n_rows, "success": self.success,
                "n_expectations": self.n_expectations,
                "failures": [f.__dict__ for f in self.failures]}


class ValidationFailed(ValueError):
    """A dataset that failed its Great Expectations suite; ``.report`` has the details."""

    def __init__(self, report: ValidationReport):
        self.report = report
        super().__init__(report.render())


def excerpt(line: int, values: dict[str, Any]) -> str:
    """``line N: field='value', ...`` for a report: each value redacted, then clipped.

    Excerpts land in ``validation_report.json``, the MLflow run and the error on stderr, and a
    failing row is as likely as any to carry a credential (a URL with ``?token=``): redaction
    comes before clipping so a cut can never leave part of a secret behind.
    """
    shown = ", ".join(f"{k}={_clip(redact_secrets(str(v), k), VALUE_CHARS)!r}" for k, v in values.items())
    return _clip(f"line {line}: {shown}", EXCERPT_CHARS)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _type_name(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "missing"
    return type(value).__name__


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _chat_ok(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
             for m in value)
    return ok and any(m.get("role") == "assistant" for m in value)


# --------------------------------------------------------------------------------------
# Suites
# --------------------------------------------------------------------------------------


def _text_field_expectations(gx: Any, col: str, max_chars: int) -> list[tuple[Any, str, str]]:
    E = gx.expectations
    return [
        (E.ExpectColumnValuesToNotBeNull(column=col), col, "missing"),
        # "missing" is reported once, by the not-null expectation, not again as a wrong type.
        (E.ExpectColumnValuesToBeInSet(column=f"{col}__type", value_set=["str", "missing"]), col,
         "must be a string"),
        (E.ExpectColumnValuesToBeInSet(column=f"{col}__nonblank", value_set=[True]), col, "empty or blank string"),
        (E.ExpectColumnValueLengthsToBeBetween(column=col, min_value=1, max_value=max_chars), col,
         f"length outside [1, {max_chars}] characters"),
    ]


def _frame_and_suite(records: list, kind: str, fields: DataFields, max_chars: int, gx: Any):
    import pandas as pd

    E = gx.expectations
    rows: list[dict[str, Any]] = []
    chat = kind == "sft" and any(fields.messages_field in r.data for r in records)
    if kind == "sft" and chat:
        text_cols, key_cols = [], [fields.messages_field]
    elif kind == "sft":
        text_cols, key_cols = [fields.prompt_field, fields.completion_field], [fields.prompt_field, fields.completion_field]
    elif kind == "preference":
        text_cols = [fields.prompt_field, fields.chosen_field, fields.rejected_field]
        key_cols = list(text_cols)
    else:
        text_cols, key_cols = [fields.prompt_field], [fields.prompt_field]

    for r in records:
        row: dict[str, Any] = {}
        for col in text_cols:
            value = r.data.get(col)
            row[col] = value if isinstance(value, str) else (None if value is None else str(value))
            row[f"{col}__type"] = _type_name(value)
            row[f"{col}__nonblank"] = not isinstance(value, str) or bool(value.strip())
        if chat:
            value = r.data.get(fields.messages_field)
            row[fields.messages_field] = repr(value) if value is not None else None
            row[f"{fields.messages_field}__wellformed"] = _chat_ok(value)
        if kind == "preference":
            margin = r.data.get(fields.margin_field)
            row[f"{fields.margin_field}__finite"] = margin is None or _is_finite_number(margin)
        if kind == "prompts":
            label = r.data.get(fields.label_field)
            row[fields.label_field] = None if label is None else str(label)
            row[f"{fields.label_field}__type_ok"] = isinstance(label, str) and bool(label.strip()) or \
                _is_finite_number(label)
        rows.append(row)
    df = pd.DataFrame(rows, index=[r.line for r in records])

    suite: list[tuple[Any, str, str]] = []
    for col in text_cols:
        suite += _text_field_expectations(gx, col, max_chars)
    if chat:
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{fields.messages_field}__wellformed", value_set=[True]),
                      fields.messages_field, "must be a non-empty list of {role, content} with an assistant turn"))
    if kind == "preference":
        suite.append((E.ExpectSelectColumnValuesToBeUniqueWithinRecord(
            column_list=[fields.chosen_field, fields.rejected_field]), fields.chosen_field,
            f"'{fields.chosen_field}' equals '{fields.rejected_field}'"))
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{fields.margin_field}__finite", value_set=[True]),
                      fields.margin_field, "must be a finite number when present"))
    if kind == "prompts":
        suite.append((E.ExpectColumnValuesToNotBeNull(column=fields.label_field), fields.label_field, "missing"))
        suite.append((E.ExpectColumnValuesToBeInSet(column=f"{fields.label_field}__type_ok", value_set=[True]),
                      fields.label_field, "must be a non-blank string or a finite number"))
    if len(key_cols) == 1:
        suite.append((E.ExpectColumnValuesToBeUnique(column=key_cols[0]), key_cols[0], "duplicate rows"))
    else:
        suite.append((E.ExpectCompoundColumnsToBeUnique(column_list=key_cols), "+".join(key_cols), "duplicate rows"))
    return df, suite


def validate_dataset(path: str | Path, kind: str, fields: DataFields | None = None,
                     max_chars: int = MAX_CHARS) -> ValidationReport:
    """Validate ``path`` as a ``kind`` dataset with Great Expectations; never writes anything."""
    import great_expectations as gx

    # GX sets this module's logger to INFO itself; its temp-folder notice is noise on stderr.
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    fields = fields or DataFields()
    records = read_records(path)  # raises DataError naming file:line for unreadable lines
    report = ValidationReport(str(path), kind, len(records), 0)
    if not records:
        report.failures.append(Failure("table_not_empty", "*", "dataset has no rows", 0, [], []))
        report.n_expectations = 1
        return report
    df, suite_items = _frame_and_suite(records, kind, fields, max_chars, gx)

    context = gx.get_context(mode="ephemeral")
    # GX's per-metric progress bars would bury the report on stderr.
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas(name="alignflow")
    asset = source.add_dataframe_asset(name=kind)
    batch = asset.add_batch_definition_whole_dataframe("all").get_batch(batch_parameters={"dataframe": df})
    suite = gx.ExpectationSuite(name=f"alignflow-{kind}")
    for expectation, _, _ in suite_items:
        suite.add_expectation(expectation)
    result = batch.validate(suite, result_format={"result_format": "COMPLETE"})
    report.n_expectations = len(suite_items)

    for res, (_exp, col, msg) in zip(_ordered(result, suite), suite_items):
        if res.success:
            continue
        info = res.result or {}
        lines = [int(i) for i in info.get("unexpected_index_list") or []]
        lines = sorted(set(lines))
        count = int(info.get("unexpected_count") or len(lines))
        examples = [excerpt(ln, {k: df.at[ln, k] for k in df.columns if "__" not in k and k in col.split("+")})
                    for ln in lines[:3]]
        report.failures.append(Failure(res.expectation_config.type, col, msg, count, lines, examples))
    return report


def _ordered(result: Any, suite: Any) -> list[Any]:
    """Results in the suite's order, matched on expectation type and arguments."""
    def key(cfg: Any) -> tuple[str, str]:
        kwargs = {k: v for k, v in cfg.kwargs.items() if k in ("column", "column_list", "value_set")}
        return cfg.type, repr(sorted(kwargs.items()))

    by_key = {key(r.expectation_config): r for r in result.results}
    return [by_key[key(e.configuration)] for e in suite.expectations]


def check_dataset(path: str | Path, kind: str, fields: DataFields | None = None) -> ValidationReport:
    """Validate and raise ``ValidationFailed`` unless the dataset passes."""
    report = validate_dataset(path, kind, fields)
    if not report.success:
        raise ValidationFailed(report)
    return report
