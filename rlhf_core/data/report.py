"""The data report: near-duplicates, eval contamination, length and reward statistics and drift
of a dataset a flow trains on, as a Great Expectations validation rendered to HTML.

It runs after the gate (:mod:`rlhf_core.data.validate`), which refuses malformed rows and exact
duplicates; this report looks at the dataset as a whole:

* **contamination**: every prompt against the eval set, exact after normalisation and, for
  prompts of at least ``ngram`` words, by a shared word n-gram (any hit fails, naming its line);
* **near-duplicates**: duplicate-prompt rate, repeated chosen (SFT: completion) rate and the rate
  of rows equal to an earlier one after normalisation, each against its ``data_report`` threshold;
* **statistics**: character lengths of each text field (mean and 5/50/95% quantiles), the reward
  column's (``margin`` of pairs, ``score`` of kept samples) mean and quantiles;
* **drift**: given the previous cycle's statistics, each length mean must stay within
  ``max_mean_drift`` relative change of the previous one (the reward's mean is reported, not
  bounded: a cycle's policy is meant to raise it).

The pure checks are in :mod:`rlhf_core.data.quality`; here they become helper columns (one value
per row, as the gate does) checked with GX's own expectations: ``ExpectColumnValuesToBeInSet``
for per-row flags, ``ExpectColumnMeanToBeBetween`` for a rate (the mean of a 0/1 column) or a
bounded mean, ``ExpectColumnQuantileValuesToBeBetween`` for the distributions.

The HTML is GX's own data-docs rendering of that validation result
(``ValidationResultsPageRenderer`` + ``DefaultJinjaPageView``: what a data-docs site shows for a
validation), called directly: the data-docs *site builder* needs a file-backed context with
stores and a checkpoint run, while the gate runs in an ephemeral context and the page only has to
reach MLflow. GX's page loads its CSS and scripts from CDNs, unreachable offline: they are cut
(:func:`offline`), and a short alignflow summary (verdict, failures with file:line, statistics)
is put above the page.
"""

from __future__ import annotations

import html
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.config import DataFields, DataReportConfig
from rlhf_core.data import quality
from rlhf_core.data.formats import implicit_prompt
from rlhf_core.data.io import DataError, Record, read_records
from rlhf_core.data.validate import (
    KINDS,
    PROMPT_KINDS,
    Failure,
    Form,
    ValidationReport,
    _ordered,
    detect_form,
    excerpt,
)

REWARD_COLUMNS = ("score", "reward")
"""Numeric reward columns of SFT-kind data (rejection sampling's kept samples write ``score``)."""
QUANTILES = [0.05, 0.5, 0.95]


@dataclass
class DataReport(ValidationReport):
    """A :class:`ValidationReport` of the data report's suite, with its statistics and HTML page."""

    stats: dict[str, float] = field(default_factory=dict)
    """``data/<name>`` -> value: the rates, contamination counts and the means drift is checked on."""
    html: str = ""

    def render(self) -> str:
        if self.success:
            return (f"{self.path}: data report passed ({self.n_rows} rows, {self.n_expectations} expectations; "
                    + ", ".join(f"{k.removeprefix('data/')} {v:.4g}" for k, v in self.stats.items()
                                if k.endswith("_rate")) + ")")
        body = "\n".join(f.render(self.path) for f in self.failures)
        return (f"{self.path}: data report FAILED for the {self.kind} dataset "
                f"({len(self.failures)} of {self.n_expectations} expectations failed)\n{body}")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "stats": self.stats}


# --------------------------------------------------------------------------------------
# One row per example: its prompt, answer(s) and reward as text and numbers
# --------------------------------------------------------------------------------------


@dataclass
class Example:
    """What the report reads of one record."""

    texts: dict[str, str]
    """Field name -> text (messages joined), in order: the prompt first, then the answer(s)."""
    reward: float | None = None


