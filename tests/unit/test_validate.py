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
        (GOOD_PREF[0], "prompt+chosen+rejected", "expect_column_values_to_be_in_set"),
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


def test_prompt_only_kind_lets_the_label_go_but_holds_a_present_one(tmp_path):
    """TRL's prompt-only file (no label) passes ``prompt-only`` in both forms and fails ``prompts``
    naming the line and field; a blank label fails both kinds."""
    bare = _write(tmp_path, "bare.jsonl", [{"prompt": "1+1="}, {"prompt": "1+2=", "label": 3}])
    chat = _write(tmp_path, "chat.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}]}])
    assert validate_dataset(bare, "prompt-only").success
    assert validate_dataset(chat, "prompt-only").success
    with pytest.raises(ValidationFailed, match=r"bare.jsonl:1: field 'label': missing"):
        check_dataset(bare, "prompts")
    blank = _write(tmp_path, "blank.jsonl", [{"prompt": "1+1="}, {"prompt": "1+2=", "label": " "}])
    for kind in ("prompt-only", "prompts"):
        report = validate_dataset(blank, kind)
        # prompts: line 1's missing label is also reported (as missing, and not a valid value).
        assert _failures(report)[("label", "expect_column_values_to_be_in_set")] == \
            ([2] if kind == "prompt-only" else [1, 2]), kind
        assert "field 'label': must be a non-blank string or a finite number" in report.render()
        assert "blank.jsonl:2" in report.render()


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
    assert failures[("prompt+chosen+rejected", "expect_column_values_to_be_in_set")] == [6, 7]
    dumped = json.dumps(report.to_dict())
    for text in (dumped, report.render()):
        assert "SECRETVALUE123" not in text and "hunter2pass" not in text
        assert "y" * 100 not in text
    examples = [ex for f in report.failures for ex in f.examples]
    assert examples and all(len(ex) <= EXCERPT_CHARS for ex in examples)
    assert any("token=***" in ex and "bob" not in ex for ex in examples)  # still says what was there


# --------------------------------------------------------------------------------------
# TRL's forms: standard and conversational, per kind
# --------------------------------------------------------------------------------------


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


GOOD_FORMS = {
    "sft-standard": ("sft", [{"prompt": "1+1=", "completion": "2"}], "standard"),
    "sft-conversational": ("sft", [{"prompt": [U("1+1=")], "completion": [A("2")]}], "conversational"),
    "sft-messages": ("sft", [{"messages": [U("1+1="), A("2"), U("and 1+2?"), A("3")]}],
                     "conversational (messages)"),
    "preference-standard": ("preference", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}], "standard"),
    "preference-standard-implicit": ("preference", [{"chosen": "1+1= 2", "rejected": "1+1= 3"}],
                                     "standard, implicit prompt"),
    "preference-conversational": ("preference", [{"prompt": [U("1+1=")], "chosen": [A("2")], "rejected": [A("3")]}],
                                  "conversational"),
    "preference-conversational-implicit": ("preference", [{"chosen": [U("1+1="), A("2")],
                                                           "rejected": [U("1+1="), A("3")]}],
                                           "conversational, implicit prompt"),
    "prompts-standard": ("prompts", [{"prompt": "1+1=", "label": "2"}], "standard"),
    "prompts-conversational": ("prompts", [{"prompt": [U("1+1=")], "label": "2"}], "conversational"),
    "unpaired-standard": ("unpaired", [{"prompt": "1+1=", "completion": "2", "desirable": True}], "standard"),
    "unpaired-conversational": ("unpaired", [{"prompt": [U("1+1=")], "completion": [A("3")], "desirable": False}],
                                "conversational"),
    "unpaired-pairs": ("unpaired", [{"chosen": [U("1+1="), A("2")], "rejected": [U("1+1="), A("3")]}],
                       "conversational, implicit prompt, preference pairs"),
}


@pytest.mark.parametrize("name", list(GOOD_FORMS))
def test_each_form_of_each_kind_passes(tmp_path, name):
    kind, rows, form = GOOD_FORMS[name]
    report = validate_dataset(_write(tmp_path, f"{name}.jsonl", rows), kind)
    assert report.success, report.render()
    assert report.form == form and f"{form} form" in report.render()


def test_standard_suites_are_unchanged(micro_data):
    """DVC tracks the embedded data's validation reports: the standard forms keep their suites, so
    those reports (and every stage depending on them) do not move. KTO's default file (preference
    pairs) passes the unpaired kind."""
    counts = {kind: validate_dataset(micro_data[name], kind).n_expectations
              for name, kind in (("sft", "sft"), ("preferences", "preference"), ("prompts", "prompts"))}
    assert counts == {"sft": 9, "preference": 15, "prompts": 7}
    report = validate_dataset(micro_data["preferences"], "unpaired")
    assert report.success and report.form == "standard, preference pairs"
    assert set(report.to_dict()) == {"path", "kind", "n_rows", "success", "n_expectations", "failures"}


