"""Tiny-model KTO and distillation: parameters change and the training signal moves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import DistillConfig, KTOConfig
from rlhf_core.data.io import DataError, read_records
from rlhf_core.models.loading import ModelLoadError, load_tokenizer
from rlhf_core.trainers.distill import check_same_vocabulary, train_distill
from rlhf_core.trainers.kto import train_kto, unpaired_examples
from conftest import Recorder




def _changed(before_dir, after_dir) -> bool:
    before = load_file(str(before_dir / "model.safetensors"))
    after = load_file(str(after_dir / "model.safetensors"))
    return any(not torch.equal(before[k], after[k]) for k in before)


def test_kto_separates_desirable_from_undesirable(micro_model, micro_data, tmp_path):
    """From preference pairs split into unpaired examples: after training, the implicit reward
    beta * log(pi/ref) of desirable completions exceeds that of undesirable ones."""
    sink = Recorder()
    cfg = KTOConfig(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                    eval_file=str(micro_data["eval"]), output_dir=str(tmp_path / "kto"), max_steps=30,
                    batch_size=16, lr=3e-3, warmup_steps=2, eval_items=20, beta=0.5)
    result = train_kto(cfg, sink, show_progress=False)
    assert _changed(micro_model, result.output_dir)
    good, bad = sink.series("train/reward_desirable"), sink.series("train/reward_undesirable")
    assert good[-1] - bad[-1] > good[0] - bad[0] and good[-1] > bad[-1], (good, bad)
    losses = sink.series("train/loss")
    assert losses[-1] < losses[0], losses
    assert all(z >= 0 for z in sink.series("train/kl_reference_point"))
    assert "eval/accuracy" in result.metrics


def test_kto_reads_unpaired_files_and_rejects_bad_flags(tmp_path):
    good = tmp_path / "kto.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "1+1=", "completion": "2", "desirable": True},
        {"prompt": "1+2=", "completion": "4", "desirable": False},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ]) + "\n")
    cfg = KTOConfig()
    examples = unpaired_examples(read_records(good), cfg, good)
    assert [(e.completion, e.desirable) for e in examples] == [("2", True), ("4", False), ("4", True), ("5", False)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "desirable": True}) + "\n"
                   + json.dumps({"prompt": "1+2=", "completion": "3", "desirable": "yes"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: field 'desirable': must be true or false"):
        unpaired_examples(read_records(bad), cfg, bad)


def test_distillation_moves_the_student_towards_the_teacher(micro_model, llama_chat_model, micro_data, tmp_path):
    """Teacher: a differently shaped model on the same tokenizer. The KL (train/loss with
    nll_weight 0) falls as the student learns the teacher's next-token distributions."""
    sink = Recorder()
    cfg = DistillConfig(model_path=str(micro_model), teacher_path=str(llama_chat_model),
                        train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
                        output_dir=str(tmp_path / "distill"), max_steps=30, batch_size=16, lr=3e-3,
                        warmup_steps=2, eval_items=20)
    result = train_distill(cfg, sink, show_progress=False)
    assert _changed(micro_model, result.output_dir)
    kl = sink.series("train/loss")
    assert kl[-1] < 0.5 * kl[0], kl


def test_distillation_needs_one_vocabulary(micro_model):
    student = load_tokenizer(micro_model)
    teacher = load_tokenizer(micro_model)
    teacher.add_tokens(["<extra-token>"])
    with pytest.raises(ModelLoadError, match="same vocabulary"):
        check_same_vocabulary(micro_model, student, "teacher-dir", teacher)
