"""The validation gate's input boundary: ``validate_dataset`` (rlhf_core/data/validate.py, streamed by
rlhf_core/data/streaming.py) and the stage readers of rlhf_core/data/formats.py, for every dataset kind
(sft, preference, prompts, prompt-only, unpaired) in the standard and conversational forms. The
contract is that every file of valid and hostile records (wrong types per field, blank text, bad
roles and contents, NaN, infinities, 10**400, lone surrogates, arbitrary JSON) is either accepted or
refused: by a ``DataError`` that starts with the file and line, or by a report whose every failure
names ``file:line`` rows of the file and a field, encodable as UTF-8 for the log and as JSON for DVC;
no other exception escapes, and the file's bytes are the same afterwards. Every example runs the real
Great Expectations suite.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from rlhf_core.data import formats, validate
from rlhf_core.data.io import DataError, Record
from rlhf_core.data.validate import KINDS, ValidationFailed, check_dataset, validate_dataset

# A hang fails the test instead of stalling the suite: 0.6 s an example over the whole run (120 s for the
# default profile's 200, 1200 s for the long profile's 2000; no per-example deadline, CI's timing varies).
pytestmark = pytest.mark.timeout(0.6 * settings.default.max_examples)

# ------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------

WORDS = st.text(alphabet="ab \n", max_size=5).map(lambda s: "w " + s)
"""Non-blank text sharing the prefix ``w `` (an implicit prompt)."""
HOSTILE = st.sampled_from([None, 0, 5, 10**400, -(10**400), math.nan, math.inf, True, "", " \n", "\ufeff",
                           "\ud800", "a\udfffb", [], {}, [[]], {"role": "user"}, 1e308])
ARBITRARY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                      max_size=3), max_leaves=5)


def _message(role: str) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"role": st.just(role), "content": WORDS})


PROMPT_CHAT = st.lists(_message("user") | _message("system"), min_size=1, max_size=2)
ANSWER_CHAT = st.lists(_message("assistant"), min_size=1, max_size=1)
BAD_CHAT = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["bot", "", 5, None, "assistant"]),
                                           "content": WORDS | HOSTILE}, optional={"name": ARBITRARY}), max_size=3)
TEXTS = st.one_of(WORDS, WORDS, PROMPT_CHAT, ANSWER_CHAT, st.builds(list.__add__, PROMPT_CHAT, ANSWER_CHAT),
                  BAD_CHAT, HOSTILE, ARBITRARY)
"""A text or messages field's value: mostly right for some form, else wrong or hostile."""
FIELD_VALUES = {
    "prompt": TEXTS, "completion": TEXTS, "chosen": TEXTS, "rejected": TEXTS, "messages": TEXTS,
    "label": WORDS | st.integers() | st.floats() | HOSTILE, "margin": st.floats() | st.integers() | HOSTILE,
    "desirable": st.booleans() | st.booleans() | HOSTILE,
}
KIND_FIELDS = {"sft": ["prompt", "completion", "messages"], "preference": ["prompt", "chosen", "rejected", "margin"],
               "prompts": ["prompt", "label"], "prompt-only": ["prompt", "label"],
               "unpaired": ["prompt", "completion", "desirable", "chosen", "rejected", "margin"]}


def records(kind: str) -> st.SearchStrategy[list[dict]]:
    """Up to four records of ``kind``'s fields, each present or not, and sometimes a field of no kind."""
    row = st.fixed_dictionaries({}, optional={f: FIELD_VALUES[f] for f in KIND_FIELDS[kind]} | {"extra": ARBITRARY})
    return st.lists(row, max_size=4)


KIND_AND_RECORDS = st.sampled_from(KINDS).flatmap(lambda kind: st.tuples(st.just(kind), records(kind)))


