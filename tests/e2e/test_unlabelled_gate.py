"""Eval data without labels, and a user's own metric, through ``alignflow dpo --register``: the guards' gate
without exact match (issue 20).

* No eval item has a label: the stage trains, its eval reports what it can (``eval/n_items`` and the answers,
  no accuracy, never a NaN one), the guards gate on the held-out reward model's score with the KL guard, and
  the registry promotes only through that gate (there is no accuracy to hold against a champion).
* ``guards.gate_metric: command``: a real script written to the test folder scores each model per item; the
  gate compares parent and child paired by item id, so the script's scores alone decide promotion.
* Half-labelled eval data is an error naming the file, the first unlabelled line and the field.
"""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import write_micro_params

# Scores each eval line; the trained model (its folder is named "trained") gets `--child-gain` times 1, 2 or 3
# more: a paired gain of 2 x gain on average with a small spread, whatever the micro model learned.
METRIC_SCRIPT = """\
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--model"); p.add_argument("--out"); p.add_argument("--eval"); p.add_argument("--child-gain", type=float)
p.add_argument("--drop-one", action="store_true")
a = p.parse_args()
child = a.model.rstrip("/").endswith("trained")
lines = [line for line in open(a.eval) if line.strip()]
with open(a.out, "w") as f:
    for i, _ in enumerate(lines):
        if a.drop_one and child and i == 0:
            continue
        f.write(json.dumps({"id": f"q{i}", "score": (i % 4) + (a.child_gain * (1 + i % 3) if child else 0.0)}) + "\\n")
"""
ALL_ADVISORY = "guards.advisory_guards=[reward_hacking,reward_disagreement,kl,length,entropy_collapse,skill_regression]"


@pytest.fixture()
def project(isolated_project, micro_model, micro_data, make_micro_rm):
    params = write_micro_params(isolated_project)
    values = yaml.safe_load(params.read_text())
    values["guards"]["gate"] = True  # the micro params turn the gate off for the flow tests; these tests are about it
    values["guards"]["reward_model_path"] = str(make_micro_rm(0.0, 1.0))
    values["tracking"]["model_storage"] = "reference"
    params.write_text(yaml.safe_dump(values, sort_keys=False))
    (isolated_project / "my_eval.py").write_text(METRIC_SCRIPT)
    return isolated_project


def _eval_file(project, micro_data, labelled_lines=()):
    """The micro eval set's first 40 items without labels, but for the (0-based) lines in ``labelled_lines``."""
    rows = [json.loads(line) for line in micro_data["eval"].read_text().splitlines()[:40]]
    for i, row in enumerate(rows):
        if i not in labelled_lines:
            del row["label"]
    out = project / "eval_unlabelled.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _dpo(micro_model, micro_data, eval_file, capsys, *extra):
    from flows.cli import main

    code = main(["dpo", "--set", f"model_path={micro_model}", "--set", f"train_file={micro_data['preferences']}",
                 "--set", f"eval_file={eval_file}", "--set", "output_dir=out/trained",
                 "--set", "checkpoint_dir=checkpoints/dpo-unlabelled", *extra, "--register", "policy"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _client(project):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")


def test_an_unlabelled_eval_file_gates_on_the_held_out_reward_with_the_kl_guard(project, micro_model, micro_data,
                                                                                 capsys):
    eval_file = _eval_file(project, micro_data)
    code, out, err = _dpo(micro_model, micro_data, eval_file, capsys)
    assert code == 0, err[-3000:]
    result = json.loads(out[out.index("{"):])
    metrics = result["metrics"]
    assert metrics["eval/n_items"] == 40.0
    assert not any(k.startswith("eval/accuracy") or k == "guard/accuracy" for k in metrics), sorted(metrics)
    assert "guard/reward_mean" in metrics and "guard/reward_delta_se" in metrics and "guard/kl" in metrics
    assert "no eval/accuracy" in result["registry"]["verdict"]

    client = _client(project)
    version = client.get_model_version_by_alias("policy", "candidate")
    tags = version.tags
    assert tags["guard.gate_metric"] == "reward" and tags["guard.kl"].startswith(("ok", "FIRED"))
    assert tags["eval_accuracy"] == "nan"
    assert ("champion" in client.get_registered_model("policy").aliases) == (tags["guard.gate_passed"] == "true")
    run = client.get_run(version.run_id)
    assert run.data.tags["alignflow.stage"] == "dpo" and "eval/accuracy" not in run.data.metrics
    samples = json.loads((project / client.download_artifacts(version.run_id, "eval_samples.json",
                                                                str(project))).read_text())
    assert samples and all(set(s) == {"prompt", "completion"} for s in samples)
    assert "Gate (reward)" in version.description


def test_some_items_labelled_and_some_not_is_an_error_naming_file_line_and_field(project, micro_model, micro_data,
                                                                                 capsys):
    eval_file = _eval_file(project, micro_data, labelled_lines={0, 1, 2})
    code, _, err = _dpo(micro_model, micro_data, eval_file, capsys)
    assert code == 1
    assert f"{eval_file}:4: field 'label': missing, while 3 of the 40 items have one" in err, err[-2000:]
    assert not (project / "out" / "trained").exists()  # nothing trained


@pytest.mark.parametrize("gain,promoted", [(1.0, True), (-1.0, False)])
def test_a_metric_command_decides_the_gate_paired_by_item_id(project, micro_model, micro_data, capsys, gain,
                                                            promoted):
    eval_file = _eval_file(project, micro_data)
    command = f"python my_eval.py --model {{model}} --out {{out}} --eval {{eval_file}} --child-gain {gain}"
    code, out, err = _dpo(micro_model, micro_data, eval_file, capsys, "--set", "guards.gate_metric=command",
                          "--set", f"guards.metric_command={command}", "--set", ALL_ADVISORY)
    assert code == 0, err[-3000:]
    result = json.loads(out[out.index("{"):])
    metrics = result["metrics"]
    # d_i = gain * (1 + i % 3) over 40 items: mean = gain * (14*1 + 13*2 + 13*3) / 40 = 1.975 * gain
    assert metrics["guard/metric_delta"] == pytest.approx(1.975 * gain)
    assert metrics["guard/metric_n_items"] == 40.0 and metrics["guard/gate_passed"] == float(promoted)
    assert result["registry"]["promoted"] is promoted
    tags = _client(project).get_model_version_by_alias("policy", "candidate").tags
    assert tags["guard.gate_metric"] == "command" and tags["guard.metric_delta"].startswith("+" if promoted else "-")
    if not promoted:
        assert "command gain -1.9750" in tags["guard.gate"]
    assert list((project / ".alignflow" / "probes").glob("*.metric.jsonl"))  # the parent's scores, cached


def test_a_failing_metric_command_fails_the_stage_before_it_registers(project, micro_model, micro_data, capsys):
    eval_file = _eval_file(project, micro_data)
    command = "python my_eval.py --model {model} --out {out} --eval {eval_file} --child-gain 1 --drop-one"
    code, _, err = _dpo(micro_model, micro_data, eval_file, capsys, "--set", "guards.gate_metric=command",
                        "--set", f"guards.metric_command={command}")
    assert code == 1
    assert "cover different items" in err and "only the parent's: ['q0']" in err, err[-2000:]
    assert not _client(project).search_model_versions("name='policy'")
