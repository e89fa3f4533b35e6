"""Issue 20: the stage commands that ``dvc repro`` runs (``alignflow sft``, ``dpo``, ...) run the data report
too, not only the flows: a training file of the user's own that holds eval prompts stops the command before
training, naming file, line and field, and leaves no model, no metrics file and no stage run behind.

The real command line runs in-process on a micro project (the micro model and data of conftest.py). A clean
file passes: the report's page and ``data/*`` metrics go to the stage's run, the metrics file DVC hashes holds
only ``eval/*`` and ``train/loss*`` (the report does not change training), and a passed report is remembered.
"""

from __future__ import annotations

import json

import pytest
import yaml

from flows.cli import main


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture()
def project(isolated_project, micro_model, micro_data):
    """params.yaml: dpo and sft from the micro model, sized to stop fast, evaluated on the micro eval set."""
    small = {"model_path": str(micro_model), "eval_file": str(micro_data["eval"]), "max_steps": 2, "batch_size": 8,
             "eval_items": 8, "num_threads": 1}
    params = {"dpo": {**small, "train_file": str(micro_data["preferences"]), "output_dir": "models/dpo",
                      "checkpoint_dir": "checkpoints/dpo"},
              "sft": {**small, "train_file": str(micro_data["sft"]), "output_dir": "models/sft",
                      "checkpoint_dir": "checkpoints/sft"},
              "tracking": {"experiment": "stage-report", "log_model": False}}
    (isolated_project / "params.yaml").write_text(yaml.safe_dump(params))
    return isolated_project


def test_dpo_command_on_pairs_holding_eval_prompts_fails_before_training(project, micro_data, capsys):
    """Line 3 of the user's pairs is an eval prompt in other case and spacing: the gate (Great Expectations on
    each row) passes it, the data report does not."""
    pairs = _rows(micro_data["preferences"])[:40]
    eval_prompt = _rows(micro_data["eval"])[0]["prompt"]
    pairs[2]["prompt"] = "  " + eval_prompt.upper().replace(" ", "   ")
    leaky = project / "my_pairs.jsonl"
    leaky.write_text("".join(json.dumps(r) + "\n" for r in pairs))

    code = main(["dpo", "--set", f"train_file={leaky}", "--metrics-file", "metrics/dpo.json"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"{leaky}: data report FAILED for the preference dataset" in err, err
    assert f"{leaky}:3: field 'prompt': eval contamination: found in the eval set" in err, err
    assert not (project / "models").exists() and not (project / "metrics" / "dpo.json").exists()
    assert not (project / "checkpoints").exists()
    if (project / "mlflow.db").exists():  # no stage run was started
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("stage-report")
        assert experiment is None or not client.search_runs([experiment.experiment_id])
    # data_report.* overrides reach the report; a looser duplicate threshold does not excuse contamination.
    assert main(["dpo", "--set", f"train_file={leaky}", "--set", "data_report.max_duplicate_prompt_rate=1"]) == 1
    assert "eval contamination" in capsys.readouterr().err


def test_sft_command_logs_the_report_to_its_run_and_keeps_metrics_file_unchanged(project, micro_data, capsys):
    from mlflow.tracking import MlflowClient

    from rlhf_core.stages import gate
    from rlhf_core.config import DataReportConfig, SFTConfig, load_config

    assert main(["sft", "--metrics-file", "metrics/sft.json"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    written = json.loads((project / "metrics" / "sft.json").read_text())
    assert written and all(k.startswith(("eval/", "train/loss")) for k in written), written

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    run = client.get_run(out["run_id"])
    assert run.data.metrics["data/report_failed_expectations"] == 0
    assert run.data.metrics["data/eval_exact_matches"] == 0 and "data/repeated_chosen_rate" in run.data.metrics
    page = client.download_artifacts(run.info.run_id, "data_report/sft_train.html", str(project))
    assert "alignflow data report" in open(page, encoding="utf-8").read()

    # Remembered: the same file, kind, fields, thresholds and eval set read the stored result, not a new report.
    cfg = load_config(SFTConfig, "sft", "params.yaml")
    records = list((project / ".alignflow" / "data_reports").glob("*.json"))
    assert len(records) == 1
    stored = json.loads(records[0].read_text())
    stored["stats"]["data/marker"] = 42.0
    records[0].write_text(json.dumps(stored))
    datasets = {"sft_train": (cfg.train_file, "training"), "eval": (cfg.eval_file, "evaluation")}
    again = gate.report_datasets(cfg, datasets, None, DataReportConfig(), cfg.eval_file)
    assert again["sft_train"]["stats"]["data/marker"] == 42.0
    stricter = gate.report_datasets(cfg, datasets, None, DataReportConfig(ngram=8), cfg.eval_file)
    assert "data/marker" not in stricter["sft_train"]["stats"]  # other thresholds: a report of its own
