"""Issue 18's acceptance: each malformed conversational record — a wrong role, a missing assistant
turn, chosen and rejected with different prompts in the implicit form, a message without
``content`` — is refused by ``alignflow validate`` with file, line and field, and nothing trains.

The validate command runs as a user runs it (a fresh process); the training commands run in
process, as in test_bad_inputs, and stop at the Great Expectations gate before any model is read;
a KTO-only align flow stops at its validate task.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_cli

from flows.cli import main


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


# kind, extra CLI arguments, rows, and (line, field) of each malformed record.
FILES = {
    "preference": ("preference", [], [
        {"chosen": [U("1+1="), A("2")], "rejected": [U("1+1="), A("3")]},
        {"chosen": [{"role": "robot", "content": "1+2="}, A("3")],
         "rejected": [{"role": "robot", "content": "1+2="}, A("4")]},  # wrong role
        {"chosen": [U("1+3="), U("4")], "rejected": [U("1+3="), A("5")]},  # missing assistant turn
        {"chosen": [U("1+4="), A("5")], "rejected": [U("1+5="), A("6")]},  # implicit: different prompts
        {"chosen": [U("1+6="), {"role": "assistant"}], "rejected": [U("1+6="), A("8")]},  # no content
    ], [(2, "chosen"), (3, "chosen"), (4, "rejected"), (5, "chosen")]),
    "sft": ("sft", [], [
        {"prompt": [U("1+1=")], "completion": [A("2")]},
        {"prompt": [{"role": "human", "content": "1+2="}], "completion": [A("3")]},  # wrong role
        {"prompt": [U("1+3=")], "completion": [U("4")]},  # missing assistant turn
        {"prompt": [U("1+4=")], "completion": [{"role": "assistant", "text": "5"}]},  # no content
    ], [(2, "prompt"), (3, "completion"), (4, "completion")]),
    "unpaired": ("unpaired", ["--set", "desirable_field=label"], [
        {"prompt": [U("1+1=")], "completion": [A("2")], "label": True},
        {"prompt": [{"role": "bot", "content": "1+2="}], "completion": [A("3")], "label": False},  # wrong role
        {"prompt": [U("1+3=")], "completion": [U("4")], "label": True},  # missing assistant turn
        {"prompt": [U("1+4=")], "completion": [{"role": "assistant"}], "label": True},  # no content
    ], [(2, "prompt"), (3, "completion"), (4, "completion")]),
}


def _write(folder, name, rows):
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", list(FILES))
def test_validate_refuses_each_malformed_conversational_record(tmp_path, name):
    kind, extra, rows, bad = FILES[name]
    path = _write(tmp_path, name, rows)
    proc = run_cli(["validate", "--kind", kind, str(path), "--report", str(tmp_path / "r.json"), *extra], tmp_path)
    assert proc.returncode == 1, proc.stderr
    for line, field in bad:
        where = rf"^{re.escape(str(path))}:{line}: field '{field}': "
        assert re.search(where, proc.stderr, flags=re.MULTILINE), proc.stderr
    assert f"{path}:1:" not in proc.stderr  # the good first record is not blamed
    assert "Traceback" not in proc.stderr and not (tmp_path / "r.json").exists()
    good = _write(tmp_path, f"{name}-good", rows[:1])
    assert run_cli(["validate", "--kind", kind, str(good), *extra], tmp_path).returncode == 0


@pytest.fixture()
def project(isolated_project, micro_model, micro_data):
    """Every stage pointed at the micro model and data (what a stage would train from)."""
    import yaml

    common = {"model_path": str(micro_model), "eval_file": str(micro_data["eval"]), "max_steps": 2,
              "eval_items": 8, "num_threads": 1, "batch_size": 8}
    params = {"sft": {**common, "train_file": str(micro_data["sft"])},
              "dpo": {**common, "train_file": str(micro_data["preferences"])},
              "kto": {**common, "train_file": str(micro_data["preferences"])},
              "tracking": {"experiment": "conversational-gate"}}
    (isolated_project / "params.yaml").write_text(yaml.safe_dump(params))
    return isolated_project


@pytest.mark.parametrize("stage, name", [("dpo", "preference"), ("sft", "sft"), ("kto", "unpaired")])
def test_a_training_stage_given_such_a_file_does_not_train(project, capsys, stage, name):
    _, extra, rows, bad = FILES[name]
    path = _write(project, name, rows)
    code = main([stage, "--set", f"train_file={path}", *extra])
    err = capsys.readouterr().err
    assert code == 1, err
    # the error's first findings (5 lines and 400 characters at most); `alignflow validate` prints them all
    shown = [f"{path}:{line}: field '{field}'" in err for line, field in bad]
    assert any(shown) and (all(shown) or f"alignflow validate --kind {name} " in err), err
    assert "Traceback" not in err
    assert not (project / "models" / stage).exists()
    assert not list((project / "checkpoints").glob(f"{stage}/step-*"))


@pytest.mark.usefixtures("prefect_server")
def test_a_kto_flow_given_such_a_file_stops_at_the_gate(isolated_project):
    """``flow align`` with KTO as the only aligner checks the preference file as unpaired data (TRL's
    `label` mapped by kto.desirable_field): a malformed conversational record stops the flow at its
    validate task, before any model is built."""
    from helpers import write_micro_params
    from mlflow.tracking import MlflowClient

    from flows.align import align
    from rlhf_core.data.validate import ValidationFailed

    write_micro_params(isolated_project)
    _, _, rows, bad = FILES["unpaired"]
    path = _write(isolated_project, "kto", rows)
    with pytest.raises(ValidationFailed) as caught:
        align(params_file="params.yaml", preference_file=str(path),
              overrides={"flow": {"stages": ["kto"]}, "kto": {"desirable_field": "label"}})
    text = caught.value.report.render()
    assert caught.value.report.kind == "unpaired"
    recorded = path.relative_to(isolated_project)  # a flow records an input inside the project relative to it
    for line, field in bad:
        assert f"{recorded}:{line}: field '{field}'" in text, text
    assert not (isolated_project / "models").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{isolated_project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("alignflow-test").experiment_id])
    status = {(r.info.run_name, r.info.status) for r in runs}
    assert ("validate-preferences", "FAILED") in status and ("align", "FAILED") in status
    assert not {name for name, _ in status} & {"build-model", "sft", "kto"}
