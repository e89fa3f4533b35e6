"""TRL's dataset formats read per stage kind (rlhf_core.data.formats), and the Great Expectations
gate agreeing with those readers: a row the gate passes is a row the reader accepts, and each
malformed conversational row is refused by both, naming file, line and field."""

from __future__ import annotations

import json

import pytest

from rlhf_core.data.formats import (
    implicit_prompt,
    read_completion_examples,
    read_pair_examples,
    read_prompt_examples,
    read_unpaired_examples,
)
from rlhf_core.data.io import DataError, Record, read_records
from rlhf_core.data.validate import validate_dataset


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def S(text):
    return {"role": "system", "content": text}


def _recs(*rows):
    return [Record(row, i) for i, row in enumerate(rows, start=1)]


# --------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------


def test_prompt_examples_in_both_forms():
    got = read_prompt_examples(_recs({"prompt": "1+1=", "label": 2}, {"prompt": [S("be brief"), U("1+2=")]}), "p")
    assert [(e.prompt, e.label, e.line) for e in got] == [("1+1=", "2", 1), ([S("be brief"), U("1+2=")], None, 2)]
    with pytest.raises(DataError, match=r"p:1: field 'prompt': a prompt conversation must not end with an assistant"):
        read_prompt_examples(_recs({"prompt": [U("q"), A("a")]}), "p")


def test_completion_examples_keep_the_prompts_form():
    got = read_completion_examples(_recs({"q": "1+1=", "a": "2"}, {"q": [U("1+2=")], "a": [A("3")]}), "c",
                                   prompt_field="q", completion_field="a")
    assert [(e.prompt, e.completion) for e in got] == [("1+1=", "2"), ([U("1+2=")], [A("3")])]
    with pytest.raises(DataError, match=r"c:1: field 'a': must be a list of messages, as the prompt is"):
        read_completion_examples(_recs({"q": [U("1+2=")], "a": "3"}), "c", prompt_field="q", completion_field="a")


def test_implicit_prompt_standard_cuts_at_whitespace_and_conversational_takes_all_but_last():
    assert implicit_prompt("The answer is 4", "The answer is 45", "f", 1) == ("The answer is ", "4", "45")
    assert implicit_prompt([U("q"), A("a")], [U("q"), A("b")], "f", 1) == ([U("q")], [A("a")], [A("b")])
    with pytest.raises(DataError, match=r"f:3: field 'chosen': implicit prompt: .* share no prompt prefix"):
        implicit_prompt("4", "5", "f", 3)
    with pytest.raises(DataError, match=r"f:3: field 'rejected': implicit prompt: .* different prompts"):
        implicit_prompt([U("q"), A("a")], [U("Q"), A("b")], "f", 3)