def _example(data: Any, kind: str, form: Form, f: DataFields, reward_field: str | None) -> Example:
    """The prompt and answer texts of one record, by kind and form (as the readers see them)."""
    if form.messages:
        chat = data.get(f.messages_field) or []
        last = max((i for i, m in enumerate(chat) if isinstance(m, dict) and m.get("role") == "assistant"), default=0)
        texts = {f.prompt_field: quality.text_of(chat[:last]), f.completion_field: quality.text_of(chat[last:last + 1])}
    elif kind in PROMPT_KINDS:
        texts = {f.prompt_field: quality.text_of(data.get(f.prompt_field))}
    elif kind == "sft" or (kind == "unpaired" and not form.pairs):
        texts = {f.prompt_field: quality.text_of(data.get(f.prompt_field)),
                 f.completion_field: quality.text_of(data.get(f.completion_field))}
    elif form.implicit:
        try:
            prompt, chosen, rejected = implicit_prompt(data.get(f.chosen_field), data.get(f.rejected_field), "", 0,
                                                       (f.chosen_field, f.rejected_field))
        except DataError:  # the gate refuses such a row before the report runs
            prompt, chosen, rejected = "", data.get(f.chosen_field), data.get(f.rejected_field)
        texts = {f.prompt_field: quality.text_of(prompt), f.chosen_field: quality.text_of(chosen),
                 f.rejected_field: quality.text_of(rejected)}
    else:
        texts = {name: quality.text_of(data.get(name)) for name in (f.prompt_field, f.chosen_field, f.rejected_field)}
    value = data.get(reward_field) if reward_field else None
    reward = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return Example(texts, reward)


def _reward_field(records: Sequence[Record], kind: str, form: Form, f: DataFields) -> str | None:
    """The numeric column every record has: the pairs' margin, or a kept sample's score."""
    names = [f.margin_field] if kind == "preference" or form.pairs else list(REWARD_COLUMNS) if kind == "sft" else []
    for name in names:
        if all(isinstance(r.data.get(name), (int, float)) and not isinstance(r.data.get(name), bool)
               and math.isfinite(r.data.get(name)) for r in records):
            return name
    return None


# --------------------------------------------------------------------------------------
# The frame and the suite
# --------------------------------------------------------------------------------------


@dataclass
class Check:
    """One expectation of the report: what it checks, and the 0/1 column naming offending rows."""

    expectation: Any
    field: str
    message: str
    flags: str | None = None
    """A 0/1 helper column: its rows with 1 are the ones a failure names (file:line)."""
    repeats_of: str | None = None
    """For a repeat flag: the column holding the line each row repeats."""


def _frame(examples: list[Example], records: Sequence[Record], eval_index: quality.EvalIndex | None,
           prompt_field: str, answer_field: str | None, reward_field: str | None) -> Any:
    """The report's frame: lengths, reward, and a 0/1 column per row-level check."""
    import pandas as pd  # lazy: pandas (light CLI start)

    cols: dict[str, list[Any]] = {name: [ex.texts[name] for ex in examples] for name in examples[0].texts}
    for name in examples[0].texts:
        cols[f"{name}__chars"] = [float(len(ex.texts[name])) for ex in examples]
    if reward_field:
        cols[reward_field] = [ex.reward for ex in examples]
    prompts = [quality.normalize(ex.texts[prompt_field]) for ex in examples]
    keys = {f"{prompt_field}__repeat": prompts,
            "example__near_duplicate": [tuple(quality.normalize(t) for t in ex.texts.values()) for ex in examples]}
    if answer_field:
        keys[f"{answer_field}__repeat"] = [quality.normalize(ex.texts[answer_field]) for ex in examples]
    for name, values in keys.items():
        first: dict[Any, int] = {}
        for rec, key in zip(records, values):
            first.setdefault(key, rec.line)
        cols[name] = [float(flag) for flag in quality.repeats(values)]
        cols[f"{name}__of"] = [first[key] for key in values]
    if eval_index is not None:
        cols[f"{prompt_field}__in_eval"] = [float(eval_index.exact_match(ex.texts[prompt_field])) for ex in examples]
        cols[f"{prompt_field}__eval_ngram"] = [float(eval_index.ngram_overlap(ex.texts[prompt_field]))
                                               for ex in examples]
    return pd.DataFrame(cols, index=range(1, len(examples) + 1))


