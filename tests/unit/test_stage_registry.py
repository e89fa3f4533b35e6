"""A stage is declared once: a toy stage registered here, with a config class and a trainer function of this
test's own, is an ``alignflow`` command (in ``--help``, its fields listed, run to its trainer), a training
task of the worker, a stage of the align flow's chain (what the flow would run for it, read without training), one of the guarded stages
``alignflow diff`` compares, and a DVC stage of the generated ``dvc.yaml`` -- with no other file edited.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flows import cli
from rlhf_core.config import stage_registry as registry
from rlhf_core.config.stage_registry import DvcStage, Read, Stage

CALLS: list[dict[str, Any]] = []


@dataclass
class ToyConfig:
    """``toy``: a stage made up by this test."""

    model_path: str = "models/sft"
    """The model it starts from."""
    train_file: str = "data/embedded/sft.jsonl"
    """Its training data."""
    eval_file: str = "data/embedded/eval.jsonl"
    """Held-out items."""
    output_dir: str = "models/toy"
    """Where its model goes."""
    wiggle: float = 0.5
    """How much the toy trainer would change the model."""
    prompt_field: str = "prompt"
    """Field holding the prompt text."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else."""


@dataclass
class ToyResult:
    outputs: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"outputs": self.outputs}


def train_toy(cfg: ToyConfig, tracking: Any, parent_run_id: str | None = None, metrics_file: str | None = None,
              **extra: Any) -> ToyResult:
    """The toy stage's entry: records its call instead of training."""
    CALLS.append({"cfg": cfg, "metrics_file": metrics_file, "extra": sorted(extra)})
    return ToyResult({"model": cfg.output_dir})


TOY = Stage(
    "toy", "a made-up stage of the registry test", "toy", ToyConfig, f"{__name__}:train_toy",
    command=registry.TRAIN, reads=(Read("train_file", "sft", "sft"),), writes=("output_dir", "trains it"),
    trains=True, guarded=True, in_chain=True, task="train-toy",
    dvc=(DvcStage("toy", "alignflow toy --metrics-file metrics/toy.json", deps=("models/sft", "data/embedded/sft.jsonl"),
                  params=("toy",), outs=("models/toy",), metrics=("metrics/toy.json",)),))


@pytest.fixture
def toy():
    registry.register(TOY)
    CALLS.clear()
    yield TOY
    registry.unregister(TOY.name)


def test_a_registered_stage_is_a_command(toy, capsys, tmp_path):
    assert "a made-up stage of the registry test" in cli.build_parser().format_help()
    with pytest.raises(SystemExit):
        cli.main(["toy", "--help"])
    help_text = capsys.readouterr().out
    assert "fields of 'toy'" in help_text and "wiggle" in help_text and "--register" in help_text
    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    model.mkdir()
    data.write_text("{}\n")
    assert cli.main(["toy", "--params", str(tmp_path / "none.yaml"), "--set", f"model_path={model}",
                     "--set", f"train_file={data}", "--set", "eval_file=", "--set", "wiggle=2",
                     "--metrics-file", "m.json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"outputs": {"model": "models/toy"}}
    (call,) = CALLS
    assert call["cfg"].wiggle == 2 and call["metrics_file"] == "m.json"
    assert call["extra"] == ["data_report", "guards"]  # a guarded training stage


def test_a_registered_stage_is_in_the_align_chain(toy, monkeypatch):
    from flows import align
    from flows.params import load_all

    cfg = load_all(None, {"flow": {"stages": ["dpo", "toy"]}})
    assert "toy" in load_all(None, None)["flow"].stages  # the chain's default: every stage in it
    chain = align.alignment_chain(cfg["flow"].stages)
    assert [stage.name for stage, _ in chain] == ["dpo", "toy"]
    ran = []
    monkeypatch.setattr(align, "_run", lambda task_fn, cache, **kw: ran.append((task_fn.name, kw)) or
                        {"outputs": {"model": "m"}, "md5": {"model": "x"}, "metrics": {}})
    files = {name: f"data/{name}.jsonl" for name in ("sft", "preferences", "prompts", "eval")}
    md5 = {name: f"md5-{name}" for name in files}
    align.run_alignment_stages(cfg, files, md5, {"outputs": {"model": "models/sft"}, "md5": {"model": "md5-sft"}},
                               {"prompt_field": "prompt"}, {}, "parent", cfg["flow"])
    task_name, kwargs = ran[-1]
    assert task_name == "train-toy"
    assert kwargs["params"]["train_file"] == "data/sft.jsonl" and kwargs["params"]["model_path"] == "models/sft"
    assert kwargs["input_md5"] == {"model": "md5-sft", "train": "md5-sft", "eval": "md5-eval"}
    assert "guards" in kwargs


def test_a_registered_stage_runs_in_the_training_worker(toy):
    """What the Prefect task runs, in the flow's process or a child: the stage's config built and its entry called."""
    from tasks.worker import run_inline

    out = run_inline("toy", {"wiggle": 3.0, "output_dir": "models/toy3"}, {}, None, guards={})
    assert out == {"outputs": {"model": "models/toy3"}}
    (call,) = CALLS
    assert isinstance(call["cfg"], ToyConfig) and call["cfg"].wiggle == 3.0 and call["extra"] == ["guards"]


def test_a_registered_guarded_stage_is_compared_by_diff(toy):
    from flows import diff

    assert "toy" in diff.guarded_stages()
    assert "toy" in " ".join(diff.build_parser().format_help().split())


def test_a_registered_stage_is_a_dvc_stage(toy):
    from flows import dvc_stages

    text = dvc_stages.generate(Path(dvc_stages.REPO))["dvc.yaml"]
    assert "  toy:\n    cmd: alignflow toy --metrics-file metrics/toy.json\n    deps:\n      - models/sft\n" in text
    block = text.split("  toy:\n", 1)[1].split("\n\n", 1)[0]
    assert f"      - {Path(__file__).relative_to(dvc_stages.REPO)}" not in block  # a test is not alignflow code
    assert "      - flows/cli.py" in block and "    params:\n      - toy" in block
    template = dvc_stages.generate(Path(dvc_stages.REPO))["flows/project_template/dvc.yaml"]
    assert "  toy:\n" in template


def test_registering_a_taken_name_fails(toy):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(TOY)