def _write(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON Lines or a ``.json`` array by ``path``'s suffix (NaN and Infinity as JSON's tokens)."""
    if path.suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def stage_reader(kind: str, rows: list[Record], path: Path) -> list:
    """The examples the stage of ``kind`` reads from ``rows`` (SFT's ``messages`` chats excepted: tokenised apart)."""
    if kind == "sft":
        plain = [r for r in rows if "messages" not in r.data]
        return formats.read_completion_examples(plain, path)
    if kind == "preference":
        return formats.read_pair_examples(rows, path)
    if kind == "unpaired":
        return formats.read_unpaired_examples(rows, path)
    return formats.read_prompt_examples(rows, path)


# ------------------------------------------------------------------------------------------
# The contract
# ------------------------------------------------------------------------------------------


def _check_report(report, path: Path, n_rows: int) -> None:
    """Every failure names the file's rows and a field; the report encodes as the log and DVC keep it."""
    report.render().encode("utf-8")
    json.dumps(report.to_dict()).encode("utf-8")
    assert report.n_rows == n_rows
    for failure in report.failures:
        assert failure.field
        assert 0 <= failure.unexpected_count and len(failure.lines) <= failure.unexpected_count or not n_rows
        assert all(1 <= line <= n_rows for line in failure.lines), failure
        assert all(loc.startswith(f"{path}:") for loc in failure.locations), failure


@given(kind_rows=KIND_AND_RECORDS, suffix=st.sampled_from([".jsonl", ".json"]))
@example(kind_rows=("preference", [{"prompt": "w a", "chosen": "w b", "rejected": "w c", "margin": 10**400}]),
         suffix=".jsonl")
@example(kind_rows=("prompts", [{"prompt": "w a", "label": 10**400}]), suffix=".jsonl")
@example(kind_rows=("sft", [{"prompt": "w \ud800", "completion": "w b"}]), suffix=".jsonl")
def test_the_gate_accepts_or_refuses_naming_file_line_and_field(kind_rows, suffix):
    kind, rows = kind_rows
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"data{suffix}"
        _write(path, rows)
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        try:
            report = validate.validate_dataset(path, kind)
        except DataError as exc:
            assert str(exc).startswith(f"{path}:"), exc
            str(exc).encode("utf-8")
            event("refused by the reader")
        else:
            _check_report(report, path, len(rows))
            event("accepted" if report.success else "refused by the suite")
        assert hashlib.sha256(path.read_bytes()).hexdigest() == before


@given(kind_rows=KIND_AND_RECORDS)
@example(kind_rows=("preference", [{"prompt": "w a", "chosen": "w b", "rejected": "w c", "margin": 10**400}]))
@example(kind_rows=("unpaired", [{"chosen": "w b", "rejected": "w c", "margin": math.nan}]))
def test_the_stage_readers_return_examples_or_a_data_error(kind_rows):
    kind, rows = kind_rows
    path = Path("data.jsonl")
    try:
        examples = stage_reader(kind, [Record(r, i) for i, r in enumerate(rows, start=1)], path)
    except DataError as exc:
        assert str(exc).startswith(f"{path}:") and 1 <= exc.line <= len(rows), exc
        event("refused")
    else:
        assert all(1 <= e.line <= len(rows) for e in examples)
        event("read")


# ------------------------------------------------------------------------------------------
# Each refusal
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,row,field", [
    ("preference", {"prompt": "w a", "chosen": "w b", "rejected": "w c", "margin": 10**400}, "margin"),
    ("preference", {"prompt": "w a", "chosen": "w b", "rejected": "w c", "margin": math.nan}, "margin"),
    ("prompts", {"prompt": "w a", "label": 10**400}, "label"),
    ("prompt-only", {"prompt": "w a", "label": -math.inf}, "label"),
])
def test_a_number_past_float_range_fails_its_field(tmp_path, kind, row, field):
    path = tmp_path / "data.jsonl"
    _write(path, [row])
    with pytest.raises(ValidationFailed) as info:
        check_dataset(path, kind)
    (failure,) = info.value.report.failures
    assert (failure.field, failure.locations) == (field, [f"{path}:1"])


def test_the_pair_reader_refuses_a_margin_past_float_range():
    row = Record({"prompt": "w a", "chosen": "w b", "rejected": "w c", "margin": 10**400}, 3)
    with pytest.raises(DataError, match=r"data\.jsonl:3: field 'margin': must be a finite number"):
        formats.read_pair_examples([row], "data.jsonl")


def test_a_lone_surrogate_is_refused_at_the_gate(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "w a", "completion": "w b"}\n{"prompt": "w \\ud800", "completion": "w b"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:2: field 'prompt': a lone surrogate \('\\ud800'\)"):
        validate_dataset(path, "sft")