def test_malformed_conversational_records_name_line_and_field(tmp_path):
    """The issue's four malformed records (plus a wrong content type), each caught by the check
    that names its fault, on its own line."""
    rows = [{"chosen": [U("q1"), A("a")], "rejected": [U("q1"), A("b")]},
            {"chosen": [{"role": "bot", "content": "q2"}, A("a")], "rejected": [U("q2"), A("b")]},  # 2 wrong role
            {"chosen": [U("q3"), U("a")], "rejected": [U("q3"), A("b")]},  # 3 no assistant turn
            {"chosen": [U("q4"), A("a")], "rejected": [U("q4?"), A("b")]},  # 4 different prompts
            {"chosen": [U("q5"), A("a")], "rejected": [U("q5"), {"role": "assistant"}]},  # 5 no content
            {"chosen": [U("q6"), A("a")], "rejected": [U("q6"), {"role": "assistant", "content": ["b"]}]}]
    path = _write(tmp_path, "pairs.jsonl", rows)
    report = validate_dataset(path, "preference")
    found = {(f.field, f.message.split(" (")[0]): f.lines for f in report.failures}
    assert found == {
        ("chosen", "every message needs a role, one of system, user, assistant, tool"): [2],
        ("chosen", "must be the prompt's messages, then one assistant answer last"): [3],
        ("rejected", "implicit prompt: 'chosen' and 'rejected' have different prompts"): [2, 4],
        ("rejected", "must be a non-empty list of messages, each an object with a string 'content'"): [5, 6],
    }, report.render()
    text = report.render()
    for line, field in ((2, "chosen"), (3, "chosen"), (4, "rejected"), (5, "rejected")):
        assert f"{path}:{line}" in text and f"field '{field}'" in text

    sft = _write(tmp_path, "sft.jsonl", [{"prompt": [U("q1")], "completion": [A("a")]},
                                         {"prompt": [{"role": "human", "content": "q2"}], "completion": [A("a")]},
                                         {"prompt": [U("q3")], "completion": [U("a")]},
                                         {"prompt": [{"role": "user"}], "completion": [A("a")]},
                                         {"prompt": [U("q5"), A("x")], "completion": [A("a")]}])
    found = {(f.field, f.message): f.lines for f in validate_dataset(sft, "sft").failures}
    assert found == {("prompt", "every message needs a role, one of system, user, assistant, tool"): [2],
                     ("completion", "must be exactly one assistant message"): [3],
                     ("prompt", "must be a non-empty list of messages, each an object with a string 'content'"): [4],
                     ("prompt", "a prompt conversation must not end with an assistant turn"): [5]}


def test_a_file_mixing_forms_names_the_rows_and_the_line_that_set_the_form(tmp_path):
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "1+2=", "completion": "3"},
            {"prompt": [U("1+3=")], "completion": [A("4")]}]
    with pytest.raises(ValidationFailed, match=r"mixed\.jsonl:3: field 'prompt': must be a string \(the file's "
                                               r"standard form, set by line 1\)"):
        check_dataset(_write(tmp_path, "mixed.jsonl", rows), "sft")
    pairs = [{"chosen": "a b", "rejected": "a c"}, {"prompt": "p", "chosen": "b", "rejected": "c"}]
    with pytest.raises(ValidationFailed, match=r"mixed2\.jsonl:2: field 'prompt': present, but line 1 has none"):
        check_dataset(_write(tmp_path, "mixed2.jsonl", pairs), "preference")
    chats = [{"messages": [U("q"), A("a")]}, {"prompt": "q2", "completion": "a2"}]
    with pytest.raises(ValidationFailed, match=r"mixed3\.jsonl:2: field 'messages': missing"):
        check_dataset(_write(tmp_path, "mixed3.jsonl", chats), "sft")


def test_unpaired_desirable_field_maps_trls_label(tmp_path):
    """TRL's KTO files name the boolean `label`: the default name misses it and says how to map it;
    `desirable_field=label` (or a KTO config saying so) reads it."""
    from rlhf_core.config import KTOConfig

    path = _write(tmp_path, "kto.jsonl", [{"prompt": "1+1=", "completion": "2", "label": True},
                                          {"prompt": "1+1=", "completion": "3", "label": False}])
    with pytest.raises(ValidationFailed, match=r"kto\.jsonl:1: field 'desirable': missing \(a TRL file calls it "
                                               r"'label': set desirable_field=label\)"):
        check_dataset(path, "unpaired")
    assert validate_dataset(path, "unpaired", desirable_field="label").success
    assert validate_dataset(path, "unpaired", KTOConfig(desirable_field="label")).success
    bad = _write(tmp_path, "kto2.jsonl", [{"prompt": "1+1=", "completion": "2", "label": "true"}])
    with pytest.raises(ValidationFailed, match=r"kto2\.jsonl:1: field 'label': must be true or false"):
        check_dataset(bad, "unpaired", desirable_field="label")


def test_duplicate_conversations_are_caught(tmp_path):
    row = {"prompt": [U("1+1=")], "completion": [A("2")]}
    report = validate_dataset(_write(tmp_path, "dup.jsonl", [row, {**row, "completion": [A("3")]}, row]), "sft")
    assert _failures(report) == {("prompt+completion", "expect_column_values_to_be_in_set"): [1, 3]}


