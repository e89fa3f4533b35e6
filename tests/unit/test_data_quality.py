"""Hand-derived tests of the data report's pure checks (rlhf_core/data/quality.py) and of the
report itself on small files (rlhf_core/data/report.py, a GX run each)."""

from __future__ import annotations

import json

import pytest

from rlhf_core.config import ConfigError, DataReportConfig
from rlhf_core.data import quality
from rlhf_core.data.report import data_report


def test_normalize_folds_case_unicode_and_whitespace_but_keeps_operators():
    """NFKC maps fullwidth '４' to '4' and NBSP to a space; case-folded; runs of whitespace become one
    space; ends stripped. '+' and '-' stay, so 47+85= and 47-85= remain different prompts."""
    assert quality.normalize("  Sort\t\u00a0５２ =\n") == "sort 52 ="
    assert quality.normalize("47+85=") != quality.normalize("47-85=")
    assert quality.normalize("Straße") == quality.normalize("STRASSE")  # casefold, not lower


def test_text_of_joins_message_contents():
    assert quality.text_of("a b") == "a b"
    assert quality.text_of([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == "hi\nyo"
    assert quality.text_of(None) == ""


def test_word_ngrams_needs_n_words():
    """'a b c d' has 4 - 3 + 1 = 2 word 3-grams; 'a b' has none."""
    assert quality.word_ngrams("A  b c d", 3) == {("a", "b", "c"), ("b", "c", "d")}
    assert quality.word_ngrams("a b", 3) == set()


def test_eval_index_exact_after_normalisation_and_13_gram_overlap():
    """Eval: one short prompt and one of 15 words w1..w15 (3 word 13-grams). A training prompt
    'x w2 .. w14 y' holds w2..w14, the eval's second 13-gram: overlap. 'w1 .. w12' has 12 words: no
    13-gram, so no overlap test applies, and it is not an eval prompt either."""
    long_eval = " ".join(f"w{i}" for i in range(1, 16))
    index = quality.EvalIndex(["sort 52=", long_eval])
    assert index.exact_match("  SORT   52=") and not index.exact_match("sort 25=")
    assert index.ngram_overlap("x " + " ".join(f"W{i}" for i in range(2, 15)) + " y")
    assert not index.ngram_overlap(" ".join(f"w{i}" for i in range(1, 13)))
    assert not index.ngram_overlap("x " + " ".join(f"w{i}" for i in range(2, 14)) + " y")  # 12 shared words


def test_repeats_and_rate():
    """[a, b, a, a]: rows 3 and 4 repeat row 1: rate 2/4 = 0.5. One example k times: (k-1)/k."""
    flags = quality.repeats(["a", "b", "a", "a"])
    assert flags == [False, False, True, True] and quality.rate(flags) == 0.5
    assert quality.rate(quality.repeats(["x"] * 5)) == pytest.approx(4 / 5)
    assert quality.rate([]) == 0.0


def test_relative_change_and_drift_bounds():
    """10 -> 15: |15 - 10| / 10 = 0.5; bounds of 10 at 0.5: 10 ± 5; of -4 at 0.25: -4 ± 1."""
    assert quality.relative_change(10, 15) == pytest.approx(0.5)
    assert quality.relative_change(10, 5) == pytest.approx(0.5)
    assert quality.drift_bounds(10, 0.5) == (5, 15)
    assert quality.drift_bounds(-4, 0.25) == (-5, -3)


def test_config_rejects_rates_outside_0_1():
    with pytest.raises(ConfigError, match="data_report.max_near_duplicate_rate: must be a rate in"):
        DataReportConfig(max_near_duplicate_rate=1.5)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_rates_lines_and_drift(tmp_path):
    """4 pairs: rows 2 and 4 are rows 1 and 3 up to case and spacing, row 3's chosen repeats row 1's.
    duplicate-prompt rate = near-duplicate rate = 2/4 = 0.5 > 0.25 and > 0.05; repeated chosen
    rate = 3/4 (rows 2, 3, 4 repeat '12') > 0.6. Mean chosen length = 2; previous 1.0 at max drift
    0.5 allows [0.5, 1.5]: drift. Rows 3 and 4 hold the eval prompt '9+9=' (row 4 spaced): line 3 first."""
    pairs = _write(tmp_path / "pairs.jsonl", [
        {"prompt": "sort 21=", "chosen": "12", "rejected": "21", "margin": 1.0},
        {"prompt": "SORT  21=", "chosen": "12", "rejected": "21", "margin": 3.0},
        {"prompt": "9+9=", "chosen": "12", "rejected": "81", "margin": 2.0},
        {"prompt": " 9+9= ", "chosen": "12", "rejected": "81", "margin": 2.0},
    ])
    eval_file = _write(tmp_path / "eval.jsonl", [{"prompt": "9+9=", "label": "18"}])
    report = data_report(pairs, "preference", DataReportConfig(), eval_file=str(eval_file),
                         previous={"data/mean_chosen_chars": 1.0, "data/mean_margin": 100.0})
    assert report.stats["data/duplicate_prompt_rate"] == 0.5
    assert report.stats["data/near_duplicate_rate"] == 0.5
    assert report.stats["data/repeated_chosen_rate"] == 0.75
    assert report.stats["data/mean_margin"] == 2.0 and report.stats["data/eval_exact_matches"] == 2
    text = report.render()
    assert f"{pairs}:3: field 'prompt': eval contamination: found in the eval set {eval_file}" in text, text
    assert f"{pairs}:2: field 'prompt': duplicate-prompt rate 0.500" in text
    assert f"{pairs}:2: field 'chosen': repeated 'chosen' rate 0.750" in text
    assert "near-duplicate rate" in text and "repeats='line 1'" in text
    assert f"{pairs}: field 'chosen': drift: mean moved 1 -> 2" in text
    assert "margin" not in {f.field for f in report.failures}  # a reward mean is reported, not bounded
    assert "Expectation Validation Result" in report.html and "alignflow data report: FAILED" in report.html


def test_report_passes_clean_conversational_sft(tmp_path):
    """Distinct chats, no eval overlap: every check passes; prompt = the turns before the assistant's."""
    rows = [{"messages": [{"role": "user", "content": f"sort {n}="}, {"role": "assistant", "content": str(n)}]}
            for n in (12, 345, 6789)]
    sft = _write(tmp_path / "sft.jsonl", rows)
    eval_file = _write(tmp_path / "eval.jsonl", [{"prompt": "1+1=", "label": "2"}])
    report = data_report(sft, "sft", eval_file=str(eval_file))
    assert report.success, report.render()
    assert report.stats["data/mean_prompt_chars"] == pytest.approx((8 + 9 + 10) / 3)
    assert report.stats["data/near_duplicate_rate"] == 0.0


def test_validate_command_with_eval_file_runs_the_report(tmp_path, capsys, monkeypatch):
    """`alignflow validate --eval-file`: line 2 holds the eval prompt -> exit 1 naming file:2 and the field;
    without that row the report passes and prints its rates."""
    from flows.cli import main

    monkeypatch.chdir(tmp_path)
    eval_file = _write(tmp_path / "eval.jsonl", [{"prompt": "9+9=", "label": "18"}])
    rows = [{"prompt": "sort 21=", "completion": "12"}, {"prompt": "9+9=", "completion": "18"}]
    bad = _write(tmp_path / "bad.jsonl", rows)
    assert main(["validate", "--kind", "sft", str(bad), "--eval-file", str(eval_file)]) == 1
    assert f"{bad}:2: field 'prompt': eval contamination: found in the eval set" in capsys.readouterr().err
    good = _write(tmp_path / "good.jsonl", rows[:1])
    assert main(["validate", "--kind", "sft", str(good), "--eval-file", str(eval_file)]) == 0
    assert "data report passed: eval_exact_matches 0" in capsys.readouterr().out
