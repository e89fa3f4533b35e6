"""``alignflow diff A B``: what changed between two runs, differences first.

A and B are MLflow run ids (a flow's parent run, a cycle run, a stage run) or registered model
versions, ``models:/NAME/3``, ``models:/NAME@champion`` or ``NAME@champion``, each resolved to
the run that logged the version. Four sections are compared side by side:

- code: the ``git.commit`` and ``alignflow.version`` tags;
- data: every ``dvc.md5.<input>`` tag (and ``git.version_commit``, the commit that versioned a
  cycle's generated data);
- params: the logged params;
- metrics: the latest value of each metric with its standard error where one is logged (the
  metric whose name, with ``_stderr`` removed once, is this one's: ``eval/accuracy_stderr``
  for ``eval/accuracy``, ``eval/accuracy_stderr_sft`` for ``eval/accuracy_sft``), and B - A.

A cycle run or a stage run logs few params of its own: the flow's config sits on its parent
run. So params and data tags are read from the run and every run above it (the run's own value
wins); the header names those parent runs. Metrics and code tags are the run's own.

The error of a difference. Two models evaluated on the same items are best compared with the
paired standard error, from each item's correct/incorrect under both models (issue 20); the
runs log only the accuracy, its standard error and a few sample rows (``eval_samples.json``),
not per-item results. So the error printed for B - A is the unpaired one,
``sqrt(se_A^2 + se_B^2)``, labelled ``unpaired``: exact for independent eval sets; on the same
items it overstates the paired error whenever the two models' per-item results correlate
positively, as they usually do. No paired error is printed, because none can be computed.

Run: ``alignflow diff RUN_A RUN_B [--all] [--json] [--exit-code] [--tracking-uri URI]``.
Exit codes: 0 printed (``--exit-code``: 1 when anything differs, as ``git diff --exit-code``);
2 a run, model version or alias that does not exist, or a store that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rlhf_core.config import TrackingConfig, load_config
from rlhf_core.tracking import resolve_tracking_uri

SECTIONS = ("code", "data", "params", "metrics")
CODE_TAGS = ("git.commit", "alignflow.version")
DATA_TAG_PREFIX = "dvc.md5."
DATA_TAGS = ("git.version_commit",)
STATUS_ORDER = ("changed", "only_a", "only_b", "same")
STATUS_TITLES = {"changed": "changed", "only_a": "only in A", "only_b": "only in B", "same": "unchanged"}
MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/@]+))$")
BARE_ALIAS = re.compile(r"^(?P<name>[^/@:]+)@(?P<alias>[^/@]+)$")
PARENT_TAG = "mlflow.parentRunId"
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
    delta_stderr: float | None = None  # unpaired: sqrt(se_a^2 + se_b^2); see the module docstring


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
            row.delta_stderr = math.sqrt(row.a_stderr ** 2 + row.b_stderr ** 2)
    return row


def compare(a: dict[str, dict], b: dict[str, dict]) -> list[Row]:
    """Rows for every code tag, data tag, param and metric of two runs, differences first.

    ``a`` and ``b`` each hold ``params``, ``tags`` (str -> str) and ``metrics`` (str -> float).
    Order: changed, only in A, only in B, unchanged; within each, by section then key."""
    rows = []
    sec_a, sec_b = sections_of(a["params"], a["tags"]), sections_of(b["params"], b["tags"])
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
        delta = f"{row.delta:+.4g}" + ("" if row.delta_stderr is None else f" ± {row.delta_stderr:.2g} (unpaired)")
    return [row.section, row.key, _number(row.a, row.a_stderr), _number(row.b, row.b_stderr), delta]


def _describe(label: str, view: RunView) -> str:
    line = f"{label}: run {view.run_id} ({view.run_name or 'unnamed'})"
    if view.model_version:
        line += f", model version {view.model_version}"
    if view.inherited_from:
        line += f"; params and data include parent run(s) {', '.join(view.inherited_from)}"
    return line


def _error_note(rows: list[Row]) -> str:
    """What the ``± (unpaired)`` of a difference is, given whether both runs used the same eval set."""
    eval_set = next((r for r in rows if r.section == "data" and r.key == "dvc.md5.eval"), None)
    note = "± (unpaired) = sqrt(se_A^2 + se_B^2). "
    if eval_set is not None and eval_set.status == "changed":
        return note + "The eval sets differ (dvc.md5.eval), so the unpaired error is the right one."
    return note + ("On the same eval items the right error is the paired one, from per-item results, which "
                   "these runs do not log; it is smaller whenever the two models' per-item results correlate "
                   "positively, as they usually do, so read this as an upper bound.")


def render(a: RunView, b: RunView, rows: list[Row], show_all: bool = False) -> str:
    """The text report: A and B, then one block per status, differences first."""
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
    if any(r.delta_stderr is not None and r.status == "changed" for r in rows):
        lines.append(_error_note(rows))
    return "\n".join(lines).rstrip() + "\n"


def _header(view: RunView) -> dict[str, Any]:
    return {k: v for k, v in asdict(view).items() if k not in ("params", "tags", "metrics")}


def to_json(a: RunView, b: RunView, rows: list[Row]) -> dict[str, Any]:
    """The whole comparison for scripts: both runs' headers, whether anything differs, every row."""
    return {"a": _header(a), "b": _header(b),
            "different": has_differences(rows), "delta_stderr_kind": "unpaired",
            "rows": [asdict(r) for r in rows]}


# --------------------------------------------------------------------------------------
# Reading runs from MLflow
# --------------------------------------------------------------------------------------


def _not_found(exc: Exception) -> bool:
    return getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"


def _get_run(client: Any, run_id: str, ref: str) -> Any:
    from mlflow.exceptions import MlflowException

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
    from mlflow.exceptions import MlflowException

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


def open_store(uri: str) -> Any:
    """An MlflowClient on ``uri``; a sqlite file that does not exist is an error, not a new empty store."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise DiffError(f"no MLflow store at {uri} (run from the project folder, or pass --tracking-uri)")
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignflow diff", description=__doc__.split("\n\n")[0],
                                epilog="A and B: run ids, models:/NAME/VERSION, models:/NAME@ALIAS or NAME@ALIAS.")
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
    except DiffError as exc:
        print(f"alignflow diff: {exc} (tracking store: {uri})", file=sys.stderr)
        return 2
    rows = compare(asdict(a), asdict(b))
    if args.json:
        print(json.dumps(to_json(a, b, rows), indent=2, default=str))
    else:
        print(render(a, b, rows, show_all=args.all), end="")
    return 1 if args.exit_code and has_differences(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
