"""The gate on hostile input at any size: size limits before parsing, streaming validation in chunks
(every row checked, failures merged, duplicates found across chunks) and file-level faults named as
a DataError. Small files with a small ``chunk_rows`` stand in for large ones; bench/validate_big.py
measures a 2 GB file."""

from __future__ import annotations

import json
import os

import pytest

from rlhf_core.config import ConfigError, DataFields
from rlhf_core.data.io import DataError, read_records
from rlhf_core.data.streaming import SeenRows
from rlhf_core.data.validate import validate_dataset


def _pairs(n):
    return [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(1, n + 1)]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _failures(report):
    return {(f.field, f.message): f for f in report.failures}


# --------------------------------------------------------------------------------------
# Size limits
# --------------------------------------------------------------------------------------


def test_a_line_over_the_byte_limit_is_refused_before_parsing_naming_file_and_line(tmp_path):
    """Line 2 is 161 bytes of JSON and line 3 is not JSON at all: the limit (120 bytes) refuses line 2
    unparsed, so the error is the length, not a parse error, and line 3 is never reached."""
    rows = _pairs(1) + [{"prompt": "x" * 120, "chosen": "a", "rejected": "b"}, "{not json"]
    path = _write(tmp_path / "big.jsonl", rows)
    with pytest.raises(DataError, match=r"big\.jsonl:2: line longer than 120 bytes, refused before parsing"):
        validate_dataset(path, "preference", DataFields(max_line_bytes=120))
    with pytest.raises(DataError, match=r"big\.jsonl:3: not valid JSON"):  # the default lets line 2 through
        validate_dataset(path, "preference")


def test_the_line_limit_counts_the_line_without_its_newline(tmp_path):
    """A line of exactly the limit passes, with or without a final newline; one byte more is refused."""
    line = json.dumps({"prompt": "1+1=", "completion": "2"})
    limit = len(line.encode())
    for text in (line + "\n", line):
        path = tmp_path / "exact.jsonl"
        path.write_text(text)
        assert len(read_records(path, max_line_bytes=limit)) == 1
        with pytest.raises(DataError, match=r"exact\.jsonl:1: line longer than"):
            read_records(path, max_line_bytes=limit - 1)


def test_the_field_limit_is_a_setting_naming_file_line_and_field(tmp_path):
    path = _write(tmp_path / "p.jsonl", _pairs(3) + [{"prompt": "4+1=", "chosen": "5" * 11, "rejected": "6"}])
    assert validate_dataset(path, "preference").success  # 11 characters: far inside the default
    report = validate_dataset(path, "preference", DataFields(max_field_chars=10))
    assert [(f.field, f.lines) for f in report.failures] == [("chosen", [4])]
    assert f"{path}:4: field 'chosen': length outside [1, 10] characters" in report.render()
    with pytest.raises(ConfigError, match=r"data\.max_field_chars: must be >= 1, got 0"):
        DataFields(max_field_chars=0)


def test_the_validate_command_takes_the_limits_as_settings(tmp_path, capsys):
    from flows.cli import main

    path = _write(tmp_path / "p.jsonl", _pairs(2) + [{"prompt": "3+1=", "chosen": "4" * 50, "rejected": "5"}])
    assert main(["validate", "--kind", "preference", str(path)]) == 0
    assert main(["validate", "--kind", "preference", str(path), "--set", "max_field_chars=20"]) == 1
    assert f"{path}:3: field 'chosen': length outside [1, 20] characters" in capsys.readouterr().err
    assert main(["validate", "--kind", "preference", str(path), "--set", "max_line_bytes=60"]) == 1
    assert f"{path}:3: line longer than 60 bytes" in capsys.readouterr().err


def test_both_limits_are_in_the_gate_key(tmp_path):
    """A pass under one limit must not stand for another: each limit changes the gate's cache key."""
    from rlhf_core.stages.gate import _gate_key

    path = _write(tmp_path / "p.jsonl", _pairs(2))
    keys = {_gate_key(path, "preference", f) for f in (DataFields(), DataFields(max_field_chars=10),
                                                        DataFields(max_line_bytes=100))}
    assert len(keys) == 3
    assert _gate_key(path, "preference", DataFields()) == _gate_key(path, "preference", DataFields())


# --------------------------------------------------------------------------------------
# Streaming in chunks
# --------------------------------------------------------------------------------------


def test_a_bad_last_row_of_a_many_chunk_file_is_found(tmp_path):
    """25 rows in chunks of 4 (7 chunks, the last of one row): the bad row is the last line."""
    path = _write(tmp_path / "p.jsonl", _pairs(24) + [{"prompt": "25+1=", "chosen": "26", "rejected": "26"}])
    report = validate_dataset(path, "preference", chunk_rows=4)
    assert report.n_rows == 25
    assert [(f.field, f.lines) for f in report.failures] == [("chosen", [25])]
    assert f"{path}:25: field 'chosen': 'chosen' equals 'rejected'" in report.render()


