"""Tiny-model SFT: parameters change, the loss falls, the result is a loadable HF directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import SFTConfig
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.trainers.sft import train_sft
from conftest import Recorder




def _cfg(micro_model, micro_data, tmp_path, **kw):
    base = dict(model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
                output_dir=str(tmp_path / "sft"), checkpoint_dir=str(tmp_path / "ckpt"), max_steps=40,
                batch_size=32, lr=3e-3, warmup_steps=5, eval_every=20, eval_items=50, num_threads=2)
    return SFTConfig(**{**base, **kw})


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_changes_parameters_and_lowers_loss(micro_model, micro_data, tmp_path, packing):
    before = load_file(str(micro_model / "model.safetensors"))
    sink = Recorder()
    result = train_sft(_cfg(micro_model, micro_data, tmp_path, packing=packing, save_every=20), sink,
                       show_progress=False)
    after = load_file(str(result.output_dir / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), "every tensor should have been updated"
    losses = sink.series("train/loss")
    assert losses[-1] < losses[0] * 0.7, losses
    assert sink.series("eval/loss") and 0.0 <= result.metrics["eval/accuracy"] <= 1.0
    assert {"train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s"} <= set(sink.rows[0][1])
    # a loadable HF directory with lineage beside the weights; the finished run's checkpoints stay with its
    # finished record until the stage has tracked the model (rlhf_core.stages.wrappers clears them)
    assert load_causal_lm(result.output_dir, torch.device("cpu")).config.model_type == "qwen2"
    assert json.loads((result.output_dir / "alignflow.json").read_text())["stage"] == "sft"
    assert (tmp_path / "ckpt" / "finished.json").is_file()


def test_sft_is_deterministic(micro_model, micro_data, tmp_path):
    """Same config, same machine: byte-identical weights (what lets dvc.lock md5s repeat)."""
    from rlhf_core.tracking.lineage import dvc_md5

    a = train_sft(_cfg(micro_model, micro_data, tmp_path / "a", max_steps=10, eval_every=0), show_progress=False)
    b = train_sft(_cfg(micro_model, micro_data, tmp_path / "b", max_steps=10, eval_every=0), show_progress=False)
    assert dvc_md5(a.output_dir / "model.safetensors") == dvc_md5(b.output_dir / "model.safetensors")


def test_grad_accumulation_matches_big_batch(micro_model, micro_data, tmp_path):
    """2 micro-batches of 16 accumulate to the gradient of one batch of 32 (token-weighted)."""
    from rlhf_core.data.io import read_records
    from rlhf_core.data.sequences import tokenize_sft_records
    from rlhf_core.data.tokenize import collate_padded
    from rlhf_core.algorithms.losses import token_nll_sum
    from rlhf_core.distributed.parallel import LocalStrategy
    from rlhf_core.trainers.step import accumulate_and_step

    tok = load_tokenizer(micro_model)
    recs = read_records(micro_data["sft"], limit=32)
    exs = tokenize_sft_records(tok, recs, path="x", prompt_field="prompt", completion_field="completion",
                               messages_field="messages", max_length=64)

    def loss_fn(model, batch):
        return token_nll_sum(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   use_cache=False).logits, batch["labels"])

    grads = []
    for micro in ([collate_padded(exs, tok.pad_token_id)],
                  [collate_padded(exs[:16], tok.pad_token_id), collate_padded(exs[16:], tok.pad_token_id)]):
        model = load_causal_lm(micro_model, torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        captured = {}
        orig_step = opt.step

        def step_and_capture(*a, **k):
            captured.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return orig_step(*a, **k)

        opt.step = step_and_capture
        accumulate_and_step(LocalStrategy(model, opt, sched), micro, loss_fn, max_grad_norm=0.0)
        grads.append(captured)
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4), name


def test_a_profiled_step_names_the_loops_host_phases(micro_model, micro_data, tmp_path):
    """Under torch.profiler each step's host work shows as ``alignflow#`` ranges, in the loop's order, so a
    profile's idle device gaps can be placed in the loop (bench/side_by_side.py --profile reads them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_sft(_cfg(micro_model, micro_data, tmp_path, max_steps=2, eval_every=0, eval_items=1, log_every=1),
                  show_progress=False)
    ranges = sorted((e.time_range.start, e.name) for e in prof.events() if e.name.startswith("alignflow#"))
    names = [name for _, name in ranges]
    # the step is launched behind the backward; step 1 then draws step 2's micro-batches while the device runs,
    # and only then reads its losses and norm (the last step draws nothing ahead)
    launch = ["alignflow#micro_batches", "alignflow#forward_backward", "alignflow#clip", "alignflow#optimizer_step"]
    after = ["alignflow#read_losses", "alignflow#count_tokens", "alignflow#log_metrics"]
    assert names == launch + ["alignflow#while_device_runs"] + after + launch + after