def _suite(df: Any, cfg: DataReportConfig, prompt_field: str, answer_field: str | None, reward_field: str | None,
           eval_file: str | None, previous: dict[str, float] | None, gx: Any) -> tuple[list[Check], dict[str, float]]:
    """The report's checks, and the statistics they are about (``data/...``)."""
    E = gx.expectations
    checks: list[Check] = []
    stats: dict[str, float] = {}
    if eval_file is not None:
        checks.append(Check(E.ExpectColumnValuesToBeInSet(column=f"{prompt_field}__in_eval", value_set=[0.0]),
                            prompt_field, f"eval contamination: found in the eval set {eval_file} "
                            "(exact match after normalisation)", f"{prompt_field}__in_eval"))
        checks.append(Check(E.ExpectColumnValuesToBeInSet(column=f"{prompt_field}__eval_ngram", value_set=[0.0]),
                            prompt_field, f"eval contamination: shares a {cfg.ngram}-word sequence with a prompt "
                            f"of the eval set {eval_file}", f"{prompt_field}__eval_ngram"))
        stats["data/eval_exact_matches"] = float(df[f"{prompt_field}__in_eval"].sum())
        stats["data/eval_ngram_overlaps"] = float(df[f"{prompt_field}__eval_ngram"].sum())
    rates = [(f"{prompt_field}__repeat", prompt_field, "duplicate_prompt_rate", cfg.max_duplicate_prompt_rate,
              "duplicate-prompt rate")]
    if answer_field:
        rates.append((f"{answer_field}__repeat", answer_field, "repeated_chosen_rate", cfg.max_repeated_chosen_rate,
                      f"repeated '{answer_field}' rate"))
    rates.append(("example__near_duplicate", "+".join(c for c in df.columns if "__" not in c and c != reward_field),
                  "near_duplicate_rate", cfg.max_near_duplicate_rate,
                  "near-duplicate rate (rows equal to an earlier row after normalising case, Unicode and whitespace)"))
    for column, fld, name, limit, what in rates:
        value = float(df[column].mean())
        stats[f"data/{name}"] = value
        checks.append(Check(E.ExpectColumnMeanToBeBetween(column=column, min_value=0.0, max_value=limit), fld,
                            f"{what} {value:.3f} is above data_report.max_{name}={limit}", column, f"{column}__of"))
    numeric = [c for c in df.columns if c.endswith("__chars")] + ([reward_field] if reward_field else [])
    for column in numeric:
        name = f"data/mean_{column.replace('__', '_')}"
        mean = stats[name] = float(df[column].mean())
        lo = hi = None
        message = f"mean {mean:.4g}"
        # Lengths only: a cycle's reward is meant to move (the policy improves), so its mean is reported, not bounded.
        if previous and name in previous and column.endswith("__chars"):
            lo, hi = quality.drift_bounds(previous[name], cfg.max_mean_drift)
            change = quality.relative_change(previous[name], mean)
            message = (f"drift: mean moved {previous[name]:.4g} -> {mean:.4g} against the previous cycle "
                       f"(relative change {change:.2f} above data_report.max_mean_drift={cfg.max_mean_drift})")
        checks.append(Check(E.ExpectColumnMeanToBeBetween(column=column, min_value=lo, max_value=hi),
                            column.split("__")[0], message))
        checks.append(Check(E.ExpectColumnQuantileValuesToBeBetween(
            column=column, quantile_ranges={"quantiles": QUANTILES, "value_ranges": [[None, None]] * len(QUANTILES)}),
            column.split("__")[0], "quantiles"))
    return checks, stats


# --------------------------------------------------------------------------------------
# Running and rendering
# --------------------------------------------------------------------------------------


def data_report(path: str | Path, kind: str, cfg: DataReportConfig | None = None, fields: DataFields | None = None,
                eval_file: str | Path | None = None, previous: dict[str, float] | None = None) -> DataReport:
    """The data report of a dataset that passed the gate; never writes anything.

    ``eval_file``: the eval set to test prompts against (``None``: no contamination check, as for
    the eval set itself). ``previous``: the previous cycle's :attr:`DataReport.stats`, for drift."""
    import great_expectations as gx  # lazy: great_expectations (light CLI start)

    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    cfg, fields = cfg or DataReportConfig(), fields or DataFields()
    records = read_records(path)
    report = DataReport(str(path), kind, len(records), 0)
    if not records:
        return report
    form = detect_form(records, kind, fields)
    report.form = form.name
    reward_field = _reward_field(records, kind, form, fields)
    examples = [_example(r.data, kind, form, fields, reward_field) for r in records]
    prompt_field = fields.prompt_field
    answer_field = next((n for n in examples[0].texts if n != prompt_field), None)
    eval_index = None
    if eval_file is not None and cfg.check_contamination:
        eval_index = quality.EvalIndex((quality.text_of(r.data.get(fields.prompt_field)) for r in read_records(eval_file)),
                                       cfg.ngram)
    df = _frame(examples, records, eval_index, prompt_field, answer_field, reward_field)
    checks, report.stats = _suite(df, cfg, prompt_field, answer_field, reward_field,
                                  str(eval_file) if eval_index is not None else None, previous, gx)
    report.n_expectations = len(checks)
    result, ordered = _validate(df, checks, kind, gx)
    for res, check in zip(ordered, checks):
        if not res.success:
            report.failures.append(_failure(check, df, records, path))
    report.html = render_html(report, result)
    return report


