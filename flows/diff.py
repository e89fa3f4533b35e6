"""``alignflow diff A B``: what changed between two runs, differences first.

A and B are MLflow run ids (a flow's parent run, a cycle run, a stage run) or registered model
versions, ``models:/NAME/3``, ``models:/NAME@champion`` or ``NAME@champion``, each resolved to
the run that logged the version. Four sections are compared side by side:

- code: the ``git.commit`` and ``alignflow.version`` tags;
- data: every ``dvc.md5.<input>`` tag (and ``git.version_commit``, the commit that versioned a
  cycle's generated data);
- params: the logged params (an old flat name of an ``rl`` field, ``kl_coef``, compared as its new dotted name,
  ``kl.coef``, against a run that logged that: :func:`renamed_params`);
- metrics: the latest value of each metric with its standard error where one is logged (the
  metric whose name, with ``_stderr`` removed once, is this one's: ``eval/accuracy_stderr``
  for ``eval/accuracy``, ``eval/accuracy_stderr_sft`` for ``eval/accuracy_sft``), and B - A.

Each side's header also gives the ``runs:/`` address of the run dashboard (``dashboard.html``, one offline HTML
page: :mod:`rlhf_core.tracking.run_dashboard`) of the run, or of the RL stage runs below it (``dashboards`` in
``--json``).

A cycle run or a stage run logs few params of its own: the flow's config sits on its parent
run. So params and data tags are read from the run and every run above it (the run's own value
wins); the header names those parent runs. Metrics and code tags are the run's own.

The error of a difference. Two models evaluated on the same items are compared with the *paired*
standard error (issue 20): ``sd(d) / sqrt(n)`` over the per-item differences ``d_i`` (B's result on item i
minus A's; :func:`rlhf_core.promotion.guards.paired_delta`), not ``sqrt(se_A^2 + se_B^2)``, which treats the two
runs as independent and, on positively correlated results, overstates the error several times. The
per-item results are the ``guards/per_item.json`` every guarded policy stage run logs (the registry's guarded
stages, listed by ``alignflow diff --help``, and the cycles' stages: its eval items with the parent's and the trained model's correct and
reward). Each side's is found by one rule: the run itself when it logged one (a stage run, or the stage run
a model version was logged from), else the latest-started run below it that did (a cycle run: its stage
run; a flow run: its last guarded stage -- name a stage run to compare another). Then, in this order:

- both sides have per-item results on the same items (same ``eval_md5``, same prompts in the same order):
  A's trained-model results against B's;
- B was trained from A's model (B's ``guard.parent_md5`` is A's ``dvc.md5.output_model``, e.g. an sft run
  against the dpo or cycle run trained from it): B's file alone holds both sides, parent against child
  (and the other way round when A was trained from B's model);
- otherwise the error is unpaired, and the footnote says why (no per-item results, different items).

Paired, the diff adds ``per_item/accuracy`` and ``per_item/reward`` rows (means over the items, each with
its own error, and B - A with the paired error), and a logged ``eval/accuracy`` or ``cycle/accuracy`` gets
the paired error too when both sides' values are the per-item means (else it was measured on other items
or settings and keeps the unpaired error). Every error is labelled ``(paired)`` or ``(unpaired)`` in the
text, and ``delta_stderr_kind`` in ``--json`` (per row, and for the comparison with ``pairing``).

Run: ``alignflow diff RUN_A RUN_B [--all] [--json] [--exit-code] [--tracking-uri URI]``.
Exit codes: 0 printed (``--exit-code``: 1 when anything differs, as ``git diff --exit-code``);
2 a run, model version or alias that does not exist, or a store that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rlhf_core.config import RENAMED, TrackingConfig, load_config
from rlhf_core.config import stage_registry as registry
from rlhf_core.promotion.guards import mean_and_se, paired_delta, unpaired_se
from rlhf_core.tracking.mlflow_runs import resolve_tracking_uri
from rlhf_core.tracking.run_dashboard import DASHBOARD_TAG

SECTIONS = ("code", "data", "params", "metrics")
CODE_TAGS = ("git.commit", "alignflow.version")
DATA_TAG_PREFIX = "dvc.md5."
DATA_TAGS = ("git.version_commit",)
STATUS_ORDER = ("changed", "only_a", "only_b", "same")
STATUS_TITLES = {"changed": "changed", "only_a": "only in A", "only_b": "only in B", "same": "unchanged"}
MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/@]+))$")
BARE_ALIAS = re.compile(r"^(?P<name>[^/@:]+)@(?P<alias>[^/@]+)$")
PARENT_TAG = "mlflow.parentRunId"
PER_ITEM = "guards/per_item.json"
MODEL_TAG = "dvc.md5.output_model"
PARENT_MODEL_TAG = "guard.parent_md5"
PAIRED_METRICS = {"accuracy": ("eval/accuracy", "cycle/accuracy"), "reward": ()}
"""Logged metrics that are the per-item mean of each quantity: their B - A gets the paired error when both
sides' values equal the per-item means (else the logged value was measured on other items or settings)."""
SEARCH_DEPTH = 3  # flow run -> cycle run -> stage run
MAX_SHOWN = 60  # characters of a value in the text view; --json carries the full value