def test_failures_in_several_chunks_merge_into_the_one_file_report(tmp_path):
    """Blank prompts on lines 2, 7 and 12 and an infinite margin on line 9, in chunks of 3: the report
    (counts, lines, examples, to_dict) is the one validating the file as a single frame gives."""
    rows = _pairs(13)
    for line in (2, 7, 12):
        rows[line - 1] = {**rows[line - 1], "prompt": "  "}
    rows[8] = json.dumps({**rows[8], "margin": "__inf__"}).replace('"__inf__"', "Infinity")
    path = _write(tmp_path / "p.jsonl", rows)
    chunked, whole = (validate_dataset(path, "preference", chunk_rows=n) for n in (3, 1000))
    assert chunked.to_dict() == whole.to_dict() and chunked.render() == whole.render()
    failures = _failures(chunked)
    blank = failures[("prompt", "empty or blank string")]
    assert (blank.unexpected_count, blank.lines, len(blank.examples)) == (3, [2, 7, 12], 3)
    assert failures[("margin", "must be a finite number when present")].lines == [9]


def test_duplicates_are_found_across_a_chunk_boundary(tmp_path):
    """Line 7 repeats line 2 (chunks of 4: lines 1-4, 5-8, ...): line 7 is reported, its earlier copy
    being in a chunk already validated; lines 9 and 10, a pair inside one chunk, are both reported."""
    rows = _pairs(10)
    rows[6] = rows[1]
    rows[9] = rows[8]
    path = _write(tmp_path / "p.jsonl", rows)
    report = validate_dataset(path, "preference", chunk_rows=4)
    dup = _failures(report)[("prompt+chosen+rejected", "duplicate rows")]
    assert (dup.unexpected_count, dup.lines) == (3, [7, 9, 10])
    assert dup.examples[0] == "line 7: prompt='2+1=', chosen='3', rejected='4'"


def test_seen_rows_keeps_digests_not_rows_and_skips_all_missing_keys():
    seen = SeenRows()
    assert seen.unique_flags([("a", "b"), ("a", "c"), (None, None), ("a", "b")]) == [False, True, True, False]
    assert seen.unique_flags([(None, None), ("a", "c"), ("a", None), ("None", None)]) == [True, False, True, True]
    assert len(seen) == 4  # ("a","b"), ("a","c"), ("a",None), ("None",None)


def test_the_form_is_found_past_the_first_chunk(tmp_path):
    """Lines 1-5 show no form (a numeric prompt); line 6 is conversational. With chunks of 2 the
    read-ahead gives up and a second pass finds line 6: the same report as one chunk gives."""
    rows = [{"prompt": i, "completion": [{"role": "assistant", "content": "x"}]} for i in range(5)]
    rows.append({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "y"}]})
    path = _write(tmp_path / "s.jsonl", rows)
    chunked, whole = (validate_dataset(path, "sft", chunk_rows=n) for n in (2, 1000))
    assert chunked.form == whole.form == "conversational"
    assert chunked.render() == whole.render()
    assert _failures(chunked)[("prompt", "must be a list of {role, content} messages (the file's conversational "
                                         "form, set by line 6)")].lines == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------------------------
# File-level faults
# --------------------------------------------------------------------------------------


def test_file_level_faults_name_the_file(tmp_path):
    """Each fault is one DataError naming the file (or folder), never a traceback from a reader."""
    cases = {
        "latin1.jsonl": b'{"prompt": "caf\xe9", "completion": "x"}\n',
        "latin1.json": b'[{"prompt": "caf\xe9",\n "completion": "x"}]',
        "broken.parquet": b"PAR1 not really",
    }
    expect = {"latin1.jsonl": r"latin1\.jsonl:1: not UTF-8 text \(byte 0xe9 at column 16\)",
              "latin1.json": r"latin1\.json:1: not UTF-8 text \(byte 0xe9\)",
              "broken.parquet": r"broken\.parquet: not a readable parquet file"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=expect[name]):
            validate_dataset(tmp_path / name, "sft")
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match=r"notes/notes\.txt: unsupported shard format '\.txt'"):
        validate_dataset(folder, "sft")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "state.json").write_text("{")
    with pytest.raises(DataError, match=r"damaged: not a readable datasets folder"):
        validate_dataset(damaged, "sft")
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"pipe\.jsonl: not a regular file or a dataset folder"):
        validate_dataset(fifo, "sft")


def test_an_empty_file_is_reported_naming_the_file(tmp_path):
    """No rows (no bytes, or blank lines only): the report's one failure names the file."""
    for name, content in (("empty.jsonl", ""), ("blank.jsonl", "\n \n")):
        path = tmp_path / name
        path.write_text(content)
        report = validate_dataset(path, "sft")
        assert not report.success and report.n_rows == 0
        assert f"{path}: field '*': dataset has no rows" in report.render()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_file_is_named(tmp_path):
    path = _write(tmp_path / "locked.jsonl", _pairs(1))
    path.chmod(0)
    try:
        with pytest.raises(DataError, match=r"locked\.jsonl: cannot be read \(permission denied\)"):
            validate_dataset(path, "preference")
    finally:
        path.chmod(0o644)
