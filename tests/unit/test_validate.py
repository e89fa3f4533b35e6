"""The Great Expectations gate catches each kind of bad row and names file, line and field."""

from __future__ import annotations

import json

import pytest

from rlhf_core.config import DataFields
from rlhf_core.data.io import DataError
from rlhf_core.data.validate import ValidationFailed, check_dataset, validate_dataset


def _write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD_PREF = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(5)]


def _failures(report):
    return {(f.field, f.expectation): f.lines for f in report.failures}


def test_valid_files_pass(tmp_path, micro_data):
    assert validate_dataset(micro_data["sft"], "sft").success
    assert validate_dataset(micro_data["preferences"], "preference").success
    assert validate_dataset(micro_data["prompts"], "prompts").success
    assert validate_dataset(_write(tmp_path, "p.jsonl", GOOD_PREF), "preference").success


@pytest.mark.parametrize(
    "bad_row, field, expectation",
    [
        ({"prompt": "9+1=", "rejected": "11"}, "chosen", "expect_column_values_to_not_be_null"),
        ({"prompt": "9+1=", "chosen": 10, "rejected": "11"}, "chosen", "expect_column_values_to_be_in_set"),
        ({"prompt": "   ", "chosen": "10", "rejected": "11"}, "prompt", "expect_column_values_to_be_in_set"),
        ({"prompt": "9+1=", "chosen": "x" * 30, "rejected": "11"}, "chosen",
         "expect_column_value_lengths_to_be_between"),
        ({"prompt": "9+1=", "chosen": "10", "rejected": "10"}, "chosen",
         "expect_select_column_values_to_be_unique_within_record"),
        ({"prompt": "9+1=", "chosen": "10", "rejected": "11", "margin": float("inf")}, "margin",
         "expect_column_values_to_be_in_set"),
        ({"prompt": "9+1=", "chosen": "10", "rejected": "11", "margin": "big"}, "margin",
         "expect_column_values_to_be_in_set"),
        (GOOD_PREF[0], "prompt+chosen+rejected", "expect_compound_columns_to_be_unique"),
    ],
    ids=["missing", "wrong-type", "blank", "too-long", "chosen-eq-rejected", "inf-margin", "text-margin",
         "duplicate"],
)
def test_each_bad_preference_row_is_caught(tmp_path, bad_row, field, expectation):
    path = _write(tmp_path, "prefs.jsonl", GOOD_PREF + [bad_row])  # bad row on line 6
    report = validate_dataset(path, "preference", max_chars=20)
    failures = _failures(report)
    assert (field, expectation) in failures, report.render()
    assert 6 in failures[(field, expectation)]
    assert f"prefs.jsonl:6: field '{field}'" in report.render() or f"prefs.jsonl:1: field '{field}'" in report.render()


def test_sft_and_prompt_kinds(tmp_path):
    sft = _write(tmp_path, "sft.jsonl", [{"prompt": "1+1=", "completion": "2"}, {"prompt": "1+2="}])
    with pytest.raises(ValidationFailed, match=r"sft.jsonl:2: field 'completion': missing"):
        check_dataset(sft, "sft")
    chat = _write(tmp_path, "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "yo"}]},
                                           {"messages": [{"role": "user", "content": "no reply"}]}])
    with pytest.raises(ValidationFailed, match=r"chat.jsonl:2: field 'messages'"):
        check_dataset(chat, "sft")
    prompts = _write(tmp_path, "prompts.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "1+3=", "label": None},
                                                 {"prompt": "1+4=", "label": 5}])
    report = validate_dataset(prompts, "prompts")
    assert ("label", "expect_column_values_to_not_be_null") in _failures(report)
    assert _failures(report)[("label", "expect_column_values_to_not_be_null")] == [2]  # 5 (a number) is fine


def test_renamed_fields(tmp_path):
    path = _write(tmp_path, "qa.jsonl", [{"question": "1+1=", "answer": "2"}])
    fields = DataFields(prompt_field="question", completion_field="answer")
    assert validate_dataset(path, "sft", fields).success
    assert not validate_dataset(path, "sft").success  # default names are missing


def test_broken_json_line_names_file_and_line(tmp_path):
    path = _write(tmp_path, "broken.jsonl", [GOOD_PREF[0], GOOD_PREF[1], '{"prompt": "3+1=", "chosen": ', GOOD_PREF[3]])
    with pytest.raises(DataError, match=r"broken.jsonl:3: not valid JSON"):
        validate_dataset(path, "preference")


def test_empty_and_parquet(tmp_path):
    import pandas as pd

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert not validate_dataset(empty, "prompts").success
    pq = tmp_path / "p.parquet"
    pd.DataFrame(GOOD_PREF + [{"prompt": "x", "chosen": "1", "rejected": "1"}]).to_parquet(pq)
    report = validate_dataset(pq, "preference")
    assert _failures(report)[("chosen", "expect_select_column_values_to_be_unique_within_record")] == [6]


def test_failure_excerpts_are_redacted_and_clipped(tmp_path):
    """A failing row carrying a URL token, URL credentials and a 10,000-character field: the report
    (what goes to validation_report.json, MLflow and stderr) quotes neither secret and no excerpt
    is longer than EXCERPT_CHARS."""
    from rlhf_core.data.validate import EXCERPT_CHARS

    bad = {"prompt": "fetch https://host/x?token=SECRETVALUE123 then https://bob:hunter2pass@db.example/q",
           "chosen": "y" * 10_000, "rejected": "n"}
    path = _write(tmp_path, "leaky.jsonl", GOOD_PREF + [bad, bad])  # a duplicate, and chosen too long
    report = validate_dataset(path, "preference", max_chars=5_000)
    failures = _failures(report)
    assert failures[("chosen", "expect_column_value_lengths_to_be_between")] == [6, 7]
    assert failures[("prompt+chosen+rejected", "expect_compound_columns_to_be_unique")] == [6, 7]
    dumped = json.dumps(report.to_dict())
    for text in (dumped, report.render()):
        assert "SECRETVALUE123" not in text and "hunter2pass" not in text
        assert "y" * 100 not in text
    examples = [ex for f in report.failures for ex in f.examples]
    assert examples and all(len(ex) <= EXCERPT_CHARS for ex in examples)
    assert any("token=***" in ex and "bob" not in ex for ex in examples)  # still says what was there
