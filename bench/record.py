"""The benchmark record: every current figure table of README.md and BENCHMARKS.md, rendered from
committed result files, and the index of ``bench/results/``.

A table (``record_tables.TABLES``) names its result files, its header and its rows; a cell is a template
whose ``{alias:dotted.path|spec}`` fields read one value of a result file (see :func:`render_cell`). Each
table lives in its document between ``<!-- bench:begin NAME -->`` and ``<!-- bench:end NAME -->``,
followed by a line naming its result files, the commit that added each, the device and the settings that
differ. ``bench/results/INDEX.md`` lists every result file: device and date (its folder), what wrote it,
the commit that added it.

    python bench/record.py --check   # exit 1, with a diff, where a document or the index differs
    python bench/record.py --write   # rewrite the marked blocks and the index

Commits are recorded once, in the index: ``--write`` fills a new file's from ``git log`` (the commit that
added it; a file not yet committed gets ``uncommitted`` until the next ``--write`` after its commit), and
``--check`` reads them from the index only, so it gives the same answer in a shallow clone.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import record_tables_grpo  # noqa: E402
from record_tables import PRODUCERS, Table  # noqa: E402
from record_tables import TABLES as _OTHERS  # noqa: E402

TABLES = _OTHERS + record_tables_grpo.TABLES
from result_paths import RESULTS  # noqa: E402

INDEX = RESULTS / "INDEX.md"
LAYOUT = re.compile(r"^(?P<device>[a-z0-9]+)/(?P<day>\d{4}-\d\d-\d\d)/(?P<name>[^/]+)$")
FIELD = re.compile(r"\{(\w+:[^|{}]+)(?:\|([^{}]*))?\}")
BEGIN = "<!-- bench:begin {} -->"
END = "<!-- bench:end {} -->"
BLOCK = re.compile(r"<!-- bench:begin (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- bench:end (?P=name) -->", re.S)
UNCOMMITTED = "uncommitted"


class RecordError(Exception):
    """A table that cannot be rendered: a missing file or field, or a document without its markers."""


def lookup(data: object, path: str) -> object:
    """The value at a dotted path (``results.grpo.summary.rows.ours-fp32.median_step_s``): an integer
    segment indexes a list, ``*`` takes every item (a list of the rest of the path's values)."""
    value = data
    keys = path.split(".")
    for i, key in enumerate(keys):
        if key == "*":
            items = value.values() if isinstance(value, dict) else value
            rest = ".".join(keys[i + 1:])
            return [lookup(item, rest) if rest else item for item in items]  # type: ignore[union-attr]
        if isinstance(value, list):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            raise RecordError(f"no field {key!r} on the path {path!r}")
    return value


AGGREGATES = {"median": statistics.median, "min": min, "max": max, "len": len}


def format_value(value: object, spec: str) -> str:
    """``spec`` is steps joined by ``:`` ending in a Python format spec: ``median``, ``min``, ``max``,
    ``len`` of a list; ``range`` formats a two-item list as ``low–high`` with the rest of the spec;
    ``k`` divides by 1,000 and appends ``k``; ``/N`` and ``*N`` divide and multiply by the number N."""
    step, _, rest = spec.partition(":")
    if not rest:
        return format(value, spec)
    if step == "range":
        low, high = value  # type: ignore[misc]
        return f"{format_value(low, rest)}–{format_value(high, rest)}"
    if step in AGGREGATES:
        return format_value(AGGREGATES[step](value), rest)  # type: ignore[operator]
    if step == "k":
        return format_value(float(value) / 1000, rest) + "k"  # type: ignore[arg-type]
    if step[:1] in "/*" and step[1:]:
        n = float(step[1:])
        return format_value(float(value) / n if step[0] == "/" else float(value) * n, rest)  # type: ignore[arg-type]
    raise RecordError(f"unknown step {step!r} in the format {spec!r}")


def evaluate(expr: str, data: dict[str, object]) -> object:
    """``alias:path``, or two of them joined by `` - `` or `` ÷ `` (a difference or a ratio)."""
    for op in (" - ", " ÷ "):
        if op in expr:
            a, b = (evaluate(side.strip(), data) for side in expr.split(op, 1))
            return a - b if op == " - " else a / b  # type: ignore[operator]
    alias, _, path = expr.partition(":")
    if alias not in data:
        raise RecordError(f"no result file named {alias!r} in the table")
    return lookup(data[alias], path)


def render_cell(template: str, data: dict[str, object]) -> str:
    """A cell's text: each ``{EXPR|SPEC}`` replaced by :func:`evaluate`'s value formatted by
    :func:`format_value` (``{m:eval/accuracy|.3f}``, ``{r:summary.step_s|range:.2f}``)."""
    return FIELD.sub(lambda m: format_value(evaluate(m.group(1), data), m.group(2) or ""), template)


def load(path: str) -> object:
    """A result file's content: JSON, or JSON lines (a list)."""
    text = (REPO / path).read_text(encoding="utf-8")
    if path.endswith(".yaml"):
        return yaml.safe_load(text)
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def caption(table: Table, index: dict[str, dict], data: dict[str, object]) -> str:
    """The line under a table: its result files with their commits, the device, the differing settings."""
    files, metrics = [], []
    labelled = sum(p.startswith("bench/results/") for p in table.sources.values()) > 1
    for alias, path in table.sources.items():
        if path.startswith("bench/results/"):
            label = f"({alias}) " if labelled else ""
            files.append(f"{label}`{path}` (commit `{index.get(_rel(path), {}).get('commit', UNCOMMITTED)}`)")
        elif path.startswith("metrics/") and path.count("/") == 1:
            metrics.append(path.removeprefix("metrics/").removesuffix(".json"))
        else:
            files.append(f"`{path}`")
    if metrics:
        files.insert(0, f"`metrics/{{{','.join(metrics)}}}.json`")
    parts = [f"Rendered by `bench/record.py` from {', '.join(files)}", f"device: {render_cell(table.device, data)}"]
    if table.settings:
        parts.append(f"settings that differ: {render_cell(table.settings, data)}")
    return "; ".join(parts) + "."


def render_table(table: Table, index: dict[str, dict]) -> str:
    """The marked block's body: the table and its caption."""
    data = {alias: load(path) for alias, path in table.sources.items()}
    lines = ["| " + " | ".join(render_cell(cell, data) for cell in table.header) + " |",
             "| " + " | ".join("---" for _ in table.header) + " |"]
    for row in table.rows:
        if len(row) != len(table.header):
            raise RecordError(f"{table.name}: a row of {len(row)} cells under {len(table.header)} columns")
        lines.append("| " + " | ".join(render_cell(cell, data) for cell in row) + " |")
    return "\n".join(lines) + "\n\n" + caption(table, index, data) + "\n"


def render_document(text: str, doc: str, index: dict[str, dict]) -> str:
    """The document with each of its tables' blocks rendered anew; a table without markers is an error."""
    tables = [t for t in TABLES if t.doc == doc]
    found = [m.group("name") for m in BLOCK.finditer(text)]
    unknown = sorted(set(found) - {t.name for t in tables})
    if unknown:
        raise RecordError(f"{doc}: marked blocks no table renders: {', '.join(unknown)}")
    for table in tables:
        if found.count(table.name) != 1:
            raise RecordError(f"{doc}: {found.count(table.name)} blocks {BEGIN.format(table.name)}, not one")
        body = render_table(table, index)
        text = BLOCK.sub(lambda m, t=table, b=body: m.group(0) if m.group("name") != t.name
                         else f"{BEGIN.format(t.name)}\n{b}{END.format(t.name)}", text)
    return text


def _rel(path: str) -> str:
    return path.removeprefix("bench/results/")


def result_files() -> list[str]:
    """Every file and folder under ``bench/results/<device>/<day>/``, relative to ``bench/results`` (a folder
    of one run's files is one entry); anything elsewhere under ``bench/results`` comes back as it is, for
    :func:`render_index` to refuse."""
    entries = []
    for device in sorted(p for p in RESULTS.iterdir() if p.name != INDEX.name):
        days = sorted(device.iterdir()) if device.is_dir() else [device]
        for day in days:
            names = sorted(day.iterdir()) if day.is_dir() else [day]
            entries += [str(n.relative_to(RESULTS)) for n in names]
    return entries


def producer(name: str) -> str:
    """What wrote a result file, from the first rule of ``PRODUCERS`` its name starts with."""
    return next((what for prefix, what in PRODUCERS if name.startswith(prefix)), "by hand (notes of a session)")


def parse_index(text: str) -> dict[str, dict]:
    """The index's rows, by path relative to ``bench/results``."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = {"device": cells[1], "date": cells[2], "producer": cells[3],
                                         "commit": cells[4].strip("`")}
    return rows


def added_by(rel: str) -> str:
    """The commit that added a result file at its path, or ``uncommitted``. Renames are not followed: ``--follow``
    matches by content, so a new file much like an older one was credited to the older one's commit (files moved
    into the device/date layout keep the commits the index already holds)."""
    out = subprocess.run(["git", "log", "--no-renames", "--diff-filter=A", "--format=%H", "--",
                          f"bench/results/{rel}"],
                         cwd=REPO, capture_output=True, text=True).stdout.split()
    return out[-1][:10] if out else UNCOMMITTED


def render_index(old: dict[str, dict], fill_commits: bool) -> str:
    """INDEX.md from the tree: a row a result file; commits come from the old index (or ``git log``)."""
    lines = ["# Benchmark result files", "",
             "Generated by `python bench/record.py --write` from the tree: `bench/results/<device>/<date>/<file>`;",
             "the date is the day (UTC) a bench script wrote the file (`bench/result_paths.py`) or, for a file older",
             "than this layout, the day of the commit that added it. `--check` (run by",
             "`tests/unit/test_benchmark_record.py`) fails when a file is missing here, listed but gone, or outside",
             "that layout.", "",
             "| file | device | date | written by | commit that added it |", "| --- | --- | --- | --- | --- |"]
    for rel in result_files():
        m = LAYOUT.match(rel)
        if not m:
            raise RecordError(f"bench/results/{rel} is outside bench/results/<device>/<YYYY-MM-DD>/<file>")
        commit = old.get(rel, {}).get("commit", UNCOMMITTED)
        if commit == UNCOMMITTED and fill_commits:
            commit = added_by(rel)
        lines.append(f"| `{rel}` | {m['device']} | {m['day']} | {producer(m['name'])} | `{commit}` |")
    return "\n".join(lines) + "\n"


def renderings(write: bool) -> dict[Path, tuple[str, str]]:
    """Each generated file: (its text now, its rendering)."""
    index_now = INDEX.read_text(encoding="utf-8") if INDEX.exists() else ""
    index_text = render_index(parse_index(index_now), fill_commits=write)
    index = parse_index(index_text)
    out = {INDEX: (index_now, index_text)}
    for doc in sorted({t.doc for t in TABLES}):
        text = (REPO / doc).read_text(encoding="utf-8")
        out[REPO / doc] = (text, render_document(text, doc, index))
    return out


def check() -> list[str]:
    """A unified diff per generated file that differs from its rendering (empty: all match)."""
    diffs = []
    for path, (now, rendered) in renderings(write=False).items():
        if now != rendered:
            rel = str(path.relative_to(REPO))
            diffs.append("".join(difflib.unified_diff(now.splitlines(True), rendered.splitlines(True),
                                                      f"{rel} (committed)", f"{rel} (rendered)")))
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff where a file differs")
    mode.add_argument("--write", action="store_true", help="rewrite the marked blocks and the index")
    args = ap.parse_args(argv)
    if args.write:
        for path, (now, rendered) in renderings(write=True).items():
            if now != rendered:
                path.write_text(rendered, encoding="utf-8")
                print("wrote", path.relative_to(REPO))
        return 0
    diffs = check()
    print("\n".join(diffs) if diffs else "benchmark record: documents and index match their rendering")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