def test_a_hub_folder_failure_names_the_shard_and_its_line(tmp_path):
    folder = tmp_path / "ds"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# pairs\n")
    _write(folder / "data", "train-00000-of-00002.jsonl", GOOD_PREF[:3])
    _write(folder / "data", "train-00001-of-00002.jsonl", GOOD_PREF[3:] + [{"prompt": "x", "chosen": "1",
                                                                             "rejected": "1"}])
    report = validate_dataset(folder, "preference")
    (failure,) = report.failures
    shard = folder / "data" / "train-00001-of-00002.jsonl"
    assert failure.lines == [3] and failure.locations == [f"{shard}:3"]
    assert f"{shard}:3: field 'chosen': 'chosen' equals 'rejected'" in report.render()
    assert failure.examples[0].startswith(f"{shard}:3: ")


def test_where_each_input_gets_its_kind():
    """dvc.yaml, the stages' gate and the align flow ask only for kinds the gate has; KTO's train file
    is gated as unpaired data; the flow checks the preference file as unpaired only when KTO is the
    only stage that reads it (the default stages keep the pair check, and its report)."""
    from pathlib import Path

    import yaml

    from flows.align import dataset_kinds, load_all
    from rlhf_core.data.validate import KINDS
    from rlhf_core.stages.gate import GATE_KINDS
    from rlhf_core.config.stage_registry import STAGES

    repo = Path(__file__).resolve().parents[2]
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    dvc_kinds = {item["kind"] for name in ("validate", "validate_rejection")
                 for item in stages[name]["foreach"].values()}
    read_kinds = {read.kind for stage in STAGES.values() for read in stage.reads}
    assert dvc_kinds | set(GATE_KINDS.values()) | read_kinds <= set(KINDS)
    assert "unpaired" in read_kinds
    assert dataset_kinds(load_all(None, None))["preferences"] == "preference"
    assert dataset_kinds(load_all(None, {"flow": {"stages": ["kto"]}}))["preferences"] == "unpaired"
    assert dataset_kinds(load_all(None, {"flow": {"stages": ["reward", "kto"]}}))["preferences"] == "preference"
    # The prompts file: labels optional only when every stage that reads it scores with a reward model.
    assert dataset_kinds(load_all(None, None))["prompts"] == "prompts"  # the default RL's reward function
    assert dataset_kinds(load_all(None, None))["eval"] == "prompts"
    model_rl = {"rl": {"reward": {"kind": "model"}}}
    assert dataset_kinds(load_all(None, {"flow": {"stages": ["rl", "rejection"]}, **model_rl}))["prompts"] == \
        "prompt-only"
    rule = {"rejection": {"scorer": "rule"}, **model_rl}
    assert dataset_kinds(load_all(None, {"flow": {"stages": ["rl", "rejection"]}, **rule}))["prompts"] == "prompts"
    assert dataset_kinds(load_all(None, {"flow": {"stages": ["dpo"]}, **model_rl}))["prompts"] == "prompts"


def test_an_eval_file_is_labelled_everywhere_or_nowhere(tmp_path):
    """eval_kind: every item labelled -> prompts, none -> prompt-only, a mix -> DataError at the first unlabelled
    line; the flows that compare accuracy (align, cycles) refuse an unlabelled one, naming file and field."""
    from rlhf_core.data.io import DataError
    from rlhf_core.data.validate import eval_kind, require_eval_labels

    path = tmp_path / "eval.jsonl"
    path.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "1+2=", "label": 3}\n')
    assert eval_kind(path, "label") == "prompts"
    require_eval_labels(path, "label", "align")
    path.write_text('{"prompt": "1+1="}\n{"prompt": "1+2="}\n')
    assert eval_kind(path, "label") == "prompt-only"
    with pytest.raises(DataError, match=rf"^{path}: field 'label': no eval item has this field: the raft flow"):
        require_eval_labels(path, "label", "raft")
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2="}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: field 'answer': missing, while 1 of the 2 items have one"):
        eval_kind(path, "answer")


def test_a_missing_field_is_shown_as_missing_not_nan(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n"
                    + json.dumps({"prompt": "q", "chosen": "c"}) + "\n")
    report = validate_dataset(path, "preference")
    example = next(f for f in report.failures if f.field == "rejected").examples[0]
    assert "rejected=<missing>" in example and "nan" not in example, example


def test_json_errors_read_as_one_phrase(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "unterminated\n')
    with pytest.raises(DataError, match=r"broken\.jsonl:1: not valid JSON \(Unterminated string starting at column 12\)"):
        check_dataset(path, "sft")


def test_a_bad_role_is_shown_with_its_message_and_value(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "asistant", "content": "yo"}]}) + "\n")
    report = validate_dataset(path, "sft")
    (failure,) = [f for f in report.failures if f.field == "messages"]
    assert failure.examples[0].startswith("line 1: messages[1].role='asistant': messages="), failure.examples


def test_a_message_without_string_content_is_named(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}) + "\n")
    report = validate_dataset(path, "sft")
    examples = [e for f in report.failures if f.field == "messages" for e in f.examples]
    assert examples and all("messages[1].content is missing, not a string" in e for e in examples), examples
