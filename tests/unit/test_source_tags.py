"""A training stage's run names where a generated dataset came from: the package, its version, the task and its
config, read from the ``manifest.json`` that ``alignflow gym-generate`` writes beside its files."""

from __future__ import annotations

import json

from rlhf_core.tracking.stage_run import source_tags


def test_a_generated_folder_tags_its_source_and_a_plain_one_none(tmp_path):
    gym, plain = tmp_path / "real", tmp_path / "mine"
    gym.mkdir()
    plain.mkdir()
    (gym / "manifest.json").write_text(json.dumps({"package": "reasoning-gym", "version": "0.1.25",
                                                   "task": "basic_arithmetic", "task_config": {"max_terms": 2}}))
    (plain / "manifest.json").write_text("not json")  # a user's file of that name is not a source record
    datasets = {"prompts": (str(gym / "prompts.jsonl"), "training"), "eval": (str(plain / "eval.jsonl"), "eval"),
                "sft": (str(tmp_path / "nowhere" / "sft.jsonl"), "training")}
    assert source_tags(datasets) == {"source.prompts.package": "reasoning-gym==0.1.25",
                                     "source.prompts.task": "basic_arithmetic",
                                     "source.prompts.task_config": '{"max_terms": 2}'}
