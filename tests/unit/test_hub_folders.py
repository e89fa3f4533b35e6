"""A local folder in the Hugging Face Hub's dataset layout as an input: its train split found the
way ``datasets.load_dataset(folder)`` finds it, read shard by shard with each record's shard and
line, loading scripts refused, and its DVC md5 and MLflow dataset input recorded as for a file."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from rlhf_core.data.io import DataError, hub_train_files, read_records
from rlhf_core.tracking.lineage import dvc_md5

PAIRS = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(7)]


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet_folder(root, card="---\nlicense: mit\n---\n# Pairs\n"):
    """``push_to_hub``'s layout: data/<split>-0000i-of-0000n.parquet and a README card."""
    (root / "data").mkdir(parents=True)
    pd.DataFrame(PAIRS[:3]).to_parquet(root / "data" / "train-00000-of-00002.parquet")
    pd.DataFrame(PAIRS[3:5]).to_parquet(root / "data" / "train-00001-of-00002.parquet")
    pd.DataFrame(PAIRS[5:]).to_parquet(root / "data" / "test-00000-of-00001.parquet")
    (root / "README.md").write_text(card)
    return root


def test_parquet_shards_of_the_train_split_in_order(tmp_path):
    folder = _parquet_folder(tmp_path / "ds")
    records = read_records(folder)
    assert [r.data for r in records] == PAIRS[:5]  # the test split is not read
    first, second = (str(folder / "data" / f"train-0000{i}-of-00002.parquet") for i in (0, 1))
    assert [(r.source, r.line) for r in records] == [(first, 1), (first, 2), (first, 3), (second, 1), (second, 2)]


def test_card_configs_choose_the_files(tmp_path):
    """The README's YAML ``configs:`` decide which files are the train split, as for load_dataset."""
    folder = tmp_path / "ds"
    _jsonl(folder / "raw" / "first.jsonl", PAIRS[:2])
    _jsonl(folder / "raw" / "second.jsonl", PAIRS[2:4])
    _jsonl(folder / "train.jsonl", PAIRS[4:])  # would be the train split by its name, without the card
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                      "    path: raw/*.jsonl\n---\n")
    assert [r.data for r in read_records(folder)] == PAIRS[:4]
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: a\n  data_files: raw/first.jsonl\n"
                                      "- config_name: b\n  data_files: raw/second.jsonl\n---\n")
    with pytest.raises(DataError, match=r"not a readable dataset folder \(.*Config name is missing.*\); mark one "
                                        r"config of the README `default: true`"):
        read_records(folder)


def test_split_named_files_without_a_card(tmp_path):
    folder = tmp_path / "ds"
    _jsonl(folder / "train.jsonl", PAIRS[:2])
    _jsonl(folder / "validation.jsonl", PAIRS[2:])
    assert hub_train_files(folder) == [folder / "train.jsonl"]
    (folder / "validation.jsonl").rename(folder / "test.jsonl")
    (folder / "train.jsonl").unlink()
    with pytest.raises(DataError, match=r"ds: no 'train' split in this dataset folder \(has \['test'\]\)"):
        read_records(folder)


def test_a_broken_line_names_its_shard(tmp_path):
    folder = tmp_path / "ds"
    _jsonl(folder / "data" / "train-00000-of-00002.jsonl", PAIRS[:2])
    shard = _jsonl(folder / "data" / "train-00001-of-00002.jsonl", PAIRS[2:4])
    shard.write_text(shard.read_text() + '{"prompt": "9+1=", "chosen": \n')
    with pytest.raises(DataError, match=rf"^{shard}:3: not valid JSON"):
        read_records(folder)


def test_loading_scripts_and_unsupported_shards_are_refused(tmp_path):
    folder = tmp_path / "ds"
    _jsonl(folder / "train.jsonl", PAIRS)
    (folder / "ds.py").write_text("import datasets\n")
    with pytest.raises(DataError, match=r"ds: holds a dataset loading script \(ds\.py\): scripts run code"):
        read_records(folder)
    (folder / "ds.py").unlink()
    (folder / "train.jsonl").unlink()
    (folder / "train.csv").write_text("prompt,chosen,rejected\n1+1=,2,3\n")
    with pytest.raises(DataError, match=r"train\.csv: unsupported shard format '\.csv'"):
        read_records(folder)


def test_saved_datasets_folders_still_load_from_disk(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(PAIRS[:4]),
                          "test": datasets.Dataset.from_list(PAIRS[4:])}).save_to_disk(str(tmp_path / "saved"))
    records = read_records(tmp_path / "saved")
    assert [r.data for r in records] == PAIRS[:4] and records[0].source is None


def test_folder_md5_and_mlflow_input_as_for_a_file(isolated_project):
    """``dvc add`` records the folder's md5 that ``dvc_md5`` computes; a stage's MLflow dataset input
    for the folder carries that md5 as digest, the folder as source and rows from its shards."""
    from mlflow.tracking import MlflowClient

    from rlhf_core.config import TrackingConfig
    from rlhf_core.tracking.mlflow_runs import start_run

    folder = _parquet_folder(isolated_project / "ds")
    dvc = [sys.executable, "-m", "dvc"]
    subprocess.run(["git", "init", "-q"], cwd=isolated_project, check=True)
    subprocess.run(dvc + ["init", "-q"], cwd=isolated_project, check=True)
    subprocess.run(dvc + ["add", "-q", "ds"], cwd=isolated_project, check=True)
    recorded = yaml.safe_load((isolated_project / "ds.dvc").read_text())["outs"][0]["md5"]
    assert dvc_md5(folder) == recorded and recorded.endswith(".dir")

    file = _jsonl(isolated_project / "pairs.jsonl", PAIRS[:5])
    with start_run(TrackingConfig(experiment="hub-folders"), "dpo") as run:
        run.log_input(folder, "preferences", dvc_md5(folder), "training")
        run.log_input(file, "preferences_file", dvc_md5(file), "training")
        run_id = run.run_id
    inputs = {i.dataset.name: i for i in MlflowClient().get_run(run_id).inputs.dataset_inputs}
    for name, path in (("preferences", folder), ("preferences_file", file)):
        ds = inputs[name].dataset
        assert ds.digest == dvc_md5(path)[:36]
        assert json.loads(ds.source)["uri"] == str(path.resolve())
        assert json.loads(ds.profile)["num_rows"] == 5  # the train split's two shards: 3 + 2 rows
        assert {t.key: t.value for t in inputs[name].tags}["mlflow.data.context"] == "training"
