"""Tiny-model DPO/IPO/cDPO: parameters change, the implicit-reward accuracy and margin rise."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import DPOConfig
from rlhf_core.trainers.dpo import train_dpo
from conftest import Recorder




def _cfg(micro_model, micro_data, tmp_path, **kw):
    base = dict(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                eval_file=str(micro_data["eval"]), output_dir=str(tmp_path / "dpo"), max_steps=30, batch_size=16,
                lr=3e-3, warmup_steps=2, eval_items=20, beta=0.5, nll_weight=0.0)
    return DPOConfig(**{**base, **kw})


@pytest.mark.parametrize("loss", ["dpo", "ipo", "cdpo"])
def test_dpo_family_learns_the_preferences(micro_model, micro_data, tmp_path, loss):
    sink = Recorder()
    extra = {"label_smoothing": 0.1} if loss == "cdpo" else {}
    result = train_dpo(_cfg(micro_model, micro_data, tmp_path, loss=loss, **extra), sink, show_progress=False)
    before = load_file(str(micro_model / "model.safetensors"))
    after = load_file(str(result.output_dir / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    acc, margin = sink.series("train/reward_accuracy"), sink.series("train/reward_margin")
    assert acc[-1] > 0.8 and margin[-1] > margin[0], (acc, margin)
    losses = sink.series("train/loss")
    assert losses[-1] < losses[0], losses


def test_live_reference_matches_precomputed(micro_model, micro_data, tmp_path):
    """Same data order and reference: the first logged loss is identical either way."""
    runs = []
    for live in (False, True):
        sink = Recorder()
        train_dpo(_cfg(micro_model, micro_data, tmp_path / str(live), max_steps=10, precompute_reference=not live,
                       nll_weight=0.5), sink, show_progress=False)
        runs.append(sink.series("train/loss"))
    assert runs[0] == pytest.approx(runs[1], rel=1e-4)
