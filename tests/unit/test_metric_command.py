"""The metric command's contract (rlhf_core/promotion/metric_command.py) with real tiny commands: a python script written
to the test folder, run as a user's would be; every fault names the command, or the file, line and field."""

from __future__ import annotations

import sys

import pytest

from rlhf_core.config import ConfigError, GuardsConfig
from rlhf_core.promotion.metric_command import MetricCommandError, command_args, pair_scores, read_scores, run_metric_command

PY = sys.executable


def _script(tmp_path, body: str):
    path = tmp_path / "score.py"
    path.write_text("import sys\nmodel, out = sys.argv[1], sys.argv[2]\n" + body)
    return f"{PY} {path} {{model}} {{out}}"


def test_the_command_writes_scores_keyed_by_id(tmp_path):
    """Ids become strings (7 and "7" are one id); two lines: {"a": 0.5, "7": 2.0}."""
    cmd = _script(tmp_path, "open(out, 'w').write('{\"id\": \"a\", \"score\": 0.5}\\n\\n{\"id\": 7, \"score\": 2}\\n')\n")
    scores = run_metric_command(cmd, model=tmp_path / "my model", out=tmp_path / "o" / "s.jsonl", eval_file="e",
                                cwd=tmp_path)
    assert scores == {"a": 0.5, "7": 2.0}


def test_placeholders_fill_after_splitting_so_a_path_with_spaces_stays_one_argument():
    assert command_args("python e.py --model {model} --out={out}", model="/m y", out="/o", eval_file="x") == [
        "python", "e.py", "--model", "/m y", "--out=/o"]
    with pytest.raises(MetricCommandError, match="placeholder"):
        command_args("python e.py {modle}", model="m", out="o", eval_file="e")


def test_a_failing_command_names_its_exit_code_and_stderr_tail(tmp_path):
    cmd = _script(tmp_path, "sys.stderr.write('x' * 5000 + 'CUDA out of memory')\nsys.exit(3)\n")
    with pytest.raises(MetricCommandError, match=r"exit code 3\)") as err:
        run_metric_command(cmd, model="m", out=tmp_path / "s.jsonl", eval_file="e", cwd=tmp_path)
    assert str(err.value).endswith("CUDA out of memory") and "x" * 2100 not in str(err.value)


def test_a_command_that_writes_no_file_is_an_error(tmp_path):
    (tmp_path / "s.jsonl").write_text('{"id": "old", "score": 1}\n')  # left by an earlier run: must not count
    with pytest.raises(MetricCommandError, match="wrote no score file"):
        run_metric_command(_script(tmp_path, "pass\n"), model="m", out=tmp_path / "s.jsonl", eval_file="e",
                           cwd=tmp_path)


@pytest.mark.parametrize("line,match", [
    ("not json", r":2: not JSON"),
    ('["a", 1]', r":2: must be a JSON object"),
    ('{"score": 1}', r":2: field 'id': must be a string or an integer, got None"),
    ('{"id": "b", "score": true}', r":2: field 'score': must be a finite number, got True"),
    ('{"id": "b", "score": NaN}', r":2: field 'score': must be a finite number, got nan"),
    ('{"id": "a", "score": 1}', r":2: field 'id': 'a' appears twice"),
])
def test_a_bad_line_names_file_line_and_field(tmp_path, line, match):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "a", "score": 1}\n' + line + "\n")
    with pytest.raises(MetricCommandError, match=match) as err:
        read_scores(path)
    assert str(err.value).startswith(f"{path}:2")


def test_scores_pair_by_id_and_different_ids_are_an_error():
    ids, parent, child = pair_scores({"b": 1.0, "a": 0.0}, {"a": 0.5, "b": 3.0})
    assert (ids, parent, child) == (["a", "b"], [0.0, 1.0], [0.5, 3.0])
    with pytest.raises(MetricCommandError, match=r"only the parent's: \['b'\], only the child's: \['c'\]"):
        pair_scores({"a": 0.0, "b": 1.0}, {"a": 0.0, "c": 1.0})


def test_guards_config_checks_the_metric_command():
    assert GuardsConfig(gate_metric="command", metric_command="python e.py --model {model} --out {out}")
    with pytest.raises(ConfigError, match="metric_command"):
        GuardsConfig(gate_metric="command", metric_command="python e.py --model {model}")
    with pytest.raises(ConfigError, match="set gate_metric: command"):
        GuardsConfig(metric_command="python e.py --model {model} --out {out}")