def _validate(df: Any, checks: list[Check], kind: str, gx: Any) -> tuple[Any, list[Any]]:
    """GX's validation result of the checks on ``df``, and its results in the checks' order."""
    from great_expectations.data_context.types.base import (  # lazy: great_expectations (light CLI start)
        ProgressBarsConfig)

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    asset = context.data_sources.add_pandas(name="alignflow").add_dataframe_asset(name=kind)
    batch = asset.add_batch_definition_whole_dataframe("all").get_batch(batch_parameters={"dataframe": df})
    suite = gx.ExpectationSuite(name=f"alignflow-data-report-{kind}")
    for check in checks:
        suite.add_expectation(check.expectation)
    result = batch.validate(suite, result_format={"result_format": "SUMMARY"})
    return result, _ordered(result, suite)


def _failure(check: Check, df: Any, records: Sequence[Record], path: str | Path) -> Failure:
    """A failed check naming its offending rows' file:line (a rate: the rows that repeat another)."""
    rows = [int(i) for i in df.index[df[check.flags] > 0]] if check.flags else []
    recs = [records[i - 1] for i in rows]
    shown = [c for c in check.field.split("+") if c in df.columns]
    examples = []
    for i, rec in list(zip(rows, recs))[:3]:
        values = {c: df.at[i, c] for c in shown}
        if check.repeats_of:
            values["repeats"] = f"line {df.at[i, check.repeats_of]}"
        examples.append(excerpt(rec.line if rec.source is None else f"{rec.where(path)}:{rec.line}", values))
    return Failure(check.expectation.configuration.type, check.field, check.message, len(rows) or 1,
                   [r.line for r in recs], examples, [f"{r.where(path)}:{r.line}" for r in recs])


def render_html(report: DataReport, result: Any) -> str:
    """GX's data-docs page of ``result``, under a short summary of ``report``."""
    import numpy as np  # lazy: numpy (light CLI start)
    from great_expectations.render.renderer import (  # lazy: great_expectations (light CLI start)
        ValidationResultsPageRenderer)
    from great_expectations.render.view import DefaultJinjaPageView  # lazy: great_expectations (light CLI start)

    for res in result.results:  # GX's num_to_str fails on numpy scalars (repr 'np.float64(...)')
        info = res.result or {}
        if isinstance(info.get("observed_value"), np.generic):
            info["observed_value"] = info["observed_value"].item()
    page = DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(result))
    verdict = "passed" if report.success else "FAILED"
    items = "".join(f"<li><pre>{html.escape(f.render(report.path))}</pre></li>" for f in report.failures)
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in report.stats.items())
    summary = (f'<section id="alignflow-data-report" style="font-family:sans-serif;margin:1em">'
               f"<h1>alignflow data report: {verdict}</h1>"
               f"<p>{html.escape(report.path)} ({report.kind} dataset, {html.escape(report.form)} form, "
               f"{report.n_rows} rows): {report.n_expectations - len(report.failures)} of "
               f"{report.n_expectations} expectations passed.</p>"
               + (f"<h2>Failures</h2><ul>{items}</ul>" if items else "")
               + f"<h2>Statistics</h2><table>{rows}</table></section>")
    page = offline(page)
    head, sep, tail = page.partition("<body>")
    return head + sep + summary + tail if sep else summary + page


# A tag is found from its ``<`` to the next ``<`` or ``>`` and only then searched for an external URL, so
# each character is scanned a bounded number of times: a tag body that may run to any ``>`` and backtrack
# for ``src=`` is quadratic on text like ``"<img " * 4000``. GX writes attribute values HTML-escaped, so
# a real tag holds no raw ``<``.
_TAG = re.compile(r"<(?:script[^<>]*+>\s*+</script>|(?:link|img)[^<>]*+>)")
_EXTERNAL_URL = re.compile(r'\s(?:href|src)="https?://[^"<>]*+"')


def _is_external(tag: str) -> bool:
    """Whether a ``<script>``, ``<link>`` or ``<img>`` tag loads a URL (scripts by ``src`` only)."""
    head = tag[:tag.index(">") + 1]
    url = _EXTERNAL_URL.search(head)
    return url is not None and (not tag.startswith("<script") or url.group().lstrip().startswith("src"))


STYLE = ("<style>body{font-family:sans-serif;margin:1em} table{border-collapse:collapse;margin:.5em 0} "
         "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}</style>")


def offline(page: str) -> str:
    """GX's page without its CDN scripts, stylesheets and images, plus a few lines of CSS.

    alignflow runs offline (README "Offline by default"): a browser opening the page (MLflow's
    artifact view) would wait on each unreachable CDN until it times out. The page's content is
    static HTML; the CDN parts only style it and add table filters."""
    page = _TAG.sub(lambda m: "" if _is_external(m.group()) else m.group(), page)
    return page.replace("</head>", STYLE + "</head>", 1)

