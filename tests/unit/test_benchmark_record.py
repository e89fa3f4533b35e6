"""The benchmark record: README.md and BENCHMARKS.md show performance figures only inside blocks that
``bench/record.py`` renders from committed result files, and each block is what the renderer gives now.

The unit rule: a number with a unit of time, speed-up, share, memory or throughput (``0.465 s``, ``2.88×``,
``35%``, ``15.0 GB``, ``13.0k tok/s``) outside a rendered block fails, unless its phrase is in ``ALLOWED``
(what a rerun needs, not what a run measured). Counts
and sizes of the set-up (``2 cores``, ``500 steps``, ``32 × 8``, ``Qwen2-0.5B``), durations in minutes
(``about 12 minutes``, ``90-minute``) and accuracies without a unit are not figures this rule reads.
BENCHMARKS-archive.md, the dated record, is not read.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import record  # noqa: E402
import record_tables  # noqa: E402

DOCUMENTS = ("README.md", "BENCHMARKS.md")
UNIT = r"(?:ms|µs|us|s|%|GB|GiB|MB|MiB|TB|tok/s|tokens/s|MB/s|GB/s)"
FIGURE = re.compile(rf"(?<![\w.\-/])\d+(?:[.,]\d+)*[kM]?(?:\s?{UNIT}(?![\w/])|[x×](?![\w]))")
# phrases that hold a number with a unit and are no measurement: what a rerun needs
ALLOWED = {
    "BENCHMARKS.md": ("~15 GB free under `/tmp`", "~50 GB free under `/tmp`"),
}


def figures_outside_blocks(doc: str, text: str) -> list[str]:
    """``doc: heading: figure in its line`` for each figure with a unit outside the rendered blocks."""
    text = record.BLOCK.sub("", text)
    for phrase in ALLOWED.get(doc, ()):
        text = text.replace(phrase, "")
    found, heading = [], ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            continue
        found += [f"{doc}: {heading}: {m.group(0)!r} in {line.strip()[:100]!r}" for m in FIGURE.finditer(line)]
    return found


def test_documents_and_the_index_are_their_rendering():
    diffs = record.check()
    assert not diffs, "run `python bench/record.py --write` (or fix the table):\n" + "\n".join(diffs)[:6000]


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_no_figure_with_a_unit_outside_the_rendered_blocks(doc):
    found = figures_outside_blocks(doc, (REPO / doc).read_text(encoding="utf-8"))
    assert not found, ("a figure belongs in a table bench/record.py renders from a committed result file "
                       "(bench/record_tables.py), or in BENCHMARKS-archive.md:\n  " + "\n  ".join(found))


def test_every_table_is_in_its_document_and_names_committed_sources():
    for table in record.TABLES:
        text = (REPO / table.doc).read_text(encoding="utf-8")
        assert record.BEGIN.format(table.name) in text, table.name
        for path in table.sources.values():
            assert (REPO / path).is_file(), path
    for doc in DOCUMENTS:
        assert record.UNCOMMITTED not in (REPO / doc).read_text(encoding="utf-8"), \
            f"{doc} cites a result file the index has no commit for: rerun --write after committing it"


def test_every_table_of_benchmarks_md_is_rendered():
    text = record.BLOCK.sub("", (REPO / "BENCHMARKS.md").read_text(encoding="utf-8"))
    tables = [line for line in text.splitlines() if re.match(r"\|\s*-{3}", line)]
    assert not tables, "BENCHMARKS.md has a table outside the rendered blocks (bench/record_tables.py renders tables)"


@pytest.mark.parametrize("text, figures", [
    ("0.465 s (0.436–0.527) and 2.88× and 4.44x", ["0.465 s", "2.88×", "4.44x"]),
    ("35% of 6NT, 15.0 GB, 80GB, 13.0k tok/s, 1.3 ms, 76.1 µs, 457 MB/s", ["35%", "15.0 GB", "80GB", "13.0k tok/s",
                                                                          "1.3 ms", "76.1 µs", "457 MB/s"]),
    ("DPO 50 s, rejection 30 s", ["50 s", "30 s"]),
    ("2 cores, 500 steps, 32 × 8 × 256, Qwen2-0.5B, 1.2M-param, about 12 minutes, a 90-minute run", []),
    ("1,000 held-out items, 0.289 ± 0.014, 3 samples, `--gb 2`, 4 × H200, v2.13.0, 2026-12-02", []),
])
def test_the_unit_rule_reads_figures_not_set_up(text, figures):
    assert [m.group(0) for m in FIGURE.finditer(text)] == figures


def test_an_allowed_phrase_is_honoured_in_its_document_only():
    text = "## A section\n\n3.2 s a step\n\n## Next\n\n~15 GB free under `/tmp`, 4.1 s\n"
    assert figures_outside_blocks("BENCHMARKS.md", text) == ["BENCHMARKS.md: A section: '3.2 s' in '3.2 s a step'",
                                                             "BENCHMARKS.md: Next: '4.1 s' in ', 4.1 s'"]
    assert figures_outside_blocks("README.md", text) == ["README.md: A section: '3.2 s' in '3.2 s a step'",
                                                         "README.md: Next: '15 GB' in '~15 GB free under `/tmp`, 4.1 s'",
                                                         "README.md: Next: '4.1 s' in '~15 GB free under `/tmp`, 4.1 s'"]


def test_cells_read_values_through_paths_and_steps():
    data = {"r": {"rows": [{"s": 0.4652, "r": [0.4358, 0.5273]}, {"s": 1.3374, "r": [1.2753, 1.415]}],
                  "n": 118881.5, "b": 15000000465, "f": 0.3469}}
    cell = ("{r:rows.0.s|.3f} s ({r:rows.0.r|range:.3f}), {r:n|k:.1f}, {r:b|/1e9:.1f} GB, {r:f|.0%}, "
            "{r:rows.*.s|max:.2f}, {r:rows|len:d}, {r:rows.1.s ÷ r:rows.0.s|.2f}×, {r:rows.1.s - r:rows.0.s|+.3f}")
    assert record.render_cell(cell, data) == "0.465 s (0.436–0.527), 118.9k, 15.0 GB, 35%, 1.34, 2, 2.87×, +0.872"
    with pytest.raises(record.RecordError, match="no field"):
        record.render_cell("{r:rows.0.missing|}", data)


def test_a_result_file_outside_the_layout_is_refused(tmp_path, monkeypatch):
    (tmp_path / "cpu" / "2026-01-02").mkdir(parents=True)
    (tmp_path / "cpu" / "2026-01-02" / "a.json").write_text("{}")
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    monkeypatch.setattr(record, "INDEX", tmp_path / "INDEX.md")
    assert "| `cpu/2026-01-02/a.json` | cpu | 2026-01-02 |" in record.render_index({}, fill_commits=False)
    (tmp_path / "flat.json").write_text("{}")
    with pytest.raises(record.RecordError, match="outside"):
        record.render_index({}, fill_commits=False)
