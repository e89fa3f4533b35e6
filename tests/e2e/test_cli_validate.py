"""``alignflow validate``: exit codes, messages naming file/line/field, nothing written on failure."""

from __future__ import annotations

import json

from helpers import run_cli


def _listing(folder):
    return sorted(p.name for p in folder.rglob("*"))


def test_missing_chosen_field(tmp_path):
    bad = tmp_path / "prefs.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n"
                   + json.dumps({"prompt": "1+2=", "rejected": "4"}) + "\n")
    before = _listing(tmp_path)
    proc = run_cli(["validate", "--kind", "preference", str(bad), "--report", str(tmp_path / "r.json")], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert f"{bad}:2: field 'chosen': missing" in proc.stderr
    assert "expect_column_values_to_not_be_null" in proc.stderr
    assert _listing(tmp_path) == before  # no report, nothing else


def test_broken_jsonl_line(tmp_path):
    bad = tmp_path / "sft.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "1+2=", "completion": \n')
    before = _listing(tmp_path)
    proc = run_cli(["validate", "--kind", "sft", str(bad), "--report", str(tmp_path / "r.json")], tmp_path)
    assert proc.returncode == 1
    assert f"{bad}:2: not valid JSON" in proc.stderr
    assert _listing(tmp_path) == before


def test_valid_file_and_renamed_fields(tmp_path):
    good = tmp_path / "qa.jsonl"
    good.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    proc = run_cli(["validate", "--kind", "sft", str(good), "--set", "prompt_field=question",
                    "--set", "completion_field=answer", "--report", str(tmp_path / "r.json")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["success"] is True
    assert run_cli(["validate", "--kind", "sft", str(good)], tmp_path).returncode == 1


def test_bad_override_is_exit_2(tmp_path):
    proc = run_cli(["sft", "--set", "lr=-1"], tmp_path)
    assert proc.returncode == 2
    assert "sft.lr: must be > 0" in proc.stderr


def test_prompt_only_kind(tmp_path):
    """TRL's prompt-only file: valid as ``prompt-only`` (labels optional), not as ``prompts``."""
    bare = tmp_path / "prompts.jsonl"
    bare.write_text(json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    proc = run_cli(["validate", "--kind", "prompt-only", str(bare), "--report", str(tmp_path / "r.json")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["kind"] == "prompt-only"
    proc = run_cli(["validate", "--kind", "prompts", str(bare)], tmp_path)
    assert proc.returncode == 1 and f"{bare}:1: field 'label': missing" in proc.stderr