def test_pair_examples_explicit_implicit_and_margin():
    got = read_pair_examples(_recs({"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1},
                                   {"chosen": [U("1+2="), A("3")], "rejected": [U("1+2="), A("4")]}), "pairs")
    assert (got[0].prompt, got[0].chosen, got[0].rejected, got[0].margin) == ("1+1=", "2", "3", 1.0)
    assert (got[1].prompt, got[1].chosen, got[1].rejected, got[1].margin) == ([U("1+2=")], [A("3")], [A("4")], None)
    with pytest.raises(DataError, match=r"pairs:1: field 'rejected': 'chosen' equals 'rejected'"):
        read_pair_examples(_recs({"chosen": [U("q"), A("a")], "rejected": [U("q"), A("a")]}), "pairs")


def test_unpaired_examples_map_trls_label_and_split_pairs():
    """TRL's KTO files call the boolean `label`; a preference pair gives one desirable and one
    undesirable example, both from its line."""
    rows = _recs({"prompt": "1+1=", "completion": "2", "label": True},
                 {"prompt": [U("1+2=")], "completion": [A("4")], "label": False},
                 {"prompt": "1+3=", "chosen": "4", "rejected": "5"})
    got = read_unpaired_examples(rows, "kto", desirable_field="label")
    assert [(e.completion, e.desirable, e.line) for e in got] == [("2", True, 1), ([A("4")], False, 2),
                                                                  ("4", True, 3), ("5", False, 3)]
    with pytest.raises(DataError, match=r"kto:1: field 'desirable': missing"):
        read_unpaired_examples(rows, "kto")
    with pytest.raises(DataError, match=r"kto:1: field 'label': must be true or false, got 'yes'"):
        read_unpaired_examples(_recs({"prompt": "q", "completion": "a", "label": "yes"}), "kto",
                               desirable_field="label")


def test_errors_name_the_shard_a_record_came_from():
    """A record of a Hub-layout folder carries its shard: the error names it, not the folder."""
    rec = Record({"prompt": [U("q")], "completion": [{"role": "bot", "content": "a"}]}, 7,
                 "ds/data/train-00001-of-00002.parquet")
    with pytest.raises(DataError, match=r"^ds/data/train-00001-of-00002\.parquet:7: field 'completion': message 0: "
                                        r"role 'bot'"):
        read_completion_examples([rec], "ds")


# --------------------------------------------------------------------------------------
# The gate and the readers agree
# --------------------------------------------------------------------------------------

# Each file: (kind, reader keyword arguments, rows as (row, verdict)). Verdicts: "ok" both accept,
# "bad" both refuse, "gate" only the gate refuses (it is stricter: a row in another form than the
# file's, a label or number it requires). Files are in one form each, as the gate wants them.
CORPUS = {
    "preference-conversational-implicit": ("preference", {}, [
        ({"chosen": [U("q1"), A("a")], "rejected": [U("q1"), A("b")]}, "ok"),
        ({"chosen": [S("s"), U("q2"), A("x"), U("q2b"), A("a")],
          "rejected": [S("s"), U("q2"), A("x"), U("q2b"), A("b")], "margin": 0.5}, "ok"),
        ({"chosen": [U("q3"), A("a")], "rejected": [U("q3 other"), A("b")]}, "bad"),  # different prompts
        ({"chosen": [{"role": "bot", "content": "q4"}, A("a")],
          "rejected": [{"role": "bot", "content": "q4"}, A("b")]}, "bad"),  # wrong role
        ({"chosen": [U("q5"), U("a")], "rejected": [U("q5"), A("b")]}, "bad"),  # no assistant answer
        ({"chosen": [U("q6"), {"role": "assistant"}], "rejected": [U("q6"), A("b")]}, "bad"),  # no content
        ({"chosen": [U("q7"), {"role": "assistant", "content": 7}], "rejected": [U("q7"), A("b")]}, "bad"),
        ({"chosen": [U("q8"), A("a")], "rejected": [U("q8"), A("a")]}, "bad"),  # chosen == rejected
        ({"chosen": [A("a")], "rejected": [A("b")]}, "bad"),  # no prompt messages to share
        ({"chosen": [], "rejected": [U("q10"), A("b")]}, "bad"),
        ({"chosen": [U("q11"), A("a")], "rejected": [U("q11"), A("b")], "margin": "big"}, "bad"),
        ({"chosen": [U("q12"), A("a")], "rejected": [U("q12"), A("b")], "margin": float("nan")}, "bad"),
        ({"chosen": "x y", "rejected": "x z"}, "gate"),  # the standard form in a conversational file
    ]),
    "preference-conversational-explicit": ("preference", {}, [
        ({"prompt": [U("q1")], "chosen": [A("a")], "rejected": [A("b")]}, "ok"),
        ({"prompt": [S("s"), U("q2")], "chosen": [A("a")], "rejected": [A("b")]}, "ok"),
        ({"prompt": [U("q3"), A("x")], "chosen": [A("a")], "rejected": [A("b")]}, "bad"),  # prompt ends answered
        ({"prompt": [U("q4")], "chosen": [A("a"), A("b")], "rejected": [A("b")]}, "bad"),  # two answers
        ({"prompt": [U("q5")], "chosen": [U("a")], "rejected": [A("b")]}, "bad"),  # answer not the assistant's
        ({"prompt": [U("q6")], "chosen": [A("a")], "rejected": "b"}, "bad"),  # forms mixed within the row
        ({"prompt": [{"content": "q7"}], "chosen": [A("a")], "rejected": [A("b")]}, "bad"),  # no role
        ({"chosen": [A("a")], "rejected": [A("b")]}, "bad"),  # no prompt: implicit, and none to share
    ]),
    "preference-standard-implicit": ("preference", {}, [
        ({"chosen": "The answer is 4", "rejected": "The answer is 5"}, "ok"),
        ({"chosen": "Q: 1+1=\nA: 2", "rejected": "Q: 1+1=\nA: 3"}, "ok"),
        ({"chosen": "4", "rejected": "5"}, "bad"),  # no common prefix ending at whitespace
        ({"chosen": "x y", "rejected": "x y"}, "bad"),
        ({"chosen": "x  ", "rejected": "   "}, "bad"),
        ({"prompt": "p", "chosen": "a", "rejected": "b"}, "gate"),  # an explicit row in an implicit file
    ]),
    "sft-conversational": ("sft", {}, [
        ({"prompt": [U("q1")], "completion": [A("a")]}, "ok"),
        ({"prompt": [S("s"), U("q2")], "completion": [A("a")]}, "ok"),
        ({"prompt": [{"role": "human", "content": "q3"}], "completion": [A("a")]}, "bad"),  # wrong role
        ({"prompt": [U("q4")], "completion": [U("a")]}, "bad"),  # missing assistant turn
        ({"prompt": [{"role": "user", "text": "q5"}], "completion": [A("a")]}, "bad"),  # no content
        ({"prompt": [U("q6"), A("x")], "completion": [A("a")]}, "bad"),
        ({"prompt": [U("q7")], "completion": "a"}, "bad"),
        ({"prompt": [U("q8")]}, "bad"),
        ({"prompt": "q9", "completion": "a"}, "gate"),
    ]),
    "sft-standard": ("sft", {}, [
        ({"prompt": "q1", "completion": "a"}, "ok"),
        ({"prompt": "q2", "completion": "  "}, "bad"),
        ({"prompt": [U("q3")], "completion": "a"}, "bad"),
        ({"prompt": [U("q4")], "completion": [A("a")]}, "gate"),
    ]),
    "prompts-conversational": ("prompts", {}, [
        ({"prompt": [U("1+1=")], "label": "2"}, "ok"),
        ({"prompt": [S("s"), U("1+2=")], "label": 3}, "ok"),
        ({"prompt": [U("1+3="), A("4")], "label": "4"}, "bad"),
        ({"prompt": [{"role": "robot", "content": "1+4="}], "label": "5"}, "bad"),
        ({"prompt": [U("1+5=")]}, "gate"),  # the gate wants a label to check answers against
        ({"prompt": "1+6=", "label": "7"}, "gate"),
    ]),
    "unpaired-conversational": ("unpaired", {"desirable_field": "label"}, [
        ({"prompt": [U("q1")], "completion": [A("a")], "label": True}, "ok"),
        ({"prompt": [U("q2")], "completion": [A("b")], "label": False}, "ok"),
        ({"prompt": [U("q3")], "completion": [A("a")], "label": "yes"}, "bad"),
        ({"prompt": [U("q4")], "completion": [A("a")]}, "bad"),
        ({"prompt": [U("q5")], "completion": [U("a")], "label": True}, "bad"),
        ({"prompt": [{"role": "bot", "content": "q6"}], "completion": [A("a")], "label": True}, "bad"),
        ({"prompt": [U("q7")], "completion": [{"role": "assistant"}], "label": True}, "bad"),
        ({"prompt": [U("q8")], "chosen": [A("a")], "rejected": [A("b")]}, "gate"),  # a pair among unpaired rows
    ]),
    "unpaired-pairs": ("unpaired", {}, [
        ({"chosen": [U("q1"), A("a")], "rejected": [U("q1"), A("b")]}, "ok"),
        ({"chosen": [U("q2"), A("a")], "rejected": [U("q2!"), A("b")]}, "bad"),
        ({"prompt": [U("q3")], "completion": [A("a")], "desirable": True}, "gate"),
    ]),
}

READERS = {"sft": read_completion_examples, "preference": read_pair_examples, "prompts": read_prompt_examples,
           "unpaired": read_unpaired_examples}


@pytest.mark.parametrize("name", list(CORPUS))
def test_gate_passes_only_rows_the_reader_accepts(tmp_path, name):
    kind, kwargs, rows = CORPUS[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row, _ in rows))
    report = validate_dataset(path, kind, **kwargs)
    refused_by_gate = {ln for f in report.failures for ln in f.lines}
    refused_by_reader = set()
    for rec in read_records(path):
        try:
            READERS[kind]([rec], path, **kwargs)
        except DataError as exc:
            assert (exc.path, exc.line) == (str(path), rec.line) and exc.field, exc
            refused_by_reader.add(rec.line)
    expected = {line: verdict for line, (_, verdict) in enumerate(rows, start=1)}
    assert refused_by_gate == {ln for ln, v in expected.items() if v != "ok"}, report.render()
    assert refused_by_reader == {ln for ln, v in expected.items() if v == "bad"}
    assert refused_by_gate >= refused_by_reader  # nothing the gate passes fails in the reader
    for failure in report.failures:  # every failure names file, line and field
        assert failure.field and all(loc == f"{path}:{ln}" for loc, ln in zip(failure.locations, failure.lines))


def test_plain_text_joins_a_conversations_contents_and_keeps_text():
    """The tokenizer corpus of ``init-model``: a conversation contributes its words, never a list's repr."""
    from rlhf_core.data.formats import plain_text

    chat = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    assert plain_text(chat) == "2+2=4"
    assert plain_text("2+2=") == "2+2="
    assert plain_text(None) == ""