class DiffError(Exception):
    """What the user named cannot be compared: unknown run / version / alias, unreadable store."""


@dataclass
class RunView:
    """One side of a diff: the run's params, tags and metrics as logged, and where they came from."""

    ref: str
    run_id: str
    run_name: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float]
    model_version: str | None = None
    inherited_from: list[str] = field(default_factory=list)
    per_item_run: str | None = None  # the run whose guards/per_item.json this side's per-item results came from
    dashboards: list[str] = field(default_factory=list)  # runs:/ URIs of the RL run dashboards at or below the run


@dataclass
class Row:
    """One compared value. For metrics, ``a``/``b`` are floats and the error fields may be set."""

    section: str
    key: str
    status: str
    a: Any = None
    b: Any = None
    a_stderr: float | None = None
    b_stderr: float | None = None
    delta: float | None = None
    delta_stderr: float | None = None  # see delta_stderr_kind and the module docstring
    delta_stderr_kind: str | None = None  # "paired": sd(d) / sqrt(n) over per-item d; "unpaired": sqrt(se_a^2 + se_b^2)


# --------------------------------------------------------------------------------------
# Comparison (pure: dicts in, rows out)
# --------------------------------------------------------------------------------------


def split_stderr(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """``(values, stderrs)``: a metric whose name minus its first ``_stderr`` is another logged metric
    is that metric's standard error, not a row of its own."""
    stderrs, error_keys = {}, set()
    for key, value in metrics.items():
        base = key.replace("_stderr", "", 1)
        if base != key and base in metrics:
            stderrs[base] = value
            error_keys.add(key)
    return {k: v for k, v in metrics.items() if k not in error_keys}, stderrs


def sections_of(params: dict[str, str], tags: dict[str, str]) -> dict[str, dict[str, str]]:
    """The code, data and params sections of one run (metrics are compared separately)."""
    code = {k: tags[k] for k in CODE_TAGS if k in tags}
    data = {k: v for k, v in tags.items() if k.startswith(DATA_TAG_PREFIX) or k in DATA_TAGS}
    return {"code": code, "data": data, "params": dict(params)}


def _status(a: Any, b: Any) -> str:
    if a is None:
        return "only_b"
    if b is None:
        return "only_a"
    return "same" if a == b else "changed"


def _metric_row(key: str, values: tuple[dict, dict], errors: tuple[dict, dict]) -> Row:
    a, b = values[0].get(key), values[1].get(key)
    row = Row("metrics", key, _status(a, b), a, b, errors[0].get(key), errors[1].get(key))
    if a is not None and b is not None:
        row.delta = b - a
        if row.a_stderr is not None and row.b_stderr is not None:
            row.delta_stderr = unpaired_se(row.a_stderr, row.b_stderr)
            row.delta_stderr_kind = "unpaired"
    return row


def renamed_params(a: dict[str, str], b: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Both runs' params in one spelling where they name one field two ways: a param logged under an old flat name of
    rl's (``kl_coef``, or ``rl.kl_coef`` under a flow's section prefix) takes its new dotted name
    (:data:`rlhf_core.config.RENAMED`: ``kl.coef``) when the other run logged that name and not the old one, so runs
    logged under either spelling compare row by row."""
    def mapped(own: dict[str, str], other: dict[str, str]) -> dict[str, str]:
        out = {}
        for key, value in own.items():
            prefix, _, name = key.rpartition(".") if key not in RENAMED else ("", "", key)
            new = f"{prefix}.{RENAMED[name]}" if prefix and name in RENAMED else RENAMED.get(key, key)
            out[new if new != key and new in other and key not in other else key] = value
        return out

    return mapped(a, b), mapped(b, a)


def compare(a: dict[str, dict], b: dict[str, dict]) -> list[Row]:
    """Rows for every code tag, data tag, param and metric of two runs, differences first.

    ``a`` and ``b`` each hold ``params``, ``tags`` (str -> str) and ``metrics`` (str -> float).
    Order: changed, only in A, only in B, unchanged; within each, by section then key."""
    rows = []
    sec_a, sec_b = sections_of(a["params"], a["tags"]), sections_of(b["params"], b["tags"])
    sec_a["params"], sec_b["params"] = renamed_params(sec_a["params"], sec_b["params"])
    for section in SECTIONS[:3]:
        for key in sorted(set(sec_a[section]) | set(sec_b[section])):
            va, vb = sec_a[section].get(key), sec_b[section].get(key)
            rows.append(Row(section, key, _status(va, vb), va, vb))
    (values_a, err_a), (values_b, err_b) = split_stderr(a["metrics"]), split_stderr(b["metrics"])
    for key in sorted(set(values_a) | set(values_b)):
        rows.append(_metric_row(key, (values_a, values_b), (err_a, err_b)))
    return sorted(rows, key=lambda r: (STATUS_ORDER.index(r.status), SECTIONS.index(r.section), r.key))


def has_differences(rows: list[Row]) -> bool:
    return any(r.status != "same" for r in rows)


# --------------------------------------------------------------------------------------
# Paired errors from per-item results (pure: dicts in, rows out)
# --------------------------------------------------------------------------------------


@dataclass
class ItemSource:
    """One side's per-item results: the run that logged ``guards/per_item.json`` (None: none found) and its
    content, the md5 of the side's model and of the model it was trained from (``guard.parent_md5``)."""

    run_id: str | None = None
    per_item: dict[str, Any] | None = None
    model_md5: str | None = None
    parent_md5: str | None = None


@dataclass
class Pairing:
    """How the two sides' per-item results were paired, or why they were not (``kind`` "unpaired").

    ``a`` and ``b``: quantity ("accuracy", "reward") -> ``(n,)`` per-item values of A's and B's model on the
    same items in the same order."""

    kind: str
    reason: str
    a: dict[str, list[float]] = field(default_factory=dict)
    b: dict[str, list[float]] = field(default_factory=dict)
    n: int = 0
    items_differ: bool = False  # both sides have per-item results, on different items: unpaired is right


def _column(items: list[dict[str, Any]], key: str) -> list[float] | None:
    values = [item.get(key) for item in items]
    return None if not values or any(v is None for v in values) else [float(v) for v in values]


def _pair(items: list[dict[str, Any]], a_prefix: str, b_prefix: str, reason: str) -> Pairing:
    """A pairing from one or two per-item lists: A's values from ``<a_prefix>_correct``/``_reward``, B's likewise."""
    pairing = Pairing("paired", reason, n=len(items))
    for quantity, suffix in (("accuracy", "correct"), ("reward", "reward")):
        a = _column(items, f"{a_prefix}_{suffix}")
        b = _column(items, f"{b_prefix}_{suffix}")
        if a is not None and b is not None:
            pairing.a[quantity], pairing.b[quantity] = a, b
    if not pairing.a:
        return Pairing("unpaired", reason + ", but its items carry no correctness or reward")
    return pairing


def _same_items(pa: dict[str, Any], pb: dict[str, Any]) -> str | None:
    """None when two per_item.json hold the same eval items in the same order, else why not."""
    if pa.get("eval_md5") != pb.get("eval_md5"):
        return f"the eval sets differ (eval_md5 {pa.get('eval_md5')} vs {pb.get('eval_md5')})"
    prompts_a, prompts_b = [i["prompt"] for i in pa["items"]], [i["prompt"] for i in pb["items"]]
    if prompts_a != prompts_b:
        return f"the runs answered different items of the eval set ({len(prompts_a)} vs {len(prompts_b)} items)"
    return None


def pair_items(a: ItemSource, b: ItemSource) -> Pairing:
    """Pair A's and B's per-item results, in this order of rules:

    1. both sides logged per-item results on the same items (same ``eval_md5``, same prompts in order):
       A's ``child_*`` against B's ``child_*``;
    2. B was trained from A's model (B's ``guard.parent_md5`` is A's model md5): B's own file holds both,
       ``parent_*`` (A's model) against ``child_*``; likewise A trained from B's model, with the sides swapped;
    3. otherwise unpaired, with the reason."""
    mismatch = None
    if a.per_item is not None and b.per_item is not None:
        mismatch = _same_items(a.per_item, b.per_item)
        if mismatch is None:
            items = [{"a_correct": x.get("child_correct"), "a_reward": x.get("child_reward"),
                      "b_correct": y.get("child_correct"), "b_reward": y.get("child_reward")}
                     for x, y in zip(a.per_item["items"], b.per_item["items"])]
            return _pair(items, "a", "b", f"per-item results of run {a.run_id} and run {b.run_id} on the same "
                                          f"{len(items)} eval items")
    if b.per_item is not None and b.parent_md5 and b.parent_md5 == a.model_md5:
        return _pair(b.per_item["items"], "parent", "child",
                     f"B was trained from A's model: run {b.run_id}'s per-item results hold both")
    if a.per_item is not None and a.parent_md5 and a.parent_md5 == b.model_md5:
        return _pair(a.per_item["items"], "child", "parent",
                     f"A was trained from B's model: run {a.run_id}'s per-item results hold both")
    if mismatch is not None:
        return Pairing("unpaired", mismatch, items_differ=True)
    missing = [label for label, src in (("A", a), ("B", b)) if src.per_item is None]
    return Pairing("unpaired", f"no per-item results ({PER_ITEM}) for {' and '.join(missing)}, and neither "
                               "model is the other's parent")


def apply_pairing(rows: list[Row], pairing: Pairing) -> list[Row]:
    """Add a ``per_item/<quantity>`` row per paired quantity (means, their errors, B - A with the paired error)
    and give the paired error to each logged metric of :data:`PAIRED_METRICS` whose A and B values are the
    per-item means. Returns the rows in :func:`compare`'s order."""
    if pairing.kind != "paired":
        return rows
    for quantity, a_values in pairing.a.items():
        b_values = pairing.b[quantity]
        (mean_a, se_a), (mean_b, se_b) = mean_and_se(a_values), mean_and_se(b_values)
        d = paired_delta(a_values, b_values)
        rows.append(Row("metrics", f"per_item/{quantity}", _status(mean_a, mean_b), mean_a, mean_b, se_a, se_b,
                        d.delta, d.se, "paired"))
        for row in rows:
            if (row.key in PAIRED_METRICS[quantity] and row.delta is not None
                    and abs(row.a - mean_a) <= 1e-9 and abs(row.b - mean_b) <= 1e-9):
                row.delta_stderr, row.delta_stderr_kind = d.se, "paired"
    return sorted(rows, key=lambda r: (STATUS_ORDER.index(r.status), SECTIONS.index(r.section), r.key))


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def _short(value: Any) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def _number(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if stderr is None else f"{value:.4g} ± {stderr:.2g}"


def _cells(row: Row) -> list[str]:
    if row.section != "metrics":
        return [row.section, row.key, _short(row.a), _short(row.b), ""]
    delta = ""
    if row.delta is not None and row.status == "changed":
        delta = f"{row.delta:+.4g}" + ("" if row.delta_stderr is None
                                        else f" ± {row.delta_stderr:.2g} ({row.delta_stderr_kind})")
    return [row.section, row.key, _number(row.a, row.a_stderr), _number(row.b, row.b_stderr), delta]


def _describe(label: str, view: RunView) -> str:
    line = f"{label}: run {view.run_id} ({view.run_name or 'unnamed'})"
    if view.model_version:
        line += f", model version {view.model_version}"
    if view.inherited_from:
        line += f"; params and data include parent run(s) {', '.join(view.inherited_from)}"
    if view.per_item_run and view.per_item_run != view.run_id:
        line += f"; per-item results from run {view.per_item_run} below it"
    for uri in view.dashboards:
        line += f"\n   run dashboard: {uri} (mlflow artifacts download -u {uri})"
    return line


def _error_notes(rows: list[Row], pairing: Pairing) -> list[str]:
    """What the ``± (paired)`` and ``± (unpaired)`` of the differences shown are, and why a difference is unpaired."""
    shown = {r.delta_stderr_kind for r in rows if r.delta_stderr is not None and r.status == "changed"}
    notes = []
    if "paired" in shown:
        notes.append(f"± (paired) = sd(d) / sqrt(n), d_i = B's result on eval item i minus A's (n = {pairing.n}): "
                     f"{pairing.reason}.")
    if "unpaired" not in shown:
        return notes
    note = "± (unpaired) = sqrt(se_A^2 + se_B^2)"
    note += "." if pairing.kind == "paired" else f"; no paired error: {pairing.reason}."
    eval_set = next((r for r in rows if r.section == "data" and r.key == "dvc.md5.eval"), None)
    if pairing.items_differ or (eval_set is not None and eval_set.status == "changed"):
        return notes + [note + " The eval items differ, so the unpaired error is the right one."]
    return notes + [note + " On the same eval items the right error is the paired one, from per-item results "
                           f"({PER_ITEM}); it is smaller whenever the two models' per-item results correlate "
                           "positively, as they usually do, so read this as an upper bound."]


def render(a: RunView, b: RunView, rows: list[Row], show_all: bool = False, pairing: Pairing | None = None) -> str:
    """The text report: A and B, then one block per status, differences first."""
    pairing = pairing or Pairing("unpaired", "per-item results not looked up")
    lines = [_describe("A", a), _describe("B", b), ""]
    shown = [r for r in rows if show_all or r.status != "same"]
    table = [_cells(r) for r in shown]
    widths = [max([len(c[i]) for c in table] + [0]) for i in range(5)]
    header = ["section", "key", "A", "B", "B - A"]
    widths = [max(w, len(h)) for w, h in zip(widths, header)]
    for status in STATUS_ORDER:
        block = [c for r, c in zip(shown, table) if r.status == status]
        if not block:
            continue
        lines.append(f"{STATUS_TITLES[status]} ({len(block)}):")
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        lines.extend("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in block)
        lines.append("")
    same = sum(r.status == "same" for r in rows)
    if not has_differences(rows):
        lines.append("no differences in code, data, params or metrics")
    if same and not show_all:
        lines.append(f"{same} unchanged rows not shown (--all shows them)")
    lines.extend(_error_notes(rows, pairing))
    return "\n".join(lines).rstrip() + "\n"


def _header(view: RunView) -> dict[str, Any]:
    return {k: v for k, v in asdict(view).items() if k not in ("params", "tags", "metrics")}


def to_json(a: RunView, b: RunView, rows: list[Row], pairing: Pairing | None = None) -> dict[str, Any]:
    """The whole comparison for scripts: both runs' headers, whether anything differs, how (and whether) the
    per-item results were paired, every row (each difference's error kind in ``delta_stderr_kind``)."""
    pairing = pairing or Pairing("unpaired", "per-item results not looked up")
    return {"a": _header(a), "b": _header(b),
            "different": has_differences(rows), "delta_stderr_kind": pairing.kind,
            "pairing": {"kind": pairing.kind, "reason": pairing.reason, "n": pairing.n},
            "rows": [asdict(r) for r in rows]}


# --------------------------------------------------------------------------------------
# Reading runs from MLflow
# --------------------------------------------------------------------------------------


def _not_found(exc: Exception) -> bool:
    return getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"


def _get_run(client: Any, run_id: str, ref: str) -> Any:
    from mlflow.exceptions import MlflowException  # lazy: mlflow (light `diff --help`)

    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        given = "" if ref == run_id else f" ({ref})"
        if _not_found(exc) or getattr(exc, "error_code", "") == "INVALID_PARAMETER_VALUE":
            raise DiffError(f"no run {run_id!r}{given} in the tracking store") from exc
        raise DiffError(f"cannot read run {run_id!r}{given}: {exc.message}") from exc


def resolve_ref(client: Any, ref: str) -> tuple[str, str | None]:
    """``(run_id, model version label or None)`` for a run id, ``models:/NAME/N``, ``models:/NAME@ALIAS``
    or ``NAME@ALIAS``."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow (light `diff --help`)

    match = MODEL_URI.match(ref) or BARE_ALIAS.match(ref)
    if match is None:
        return ref, None
    name, alias = match.group("name"), match.group("alias")
    version = match.groupdict().get("version")
    what = f"alias {alias!r} of registered model {name!r}" if alias else f"version {version} of registered model {name!r}"
    try:
        mv = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except MlflowException as exc:
        if _not_found(exc) or getattr(exc, "error_code", "") == "INVALID_PARAMETER_VALUE":
            raise DiffError(f"no {what} in the tracking store") from exc
        raise DiffError(f"cannot read {what}: {exc.message}") from exc
    if not mv.run_id:
        raise DiffError(f"{what} (version {mv.version}) has no source run to compare")
    return mv.run_id, f"{mv.name}/{mv.version}"


def load_view(client: Any, ref: str) -> RunView:
    """The run ``ref`` names, with params and data tags of the runs above it merged underneath its own."""
    run_id, version = resolve_ref(client, ref)
    run = _get_run(client, run_id, ref)
    params, tags = dict(run.data.params), dict(run.data.tags)
    inherited, seen = [], {run_id}
    parent_id = tags.get(PARENT_TAG)
    while parent_id and parent_id not in seen:  # `seen`: a hand-edited tag must not loop forever
        seen.add(parent_id)
        parent = _get_run(client, parent_id, f"parent of {run_id}")
        params = {**parent.data.params, **params}
        tags.update({k: v for k, v in parent.data.tags.items()
                     if (k.startswith(DATA_TAG_PREFIX) or k in DATA_TAGS) and k not in tags})
        inherited.append(parent_id)
        parent_id = parent.data.tags.get(PARENT_TAG)
    return RunView(ref, run_id, run.info.run_name or "", params, tags, dict(run.data.metrics), version, inherited)


def _has_per_item(client: Any, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException  # lazy: mlflow (light `diff --help`)

    try:
        return any(f.path == PER_ITEM for f in client.list_artifacts(run_id, PER_ITEM.rsplit("/", 1)[0]))
    except (MlflowException, OSError):  # an artifact store that cannot be listed: no per-item results
        return False


def _descendants(client: Any, run: Any) -> list[Any]:
    """The runs below ``run`` (children, theirs, ... down :data:`SEARCH_DEPTH` levels), latest started first."""
    found, level = [], [run.info.run_id]
    for _ in range(SEARCH_DEPTH):
        children = [child for parent_id in level for child in client.search_runs(
            [run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}'")]
        found.extend(children)
        level = [child.info.run_id for child in children]
    return sorted(found, key=lambda r: r.info.start_time or 0, reverse=True)


def dashboards_of(client: Any, run_id: str) -> list[str]:
    """``runs:/`` URIs of the run dashboards (:mod:`rlhf_core.tracking.run_dashboard`) of the run, else of the runs
    below it (a flow or cycle run: its RL stage runs), latest started first."""
    run = _get_run(client, run_id, run_id)
    found = [r for r in [run] if DASHBOARD_TAG in r.data.tags] or [
        r for r in _descendants(client, run) if DASHBOARD_TAG in r.data.tags]
    return [f"runs:/{r.info.run_id}/{r.data.tags[DASHBOARD_TAG]}" for r in found]


def guarded_stages() -> list[str]:
    """The stages whose runs log per-item results (``guards/per_item.json``): the registry's guarded stages."""
    return [stage.name for stage in registry.guarded()]


def item_source(client: Any, run_id: str) -> ItemSource:
    """Where the per-item results of the run ``run_id`` are: the run itself when it logged ``guards/per_item.json``
    (a run of a guarded stage, :func:`guarded_stages`), else the latest-started run below it that did (a cycle
    run's stage run; a flow run's last guarded stage -- name the stage run to compare another one). The model
    md5 is the run's own ``dvc.md5.output_model`` tag (stage and cycle runs set it), else that source run's."""
    run = _get_run(client, run_id, run_id)
    own_md5 = run.data.tags.get(MODEL_TAG)
    for candidate in [run] + _descendants(client, run):
        if not _has_per_item(client, candidate.info.run_id):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            per_item = json.loads(Path(client.download_artifacts(candidate.info.run_id, PER_ITEM, tmp)).read_text())
        return ItemSource(candidate.info.run_id, per_item, own_md5 or candidate.data.tags.get(MODEL_TAG),
                          candidate.data.tags.get(PARENT_MODEL_TAG))
    return ItemSource(None, None, own_md5, None)


def open_store(uri: str) -> Any:
    """An MlflowClient on ``uri``; a sqlite file that does not exist is an error, not a new empty store."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow (light `diff --help`)

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise DiffError(f"no MLflow store at {uri} (run from the project folder, or pass --tracking-uri)")
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignflow diff", description=__doc__.split("\n\n")[0],
                                epilog="A and B: run ids, models:/NAME/VERSION, models:/NAME@ALIAS or NAME@ALIAS. "
                                       "Per-item results come from the runs of the guarded stages: "
                                       + ", ".join(guarded_stages()) + ", and the cycles' stages.")
    p.add_argument("a", metavar="A", help="the earlier run (e.g. last night's cycle run, or NAME@champion)")
    p.add_argument("b", metavar="B", help="the later run (e.g. tonight's)")
    p.add_argument("--all", action="store_true", help="also list unchanged rows")
    p.add_argument("--json", action="store_true", help="print every row as JSON (for scripts)")
    p.add_argument("--exit-code", action="store_true", help="exit 1 when anything differs (as git diff)")
    p.add_argument("--tracking-uri", default=None,
                   help="the MLflow store (default: MLFLOW_TRACKING_URI, tracking.tracking_uri, <project>/mlflow.db)")
    p.add_argument("--params", default="params.yaml", help="params file whose tracking section names the store")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    uri = args.tracking_uri or resolve_tracking_uri(load_config(TrackingConfig, "tracking", args.params))
    try:
        client = open_store(uri)
        a, b = load_view(client, args.a), load_view(client, args.b)
        sources = item_source(client, a.run_id), item_source(client, b.run_id)
        a.dashboards, b.dashboards = dashboards_of(client, a.run_id), dashboards_of(client, b.run_id)
    except DiffError as exc:
        print(f"alignflow diff: {exc} (tracking store: {uri})", file=sys.stderr)
        return 2
    a.per_item_run, b.per_item_run = sources[0].run_id, sources[1].run_id
    pairing = pair_items(*sources)
    rows = apply_pairing(compare(asdict(a), asdict(b)), pairing)
    if args.json:
        print(json.dumps(to_json(a, b, rows, pairing), indent=2, default=str))
    else:
        print(render(a, b, rows, show_all=args.all, pairing=pairing), end="")
    return 1 if args.exit_code and has_differences(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
